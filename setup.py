"""Build hook for the optional ``hicache_core.native._pagehash`` C extension.

All project metadata lives in ``pyproject.toml``; this file only declares the extension.
The extension links OpenSSL's libcrypto for SHA-256. It is optional: if it cannot be compiled
(no C compiler, no Python headers, no OpenSSL headers), installation still succeeds with a
warning and ``hicache_core.paging.hashes`` falls back to its pure-Python implementation. Set
``HICACHE_REQUIRE_NATIVE=1`` to turn a failed build into an error instead (useful in CI and
wheel builds).

The extension uses only the documented public C API (``tests/core/test_native.py`` checks its
source for struct fields and private ``_Py`` names); it reads lists with ``PyList_GET_ITEM``,
which the limited API lacks, so it is built for the running interpreter only.
"""

from __future__ import annotations

import os
import sys
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError, ValueError)


def _require_native() -> bool:
    return os.environ.get("HICACHE_REQUIRE_NATIVE", "") not in ("", "0")


def _skip_native() -> bool:
    """``HICACHE_SKIP_NATIVE=1``: declare no extension. For a second editable venv on a source
    tree whose extension the first one built: its in-place build would rewrite the ``.so`` that
    running processes have mapped (``integrations/vllm/setup-dev.sh`` sets it)."""
    return os.environ.get("HICACHE_SKIP_NATIVE", "") not in ("", "0")


def _warn(what: str, exc: BaseException) -> None:
    msg = (
        f"hicache: {what} failed ({type(exc).__name__}: {exc}); using the pure-Python page "
        "hashing fallback (slower). Install a C compiler, the Python headers and the OpenSSL "
        "headers (Debian: apt-get install libssl-dev), then reinstall, to get the native one."
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=1)
    print(f"WARNING: {msg}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """``build_ext`` that warns instead of failing when an extension cannot be built."""

    def run(self) -> None:
        try:
            super().run()
        except _BUILD_ERRORS as exc:
            if _require_native():
                raise
            _warn("building the C extensions", exc)

    def build_extension(self, ext: Extension) -> None:
        if self.compiler.compiler_type == "unix":
            ext.extra_compile_args = [*ext.extra_compile_args, "-O3"]
        try:
            super().build_extension(ext)
        except _BUILD_ERRORS as exc:
            if _require_native():
                raise
            _warn(f"building {ext.name}", exc)


setup(
    ext_modules=[]
    if _skip_native()
    else [
        Extension(
            "hicache_core.native._pagehash",
            ["hicache_core/native/_pagehash.c"],
            libraries=["crypto"],
            # Lets an in-place/editable build skip copying a module that failed to build.
            optional=not _require_native(),
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
