"""Examples of defects only the guard tests catch (hicache_core/testing/_t_guard.py and two
store tests): each path reading its own writes, SET writing host memory, a write after GET
returned, zero pages, symlinks and model names that lead out of the root, and threads left
behind by closed stores.
See ``broken_backends.py`` for the registry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from hicache_core import IoOp, PoolName, hookimpl

from .broken_backends import GoodMemory, copy_into
from .broken_backends_file import GoodFile


class V2ReversesComponents(GoodMemory):
    """v2 pairs a page's component keys with its views in reverse order, on SET and on GET alike:
    v2 reads its own writes, but an MHA page set over v1 and read over v2 (or the other way) has
    K's bytes in V and V's in K, reported ``True``.

    Breaks: R11: "GET `True` means the buffer now holds exactly the bytes of the last successful
    SET of that key".
    """

    def page_io(self, op: IoOp, keys: Sequence[str], views: Sequence[torch.Tensor] | None) -> bool:
        return super().page_io(op, keys, None if views is None else list(reversed(views)))


class SetZeroesSource(GoodMemory):
    """After copying a page out, SET zeroes the host buffers of the pools other than KV ("the
    staging copy is done").

    Breaks: R38: "Host memory is read-only to SET and EXISTS".
    """

    @hookimpl
    def hicache_batch_io_v1(
        self, op: IoOp, keys: Sequence[str], buffers: Sequence[torch.Tensor] | None, pool_name: PoolName
    ) -> list[bool] | None:
        out = super().hicache_batch_io_v1(op, keys, buffers)
        if op is IoOp.SET and pool_name is not PoolName.KV:
            for buf in buffers or ():
                buf.zero_()
        return out


class GetWritesLater(GoodMemory):
    """GET copies the page and returns ``True``; 30 ms later a timer copies the stored bytes into
    the same buffer again (a "verify and repair" pass), into a slot the caller may have reused.

    Breaks: R20: "Buffers are lent for the call only: a backend never keeps a reference to one or
    touches it after the hook returns".
    """

    def get(self, key: str, buf: torch.Tensor) -> bool:
        ok = super().get(key, buf)
        blob = self.data.get(key)
        if ok and blob is not None:
            threading.Timer(0.03, copy_into, (buf, blob)).start()
        return ok


class ZeroPageMarker(GoodMemory):
    """An all-zero component is stored as an empty marker; GET fills zeros for it, but EXISTS counts
    only non-empty objects ("an empty object is a torn write").

    Breaks: R15: "EXISTS `True` means present and readable"; R17: "SET `True` means the object is
    published: from then on EXISTS and GET of that key succeed".
    """

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(self.data.get(k)) for k in keys]

    def put(self, key: str, buf: torch.Tensor) -> bool:
        if not bool(buf.any()):
            self.data[key] = b""
            return True
        return super().put(key, buf)

    def get(self, key: str, buf: torch.Tensor) -> bool:
        if self.data.get(key) == b"":
            buf.zero_()
            return True
        return super().get(key, buf)


class ThreadPerStore(GoodMemory):
    """Each store starts a background "compaction" thread and has no ``hicache_close``: every closed
    store leaves a running thread behind.

    Breaks: R2: "`hicache_close` releases what it opened".
    """

    def __init__(self, config: Any, options: Any) -> None:
        super().__init__(config, options)
        threading.Thread(target=self._compact, daemon=True, name="broken-compactor").start()

    def _compact(self) -> None:
        while True:
            time.sleep(0.05)


class FileSkipsWhatItWrote(GoodFile):
    """SET skips keys this store wrote before (a per-store "written" set), dropped only by its own
    clear: after another store clears the namespace, SET reports ``True`` and stores nothing.

    Breaks: R17: "SET `True` means the object is published".
    """

    def __init__(self, config: Any, options: GoodFile.Options) -> None:
        super().__init__(config, options)
        self.written: set[str] = set()

    def _put(self, key: str, buf: torch.Tensor) -> bool:
        if key in self.written:
            return True
        self.written.add(key)
        return super()._put(key, buf)


class FileFollowsSymlinks(GoodFile):
    """GET reads ``root / key`` with ``Path.read_bytes`` (which follows symlinks): a file under the
    root replaced by a symlink is read from wherever it points.

    Breaks: R25: "nothing outside the backend's storage is created, read or changed".
    """

    def _read(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except OSError:
            return None


class FileRootPerModel(GoodFile):
    """The root is split per model: ``{root}/{config.model_name}/{key}``; a model name such as
    ``../x`` or an absolute path (engines pass model paths) leads out of the root.

    Breaks: R25: "nothing outside the backend's storage is created, read or changed".
    """

    def __init__(self, config: Any, options: GoodFile.Options) -> None:
        super().__init__(config, options)
        self.root = self.root / config.model_name
        self.root.mkdir(parents=True, exist_ok=True)


__all__ = [
    "FileFollowsSymlinks",
    "FileRootPerModel",
    "FileSkipsWhatItWrote",
    "GetWritesLater",
    "SetZeroesSource",
    "ThreadPerStore",
    "V2ReversesComponents",
    "ZeroPageMarker",
]
