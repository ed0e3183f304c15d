"""File-writing examples: a correct file-per-key backend under ``root`` and broken variants.

``GoodFile`` is the CONTRIBUTING.md template plus key validation at its I/O hook: each component
key is one file ``{root}/{key}``, written to a temp file then renamed. The suite gives ``root`` a
fresh directory under each test's ``tmp_path``, so a broken variant that writes outside its root
still writes inside the test's temporary directory. See ``broken_backends.py`` for the registry.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from hicache_core import Capabilities, DraftIo, DraftIoMode, IoOp, PoolName, check_key, check_keys, hookimpl

from .broken_backends import as_bytes, copy_into


class GoodFile:
    """A correct file-per-key backend (it must pass the whole suite)."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        root: str | None = None  # default: {tempdir}/hicache-broken-examples-file

    capabilities = Capabilities(v1=True, v2=False, persistent=True, shared=True, draft_io=DraftIoMode.GENERIC)

    def __init__(self, config: Any, options: GoodFile.Options) -> None:
        self.root = Path(options.root or Path(tempfile.gettempdir()) / "hicache-broken-examples-file")
        self.root.mkdir(parents=True, exist_ok=True)

    @hookimpl
    def hicache_register_pool(self, pool_name: PoolName, pool: Any) -> None:
        """A copying backend needs nothing from the pool."""

    @hookimpl
    def hicache_draft_io_capability(self) -> DraftIo:
        return DraftIo(DraftIoMode.GENERIC, "draft pages are copied under their own keys")

    def check(self, keys: Sequence[str]) -> None:
        """Refuse the whole batch when a key is not a safe file name (KeyFormatError)."""
        check_keys(keys)

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool]:
        self.check(keys)
        if op is IoOp.EXISTS:
            return [self._exists(key) for key in keys]
        assert buffers is not None
        if op is IoOp.SET:
            return [self._put(key, buf) for key, buf in zip(keys, buffers)]
        return [self._get(key, buf) for key, buf in zip(keys, buffers)]

    def _exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.root / key).st_mode)  # lstat: a symlink is no page
        except FileNotFoundError:
            return False

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        path = self.root / key
        if self._exists(key):
            return True  # same key, same bytes (page hashes chain): skipping is allowed
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        self.write(tmp, as_bytes(buf))
        os.replace(tmp, path)  # atomic: readers see the old state or the whole page
        return True

    def write(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)

    def _read(self, key: str) -> bytes | None:
        try:  # O_NOFOLLOW: a symlink planted in the root is never followed out of it
            with open(os.open(self.root / key, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                return f.read()
        except OSError:  # missing, a directory, or a symlink (ELOOP)
            return None

    def _get(self, key: str, buf: torch.Tensor) -> bool:
        data = self._read(key)
        if data is None or len(data) != buf.numel():
            return False  # a size mismatch is a miss, never a partial copy
        copy_into(buf, data)
        return True

    @hookimpl
    def hicache_clear(self, namespace: str) -> int:
        check_key(namespace)  # it names files: no '..', '/', glob characters
        removed, prefix = 0, namespace + "."
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.startswith(prefix):
                    os.unlink(entry.path)
                    removed += 1
        return removed


class FileNoKeyCheck(GoodFile):
    """The I/O hook trusts its keys: a key such as ``../x`` is written (and read) outside
    ``root``, as a sibling of the backend's directory.

    Breaks: design.md 4: "Keys are safe to use as file names: no separators and no `..`";
    CONTRIBUTING.md 1.4, ``hicache_page_keys``: "a backend that must validate the keys it is given
    checks a whole batch with `hicache_core.check_keys`".
    """

    def check(self, keys: Sequence[str]) -> None:
        return None


class FileInPlaceWrite(GoodFile):
    """SET writes the final file in place (no temp file + rename), in two halves on a slow
    device: while it writes, the key exists with a truncated object, so a concurrent EXISTS
    reports it present and a concurrent SET of the same page skips it as stored.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "`EXISTS` present and readable" and
    "`SET` durably and atomically published"; the template: "atomic: readers see the old state or
    the whole page".
    """

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        path = self.root / key
        if path.is_file():
            return True
        data = as_bytes(buf)
        half = len(data) // 2
        with open(path, "wb") as f:
            f.write(data[:half])
            f.flush()
            time.sleep(0.002)  # a slow device: the half-written object is visible meanwhile
            f.write(data[half:])
        return True


class FileOverwriteInPlace(GoodFile):
    """SET (re-)writes the final file in place, without truncating it and without a temp file +
    rename, in two halves on a slow device: a reader of a page being re-set with other bytes
    gets the new first half and the old second half (a torn page), and SET reports ``True``.

    Breaks: CONTRIBUTING.md 1.4, ``hicache_batch_io_v1``: "`SET` durably and atomically
    published (an existing key may be skipped and reported `True`)"; the template: "atomic:
    readers see the old state or the whole page".
    """

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        data = as_bytes(buf)
        half = len(data) // 2
        fd = os.open(self.root / key, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data[:half])
            time.sleep(0.002)  # a slow device: the half-written object is visible meanwhile
            os.write(fd, data[half:])
        finally:
            os.close(fd)
        return True
