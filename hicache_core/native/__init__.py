"""The core's optional C code: ``_pagehash`` (chained page hashing over OpenSSL's SHA-256).

The extension is built by ``setup.py`` when a C compiler is available; every caller has a
pure-Python twin that produces identical results, so a missing build only costs speed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..env import env_flag

__all__ = ["load_extension"]


def load_extension(name: str, pure_python_env: str) -> ModuleType | None:
    """The extension ``hicache_core.native.<name>``, or ``None`` when it is not built or the
    environment switch ``pure_python_env`` (a name in :mod:`hicache_core.env`) is on."""
    if env_flag(pure_python_env):
        return None
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError:
        return None
