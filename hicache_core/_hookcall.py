"""Hot-path hook calls: pluggy's semantics, without its generic machinery when it has nothing to do.

A store's I/O hooks usually have exactly one implementation: the backend's (or, for
``hicache_page_keys``, the default key scheme's). pluggy then still runs its generic call loop
(argument checks, wrapper bookkeeping, ``try``/``finally``), and on a cache that a large copy has
just flushed that costs tens of microseconds per call. :class:`PluginManager` counts changes
to its registrations and monitoring; :func:`hook_call` gives a callable, taking the hookspec's
arguments positionally, that is the lone plain implementation itself (or calls it with the
arguments it names), or calls the hook caller whenever anything more is involved. Positional
calls spare the hot path a keyword dict per call.

For a ``firstresult`` hook with one implementation the two are equivalent: pluggy passes the
arguments the implementation names (in its order) and returns its result, ``None`` included,
and an exception propagates unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

__all__ = ["PluggyCall", "PluginManager", "hook_call"]


class PluginManager(pluggy.PluginManager):
    """A ``pluggy.PluginManager`` whose ``generation`` changes with every registration change.

    Cached direct calls (see :func:`hook_call`) are valid only for the generation they were
    made in: registering, unregistering or blocking a plugin, or adding call monitoring
    (tracing), makes the next call resolve again.
    """

    generation = 0
    #: Active call monitors (``add_hookcall_monitoring``, tracing): they must see every call.
    monitors = 0

    def register(self, plugin: object, name: str | None = None) -> str | None:
        try:
            return super().register(plugin, name)
        finally:
            self.generation += 1

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any | None:
        try:
            return super().unregister(plugin, name)
        finally:
            self.generation += 1

    def set_blocked(self, name: str) -> None:
        try:
            super().set_blocked(name)
        finally:
            self.generation += 1

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Callable[[], None]:
        undo = super().add_hookcall_monitoring(before, after)
        self.monitors += 1
        self.generation += 1

        def undo_and_bump() -> None:
            undo()
            self.monitors -= 1
            self.generation += 1

        return undo_and_bump


class PluggyCall:
    """A hook called through its ``pluggy.HookCaller``, taking the hookspec's arguments positionally.

    What :func:`hook_call` returns when more than a lone plain implementation is involved
    (several implementations, a wrapper, a call monitor).
    """

    __slots__ = ("caller", "names")

    def __init__(self, caller: pluggy.HookCaller, names: tuple[str, ...]) -> None:
        self.caller = caller
        self.names = names

    def __call__(self, *args: Any) -> Any:
        return self.caller(**dict(zip(self.names, args)))


def hook_call(pm: PluginManager, name: str, spec_args: tuple[str, ...]) -> Callable[..., Any]:
    """A callable equivalent to ``pm.hook.<name>(**dict(zip(spec_args, args)))`` for a ``firstresult`` hook.

    It takes the hookspec's arguments positionally, in ``spec_args`` order. With exactly one
    implementation that is neither a wrapper nor a hookwrapper, and no call monitor installed,
    it calls that implementation directly with the arguments it names: it is the implementation
    itself when it names them all in that order. Otherwise it is a :class:`PluggyCall`. The
    result is valid until ``pm.generation`` changes.
    """
    caller: pluggy.HookCaller = getattr(pm.hook, name)
    through_pluggy = PluggyCall(caller, spec_args)
    impls = caller.get_hookimpls()
    if len(impls) != 1 or pm.monitors:
        return through_pluggy
    impl = impls[0]
    if impl.hookwrapper or impl.wrapper or not set(impl.argnames) <= set(spec_args):
        return through_pluggy
    fn: Callable[..., Any] = impl.function
    if tuple(impl.argnames) == spec_args:
        return fn
    picks = tuple(spec_args.index(n) for n in impl.argnames)

    def call(*args: Any) -> Any:
        return fn(*[args[i] for i in picks])

    return call
