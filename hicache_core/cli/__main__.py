"""``python -m hicache_core.cli``: the ``hicache`` command."""

import sys

from .main import main

sys.exit(main())
