"""Build hook for the optional ``hicache_file._fastio`` C extension (metadata: ``pyproject.toml``).

The extension runs a batch's page syscalls with the GIL released. It is optional: when it
cannot be compiled, installation succeeds with a warning and the backend uses its pure-Python
I/O path (same files, same results, slower with several I/O threads). Set
``HICACHE_REQUIRE_NATIVE=1`` to make a failed build an error (CI does).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError, ValueError)


class OptionalBuildExt(build_ext):
    """``build_ext`` that warns instead of failing, unless ``HICACHE_REQUIRE_NATIVE`` is set."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except _ERRORS as exc:
            if os.environ.get("HICACHE_REQUIRE_NATIVE", "") not in ("", "0"):
                raise
            print(
                f"WARNING: hicache-file: building {ext.name} failed ({exc}); the pure-Python I/O "
                "path will be used. Install a C compiler and the Python headers, then reinstall.",
                file=sys.stderr,
            )


setup(
    ext_modules=[
        Extension(
            "hicache_file._fastio",
            [
                "hicache_file/_fastio.c",
                "hicache_file/_fastio_format.c",
                "hicache_file/_fastio_page.c",
                "hicache_file/_fastio_xxh3.c",
            ],
            depends=["hicache_file/_fastio.h"],
            extra_compile_args=["-O2", "-pthread"] if sys.platform != "win32" else [],
            extra_link_args=["-pthread"] if sys.platform != "win32" else [],
            libraries=["dl"] if sys.platform == "linux" else [],
            optional=sys.platform != "linux",
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
