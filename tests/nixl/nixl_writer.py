"""A writer killed by the crash test: ``python nixl_writer.py OPTIONS_JSON PROGRESS SERIES``.

Backs up batches of ``BATCH`` pages (hashes ``hex_hash(SERIES, b * BATCH + i)``) in a loop until it
is killed, logging ``start B`` before and ``done B PAGES`` after each batch (line-buffered, so
the log survives SIGKILL).
"""

from __future__ import annotations

import json
import sys

from nixl_util import controller, fill, hex_hash, kv_pool

BATCH = 8


def main() -> None:
    options, progress, series = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    pool = kv_pool(BATCH, layers=8)  # 64 KiB page components
    with controller(options, pool, model="nixl-crash") as ctl, open(progress, "a", buffering=1) as log:
        log.write("ready\n")
        b = 0
        while True:
            hashes = [hex_hash(series, b * BATCH + i) for i in range(BATCH)]
            fill(pool, list(range(BATCH)), hashes)
            log.write(f"start {b}\n")
            res = ctl.backup(hashes, range(BATCH))
            log.write(f"done {b} {res.pages}\n")
            b += 1


if __name__ == "__main__":
    main()
