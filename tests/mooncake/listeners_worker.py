"""A serving process for the listener test, run in a FRESH interpreter (so that no earlier
Mooncake client of the test process adds listeners).

Attaches three stores to one cluster, every address on 127.0.0.1: embedded with the cluster's
HTTP metadata server, embedded with P2PHANDSHAKE (no segment), and standalone (a dummy client of
the cluster's mooncake_client). Prints one JSON line with its pid and the WARNING messages of
the plugin's logger, then keeps the stores open until stdin closes.

argv: master_server_address metadata_server client_server_address
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mooncake_helpers import make_config, make_group

from hicache_core import CacheController


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(master: str, metadata: str, client: str) -> int:
    collect = _Collect()
    logging.getLogger("hicache.mooncake").addHandler(collect)
    common = {"load_env": False, "master_server_address": master, "local_buffer_size": "16MB"}
    embedded = {**common, "local_hostname": "127.0.0.1"}
    options = [
        {**embedded, "metadata_server": metadata, "global_segment_size": "64MB"},
        {**embedded, "metadata_server": "P2PHANDSHAKE", "global_segment_size": 0},
        {**common, "metadata_server": metadata, "standalone_storage": True, "client_server_address": client},
    ]
    with contextlib.ExitStack() as stack:
        for opts in options:  # pools with allocate=False: the standalone store runs setup_dummy here
            stack.enter_context(CacheController(make_config(opts), make_group("mha")))
        print(json.dumps({"pid": os.getpid(), "warnings": collect.messages}), flush=True)
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
