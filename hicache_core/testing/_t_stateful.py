"""Group ``stateful``: a hypothesis ``RuleBasedStateMachine`` compared with a dict model."""

from __future__ import annotations

import itertools

import pytest

from hicache_core import CacheController, IoOp, PoolName

from ._base import SuiteBase
from ._context import SuiteContext, expect_flags
from ._rules import rule as contract_rule

__all__ = ["StatefulTests"]

KV = PoolName.KV
PAGES = 12


def _leading(model: dict[str, int], hashes: list[str]) -> int:
    for i, h in enumerate(hashes):
        if h not in model:
            return i
    return len(hashes)


class StatefulTests(SuiteBase):
    """Group ``stateful``."""

    @contract_rule("R11", "R17", "R27", "R28")
    def test_stateful_dict_model(self, hc: SuiteContext, io_path: str) -> None:
        """R11, R17, R27, R28: Random set / exists / get / query / prefetch / clear / reopen sequences agree with a dict."""
        pytest.importorskip("hypothesis", reason="install hicache-core[testing] (hypothesis) for this test")
        from hypothesis import HealthCheck, Phase, settings
        from hypothesis import strategies as st
        from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

        suite = self
        hashes = self.make_page_hashes(PAGES)
        can_clear = callable(getattr(hc.cls, "hicache_clear", None))
        persistent = hc.caps.persistent
        counter = itertools.count()
        pages = st.lists(st.integers(0, PAGES - 1), unique=True, max_size=6)

        class Machine(RuleBasedStateMachine):
            """Model: page hash -> salt (generation) of the bytes stored for it."""

            def __init__(self) -> None:
                super().__init__()
                self.model: dict[str, int] = {}
                self.generation = 0
                self.model_name = f"{hc.model_name}-sm{next(counter)}"
                self.kv = suite.make_kv_pool("mha", 2 * PAGES)
                self.ctl = self._open()

            def _open(self) -> CacheController:
                return hc.controller(self.kv, model_name=self.model_name, path=io_path)

            def _raw(self, op: IoOp, sel: list[int], dst: list[int] | None = None) -> list[bool]:
                sh = [hashes[i] for i in sel]
                return hc.raw(self.ctl.store, op, KV, self.kv, sh, dst or sel, path=io_path)

            @rule(sel=pages)
            def set_pages(self, sel: list[int]) -> None:
                hc.fill(self.kv, sel, [hashes[i] for i in sel], salt=self.generation)
                expect_flags(self._raw(IoOp.SET, sel), [True] * len(sel), "set")
                for i in sel:
                    self.model.setdefault(hashes[i], self.generation)

            @rule(sel=pages)
            def exists(self, sel: list[int]) -> None:
                expect_flags(self._raw(IoOp.EXISTS, sel), [hashes[i] in self.model for i in sel], "exists")

            @rule(sel=pages)
            def get(self, sel: list[int]) -> None:
                dst = [PAGES + i for i in sel]
                hc.sentinel(self.kv, dst)
                expected = [hashes[i] in self.model for i in sel]
                expect_flags(self._raw(IoOp.GET, sel, dst), expected, "get")
                for i, d in zip(sel, dst):
                    if hashes[i] in self.model:
                        assert hc.matches(self.kv, [d], [hashes[i]], self.model[hashes[i]]) == [True], (
                            f"bytes of page {i} after get"
                        )

            @rule(k=st.integers(0, PAGES))
            def query_and_prefetch(self, k: int) -> None:
                want = _leading(self.model, hashes[:k])
                assert self.ctl.query(hashes[:k]).pages == want
                dst = list(range(PAGES, PAGES + k))
                hc.sentinel(self.kv, dst)
                got = self.ctl.prefetch(hashes[:k], dst).pages
                assert got == want, f"prefetch of {k} pages restored {got}, model says {want}"
                salts = {self.model[h] for h in hashes[:want]}
                for salt in salts:
                    sel = [i for i in range(want) if self.model[hashes[i]] == salt]
                    assert all(hc.matches(self.kv, [PAGES + i for i in sel], [hashes[i] for i in sel], salt))

            @precondition(lambda self: can_clear)
            @rule()
            def clear(self) -> None:
                self.ctl.clear()
                self.model.clear()
                self.generation += 1

            @precondition(lambda self: persistent)
            @rule()
            def reopen(self) -> None:
                hc.shut(self.ctl)
                self.ctl = self._open()

            def teardown(self) -> None:
                hc.release(self.ctl)

        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=max(1, self.stateful_examples // len(hc.paths)),  # the budget, split over paths
                stateful_step_count=self.stateful_steps,
                deadline=None,
                database=None,
                derandomize=True,
                phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure reports its steps
                report_multiple_bugs=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
