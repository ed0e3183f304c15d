"""Argument checks of the pool constructors: each wrong argument is a typed error naming it.

A wrong type is an :class:`~hicache_core.errors.ArgumentTypeError` (a ``TypeError``), a wrong
value a :class:`~hicache_core.errors.PoolError` (a ``ValueError``); nothing deeper in the pool
code ever sees an argument it cannot use.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any, Final

import torch

from ..errors import ArgumentTypeError, PoolError
from ..types import Layout

__all__ = ["DTYPE_ALIASES", "as_dtype", "as_int", "as_layout", "as_shape", "check_allocator", "check_name"]

#: Short dtype names accepted besides torch's own attribute names (``"bfloat16"``, ``"float16"``,
#: ``"torch.float8_e4m3fn"``...). SGLang spells its KV cache dtypes this way.
DTYPE_ALIASES: Final = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", None),
    "fp8_e5m2": getattr(torch, "float8_e5m2", None),
}
_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def as_dtype(value: object, what: str) -> torch.dtype:
    """A ``torch.dtype``, or its name as a string (``"bfloat16"``, ``"torch.float16"``, ``"fp16"``).

    Raises :class:`ArgumentTypeError` for anything else and :class:`PoolError` for an unknown name.
    """
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"{what} must be a torch.dtype or its name (e.g. torch.bfloat16 or 'bfloat16'), "
            f"got {type(value).__name__}"
        )
    name = value.strip()
    name = name[len("torch.") :] if name.startswith("torch.") else name
    found = DTYPE_ALIASES.get(name.lower()) or getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise PoolError(
            f"{what}: unknown dtype name {value!r:.80}; use a torch dtype such as 'bfloat16', "
            f"'float16', 'float32', 'uint8' or 'float8_e4m3fn' (aliases: {sorted(DTYPE_ALIASES)})"
        )
    return found


def as_int(value: object, what: str, minimum: int) -> int:
    """An integer (anything with ``__index__`` but a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentTypeError(f"{what} must be an int, got {type(value).__name__}")
    try:
        out = operator.index(value)
    except (TypeError, ValueError):  # e.g. a tensor of several elements
        raise ArgumentTypeError(f"{what} must be an int, got {value!r:.80}") from None
    if out < minimum:
        raise PoolError(f"{what} must be >= {minimum}, got {out}")
    return out


def as_shape(value: object, what: str) -> tuple[int, ...]:
    """A shape: a sequence of non-negative ints (a ``torch.Size`` is one)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{what} must be a sequence of ints (a shape), got {type(value).__name__}")
    return tuple(as_int(d, f"{what}[{i}]", 0) for i, d in enumerate(value))


def as_layout(value: object, what: str) -> Layout:
    """A :class:`Layout` or its value (``"page_first"`` / ``"layer_first"``)."""
    try:
        return Layout(value)
    except (ValueError, TypeError):
        raise PoolError(f"{what} must be one of {[m.value for m in Layout]}, got {value!r:.80}") from None


def check_name(value: object, what: str) -> str:
    """A component name: it becomes a field of every storage key, so 1-64 of ``[A-Za-z0-9_-]``."""
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{what} must be a str, got {type(value).__name__}")
    if not _NAME_RE.fullmatch(value):
        raise PoolError(
            f"{what} {value!r:.80} is not a usable component name: use 1-64 characters from "
            "[A-Za-z0-9_-], starting with a letter or digit (it is part of every storage key)"
        )
    return value


def check_allocator(value: Any, what: str) -> None:
    """``None`` or a callable ``alloc(nbytes) -> torch.Tensor``."""
    if value is not None and not callable(value):
        raise ArgumentTypeError(
            f"{what} must be a callable alloc(nbytes) -> flat uint8 CPU tensor, or None; "
            f"got {type(value).__name__}"
        )
