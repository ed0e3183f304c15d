"""``InflightPuts``: the claim registry that keeps two threads from racing on one key's put.

Pure logic, no Mooncake process: the end-to-end behaviour is
``test_semantics.py::test_concurrent_puts_of_the_same_pages_report_only_visible_pages``.
"""

from __future__ import annotations

import threading
import time

from hicache_mooncake._inflight import InflightPuts


def test_a_claim_on_an_idle_registry_sends_everything_and_builds_no_set() -> None:
    reg = InflightPuts()
    claim = reg.claim(["a", "b"])
    assert claim.sent is None and claim.busy == [] and claim.others == []
    assert claim.keys == ["a", "b"] and claim._set is None  # the usual put pays for no set
    reg.release(claim)
    assert len(reg) == 0


def test_overlapping_claims_leave_the_busy_keys_to_the_first_put() -> None:
    reg = InflightPuts()
    first = reg.claim(["a", "b", "c"])
    disjoint = reg.claim(["x", "y"])
    assert disjoint.sent is None
    second = reg.claim(["c", "d", "a", "a"])
    assert second.others == [first]
    assert second.busy == [0, 2, 3] and second.sent == [1]
    assert second.keys == ["d"]
    third = reg.claim(["d", "b", "z"])  # "d" is now the second put's, "b" the first's
    assert third.keys == ["z"] and third.busy == [0, 1]
    assert {id(c) for c in third.others} == {id(first), id(second)}
    for c in (first, disjoint, second, third):
        reg.release(c)
    assert len(reg) == 0


def test_wait_others_returns_when_the_other_put_is_released() -> None:
    reg = InflightPuts()
    first = reg.claim(["k"])
    second = reg.claim(["k"])
    done = threading.Event()

    def waiter() -> None:
        reg.wait_others(second, timeout=30)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not done.wait(0.2)  # still in flight
    reg.release(first)
    assert done.wait(10)
    t.join()
    reg.release(second)


def test_wait_others_gives_up_at_the_timeout() -> None:
    reg = InflightPuts()
    reg.claim(["k"])
    second = reg.claim(["k"])
    t0 = time.monotonic()
    reg.wait_others(second, timeout=0.2)
    assert 0.15 <= time.monotonic() - t0 < 5
