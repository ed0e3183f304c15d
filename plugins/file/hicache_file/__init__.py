"""hicache-file: the embedded default hicache backend, pages as files on a local filesystem.

Select it with ``StorageConfig(backend="file", options={"root": ...})``; the entry point
``file = "hicache_file:FileBackend"`` in group ``hicache.backends`` makes it discoverable.
See ``plugins/file/README.md`` for the options and the on-disk format.
"""

from __future__ import annotations

from ._backend import FileBackend
from ._errors import FileRootError
from ._format import FORMAT_VERSION
from ._options import FileOptions, default_root
from ._stats import FileStats

__all__ = ["FORMAT_VERSION", "FileBackend", "FileOptions", "FileRootError", "FileStats", "default_root"]
__version__ = "0.2.0"
