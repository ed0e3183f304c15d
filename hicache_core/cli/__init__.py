"""The ``hicache`` command line: ``backends``, ``check`` and ``bench``."""

from .command import main

__all__ = ["main"]
