"""The ``hicache`` command line: ``backends``, ``check`` and ``bench``."""

from .main import main

__all__ = ["main"]
