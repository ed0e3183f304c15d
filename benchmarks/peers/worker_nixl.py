"""Peer worker: NIXL's POSIX plugin, DRAM <-> FILE, one file per page (as SGLang's NIXL store).

Run with ``benchmarks/.peers/nixl/bin/python``. Setting: ``aio`` (the plugin's default, Linux
AIO), ``uring`` (``use_uring``) or ``odirect`` (``use_uring`` and the files opened with
``O_DIRECT``, SGLang's NIXL default; the fastest POSIX setting measured). Host memory is one
anonymous mapping (page-aligned, as O_DIRECT needs) registered once; each batch is one
transfer request over every page (``initialize_xfer`` then ``transfer``, polled to ``DONE``),
the files opened (created on write) and registered inside the timed region, as a store must.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import mmap
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

SETTINGS = {
    "aio": ({}, 0),
    "uring": ({"use_uring": "true"}, 0),
    "odirect": ({"use_uring": "true"}, os.O_DIRECT),
}


class Nixl:
    def __init__(self, root: str, page_bytes: int, n: int, setting: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        params, self.direct = SETTINGS[setting]
        self.name = f"peers-{os.getpid()}-{page_bytes}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
        self.agent.create_backend("POSIX", params)
        self.root, self.page_bytes, self.n = root, page_bytes, n
        self.src = mmap.mmap(-1, page_bytes * n)
        self.dst = mmap.mmap(-1, page_bytes * n)
        self._addr = {}
        self._regs = []
        for m in (self.src, self.dst):
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            self._addr[id(m)] = addr
            self._regs.append(self.agent.register_memory([(addr, page_bytes * n, 0, "")], "DRAM"))
        self.paths = [os.path.join(root, f"{i:07d}.bin") for i in range(n)]

    def _xfer(self, op: str, mem: mmap.mmap) -> None:
        flags = (os.O_WRONLY | os.O_CREAT if op == "WRITE" else os.O_RDONLY) | self.direct
        fds = [os.open(p, flags, 0o644) for p in self.paths]
        try:
            size = self.page_bytes
            freg = self.agent.register_memory([(0, size, fd, "") for fd in fds], "FILE")
            try:
                base = self._addr[id(mem)]
                local = self.agent.get_xfer_descs([(base + i * size, size, 0) for i in range(self.n)], "DRAM")
                remote = self.agent.get_xfer_descs([(0, size, fd) for fd in fds], "FILE")
                h = self.agent.initialize_xfer(op, local, remote, self.name)
                try:
                    state = self.agent.transfer(h)
                    while state == "PROC":
                        time.sleep(0.0001)
                        state = self.agent.check_xfer_state(h)
                    if state != "DONE":
                        raise RuntimeError(f"NIXL {op} ended in state {state}")
                finally:
                    self.agent.release_xfer_handle(h)
            finally:
                self.agent.deregister_memory(freg)
        finally:
            for fd in fds:
                os.close(fd)

    def fill(self, i: int, data: memoryview) -> None:
        self.src[i * self.page_bytes : (i + 1) * self.page_bytes] = data

    def write(self) -> None:
        self._xfer("WRITE", self.src)

    def clear(self) -> None:
        ctypes.memset(self._addr[id(self.dst)], 0, self.page_bytes * self.n)

    def read(self) -> int:
        self._xfer("READ", self.dst)
        return self.n

    def page(self, i: int) -> bytes:
        return self.dst[i * self.page_bytes : (i + 1) * self.page_bytes]

    def close(self) -> None:
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs.clear()


def _load() -> tuple[_common.Factory, dict[str, str]]:
    import nixl._api  # noqa: F401  (fails here, reported, when the wheel does not load)

    versions = {"python": sys.version.split()[0], "nixl": md.version("nixl")}
    return Nixl, versions


if __name__ == "__main__":
    sys.exit(_common.serve(_load))
