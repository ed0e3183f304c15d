"""Hook signatures rendered from :mod:`hicache_core.hookspecs` (CONTRIBUTING.md quotes them)."""

from __future__ import annotations

import inspect

__all__ = ["hookspec_signatures", "render_signature"]


def render_signature(name: str, fn: object) -> str:
    """``def NAME(ARG: TYPE, ...) -> RET`` with annotations exactly as written in the spec."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]

    def text(annotation: object) -> str:
        if isinstance(annotation, str):
            return annotation
        return inspect.formatannotation(annotation)

    args = ", ".join(
        p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {text(p.annotation)}"
        for p in sig.parameters.values()
    )
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {text(sig.return_annotation)}"
    return f"def {name}({args}){ret}"


def hookspec_signatures() -> dict[str, str]:
    """Every hookspec's name -> its rendered signature, in the order of ``hookspecs.__all__``."""
    from hicache_core import hookspecs

    return {
        name: render_signature(name, getattr(hookspecs, name))
        for name in hookspecs.__all__
        if name.startswith("hicache_")
    }
