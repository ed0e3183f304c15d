"""``InflightPuts``: the keys this process is putting right now, on one connection.

Mooncake answers a put of a key whose first put is still in flight with 0 at once, although
the object is not readable yet. A put therefore first *claims* its keys here: keys another
thread is putting are left out of the call, and the caller waits for those puts to finish
before it reports on them.

Built for the usual case, one put at a time: a claim on an idle registry is one list append,
with no key set built and no event created. Sets are built only when two puts overlap in time,
and waiters are woken through one shared condition.
"""

from __future__ import annotations

import threading
import time

__all__ = ["Claim", "InflightPuts"]


class Claim:
    """One put's keys while it is in flight."""

    __slots__ = ("_set", "busy", "keys", "others", "sent")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        """The keys this put sends: the whole batch, less the ``busy`` ones."""
        self.sent: list[int] | None = None
        """Positions in the batch of ``keys``; ``None`` when it sends the whole batch."""
        self.busy: list[int] = []
        """Positions whose keys another put was sending when this one claimed them."""
        self.others: list[Claim] = []
        """The claims of those other puts."""
        self._set: set[str] | None = None

    def keyset(self) -> set[str]:
        if self._set is None:
            self._set = set(self.keys)
        return self._set


class InflightPuts:
    """The claims of one connection's puts in flight (thread-safe)."""

    def __init__(self) -> None:
        self._claims: list[Claim] = []
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._waiters = 0

    def claim(self, keys: list[str]) -> Claim:
        """Register a put of ``keys``; the claim tells which positions it must not send."""
        claim = Claim(keys)
        with self._lock:
            if self._claims:  # another put is in flight: leave out the keys it is sending
                mine = claim.keyset()
                others = [c for c in self._claims if not c.keyset().isdisjoint(mine)]
                if others:
                    taken: set[str] = set().union(*(c.keyset() & mine for c in others))
                    claim.busy = [i for i, k in enumerate(keys) if k in taken]
                    claim.sent = [i for i, k in enumerate(keys) if k not in taken]
                    claim.keys = [keys[i] for i in claim.sent]
                    claim._set = mine - taken
                    claim.others = others
            self._claims.append(claim)
        return claim

    def release(self, claim: Claim) -> None:
        """The put of ``claim`` is over (whatever its outcome): wake the threads waiting on it."""
        with self._lock:
            self._claims.remove(claim)
            if self._waiters:
                self._done.notify_all()

    def wait_others(self, claim: Claim, timeout: float) -> None:
        """Block until the puts that held ``claim``'s busy keys are over, at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._waiters += 1
            try:
                while any(c in self._claims for c in claim.others):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._done.wait(left)
            finally:
                self._waiters -= 1

    def __len__(self) -> int:
        return len(self._claims)
