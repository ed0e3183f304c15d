"""``python -m hicache_core.cli``: the ``hicache`` command."""

import sys

from .command import main

sys.exit(main())
