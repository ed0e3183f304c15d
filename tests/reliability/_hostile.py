"""Classification of exceptions escaping hicache under hostile input (used by test_hostile_input)."""

from __future__ import annotations

import os
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hicache_core as hc

# Known bugs: (innermost hicache frame "module.function", exception type) -> bug id. Each has a
# strict-xfail regression test in test_hostile_input.py and a proposed fix in the report; an
# escape with any other signature fails the fuzz tests.
KNOWN: dict[tuple[str, str], str] = {}  # all found bugs (K1-K8) are fixed; keep empty


def signature(err: BaseException) -> tuple[str, str]:
    """``(module.function, type)`` of the innermost hicache_core frame, or ``("<backend>", "*")``
    when the exception was raised inside a backend's hook implementation."""
    frames = traceback.extract_tb(err.__traceback__)
    core = os.sep + "hicache_core" + os.sep
    pluggy = (os.path.join("pluggy", "_callers.py"), os.path.join("pluggy", "_execution.py"))
    hook = [i for i, f in enumerate(frames) if f.filename.endswith(pluggy)]
    if hook and hook[-1] + 1 < len(frames) and core not in frames[hook[-1] + 1].filename:
        return "<backend>", "*"
    for f in reversed(frames):
        if core in f.filename:
            return f"{os.path.splitext(os.path.basename(f.filename))[0]}.{f.name}", type(err).__name__
    return "<outside hicache_core>", type(err).__name__


@dataclass
class Tally:
    """Outcomes of one fuzz target."""

    name: str
    cases: int = 0
    ok: int = 0
    typed: Counter[str] = field(default_factory=Counter)
    known: Counter[str] = field(default_factory=Counter)
    unknown: list[str] = field(default_factory=list)

    def run(self, fn: Callable[[], Any]) -> Any:
        self.cases += 1
        try:
            out = fn()
        except hc.HiCacheError as err:
            self.typed[type(err).__name__] += 1
            return None
        except Exception as err:
            sig = signature(err)
            bug = KNOWN.get(sig) or KNOWN.get((sig[0], "*"))
            if bug is None:
                self.unknown.append(f"{sig}: {type(err).__name__}: {str(err)[:200]}")
            else:
                self.known[bug] += 1
            return None
        self.ok += 1
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "ok": self.ok,
            "typed": dict(self.typed),
            "known_bugs": dict(self.known),
            "unknown": len(self.unknown),
        }
