"""Chained per-page sha256 hashes of token ids (design.md section 4, "Page hashes").

``page_hashes(token_ids, page_size)`` returns one lowercase sha256 hex digest per *full* page.
Page ``i`` hashes the raw 32 bytes of page ``i - 1``'s digest (``prior_hash`` for the first
page, or nothing) followed by each of its token ids as a 4-byte little-endian unsigned int,
which is exactly SGLang's ``get_hash_str`` applied page by page, so engine-computed hashes and
hicache-computed hashes are interchangeable. Since the hashes chain, a page hash names the
whole prefix ending at that page.

Two implementations produce identical results:

* ``"native"``: the optional C extension ``hicache_core.native._pagehash`` over OpenSSL's
  SHA-256 (libcrypto's ``SHA256_Init``/``_Update``/``_Final``, the code ``hashlib`` runs). The
  whole chain runs in C: buffer inputs (arrays, tensors) are hashed in place, exact lists/tuples
  are first converted into a private uint32 buffer. Pages are hashed with the GIL held, which
  is handed over after every 64 KiB of input so waiting threads get their turn.
* ``"python"``: ``hashlib`` per page over memoryview slices of one little-endian buffer built
  in a single vectorised step (no per-token Python loop).

:data:`BACKEND` says which one is active. Setting ``HICACHE_PURE_PYTHON_HASH=1`` before the
first import forces ``"python"``. Importing this module imports neither torch nor numpy: tensors
and arrays are recognised only if their library is already loaded, and numpy is imported on
first use only to view torch tensors.
"""

from __future__ import annotations

import hashlib
import importlib
import operator
import re
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final, Protocol, cast

from ..errors import BatchShapeError, BatchTypeError, KeyFormatError, KeyTypeError
from ..native import load_extension

__all__ = ["page_hashes"]

_U32_LIMIT: Final = 1 << 32
_LITTLE: Final = sys.byteorder == "little"
_U32_CODES: Final = tuple(c for c in "IL" if array(c).itemsize == 4)  # 'I' (and 'L' on Windows)
_I32_CODES: Final = tuple(c for c in "il" if array(c).itemsize == 4)
_INT_CODES: Final = "bBhHiIlLqQ"
_U32_CODE: Final = _U32_CODES[0]
_HIGH_BYTE: Final = re.compile(rb"[\x80-\xff]")
_RANGE_HINT: Final = (
    "token ids are uint32 vocabulary indices: drop padding/sentinel values (e.g. -1) before hashing"
)
_CHANGED_SIZE: Final = "token_ids changed size while being hashed (an item's __index__ mutated the list)"
# What converting token ids raises for a bad id, in either implementation; both map these to
# BatchShapeError: TypeError (not an int), OverflowError (out of range), IndexError (a list
# shrank while it was read), and any of them or ValueError raised by an item's __index__.
_CONVERSION_ERRORS: Final = (OverflowError, TypeError, ValueError, IndexError)


class _NativeModule(Protocol):
    """The interface of the ``hicache_core.native._pagehash`` C extension."""

    SHA256_IMPL: str  # the libcrypto providing SHA-256, e.g. "OpenSSL 3.0.19 27 Jan 2026"

    def page_hashes(
        self, tokens: object, page_size: int, prior: bytes | None, check_sign: bool, /
    ) -> list[str]:
        """Chain in C; ``tokens`` is an exact list/tuple of ints or a buffer of LE 32-bit words.

        Raises TypeError (not an int, bad buffer), OverflowError (id out of range) or
        IndexError (the list changed size while it was read).
        """


_NATIVE: Final = cast("_NativeModule | None", load_extension("_pagehash", "HICACHE_PURE_PYTHON_HASH"))
#: ``"native"`` if the C extension is in use, else ``"python"``.
BACKEND: Final[str] = "native" if _NATIVE is not None else "python"


def page_hashes(token_ids: object, page_size: int, prior_hash: str | None = None) -> list[str]:
    """Return the chained sha256 hex digest of every full page of ``token_ids``.

    Args:
        token_ids: a 1-D sequence of token ids in ``[0, 2**32)``: a list/tuple/range of ints,
            an ``array.array`` of any integer typecode, a numpy integer array or a CPU torch
            integer tensor. 4-byte arrays (``array('I')``/``array('i')``, numpy ``uint32``/
            ``int32``, torch ``int32``) are hashed in place without copying; other integer
            dtypes are range-checked and converted once.
        page_size: tokens per page, ``> 0``.
        prior_hash: hex digest of the page that precedes ``token_ids[0]`` (64 hex characters,
            either case), or ``None`` at the start of a sequence. Hashing ``a + b`` at once
            equals hashing ``b`` with ``prior_hash=page_hashes(a, ...)[-1]`` when ``len(a)``
            is a multiple of ``page_size``.

    Returns:
        ``len(token_ids) // page_size`` lowercase 64-character hex digests. A trailing
        partial page is *not* hashed (its hash would depend on where the sequence was cut);
        its tokens are still validated. Empty or shorter-than-one-page input gives ``[]``.

    Raises:
        BatchShapeError: ``page_size <= 0``; ``token_ids`` not 1-D or on a non-CPU device;
            an id outside ``[0, 2**32)``; or a list that changed size while it was read (an
            item's ``__index__`` mutated it). When ``token_ids``, one of its ids or
            ``page_size`` has the wrong type (a ``str``, ``bytes``, floats, ...) it is the
            subclass :class:`BatchTypeError`, also a ``TypeError``.
        KeyFormatError: ``prior_hash`` is not ``None`` or a 64-character hex string (an empty
            string is rejected too, unlike SGLang which treats it as ``None``); a
            :class:`KeyTypeError` (also a ``TypeError``) when it is not a ``str``.
    """
    return _page_hashes(token_ids, page_size, prior_hash, _NATIVE)


def _page_hashes(
    token_ids: object, page_size: int, prior_hash: str | None, native: _NativeModule | None
) -> list[str]:
    """:func:`page_hashes` with an explicit backend (``native=None`` is the pure-Python path)."""
    size = _check_page_size(page_size)
    prior = _check_prior(prior_hash)
    tokens, check_sign = _prepare(token_ids, native is not None)
    if native is not None:
        n = len(tokens) if type(tokens) is list else -1
        try:
            # A page size beyond sys.maxsize (the C side's Py_ssize_t) has no full page either way.
            return native.page_hashes(tokens, min(size, sys.maxsize), prior, check_sign)
        except _CONVERSION_ERRORS as exc:
            if n >= 0 and len(tokens) != n:  # type: ignore[arg-type]  # an item's __index__ resized it
                raise BatchShapeError(_CHANGED_SIZE) from exc
            raise _conversion_error(exc, str(exc)) from exc
    return _chain_python(tokens, size, prior, check_sign)


def _conversion_error(exc: BaseException, message: str) -> BatchShapeError:
    """A token that is not an int (``TypeError``) is a :class:`BatchTypeError`; a value out of
    range or a list that changed size while it was read is a :class:`BatchShapeError`."""
    return BatchTypeError(message) if isinstance(exc, TypeError) else BatchShapeError(message)


def _check_page_size(page_size: object) -> int:
    if isinstance(page_size, bool) or not hasattr(page_size, "__index__"):
        raise BatchTypeError(f"page_size must be a positive int, got {page_size!r:.80}")
    try:
        size = int(cast(Any, page_size).__index__())
    except (TypeError, ValueError, OverflowError):  # e.g. a tensor of several elements
        raise BatchTypeError(f"page_size must be a positive int, got {type(page_size).__name__}") from None
    if size <= 0:
        raise BatchShapeError(f"page_size must be a positive int (tokens per page), got {size}")
    return size


def _check_prior(prior_hash: object) -> bytes | None:
    if prior_hash is None:
        return None
    if isinstance(prior_hash, str) and len(prior_hash) == 64:
        try:
            raw = bytes.fromhex(prior_hash)
        except ValueError:
            raw = b""
        if len(raw) == 32:
            return raw
    raise (KeyFormatError if isinstance(prior_hash, str) else KeyTypeError)(
        f"prior_hash must be None or a sha256 hex digest (64 hex characters), got {prior_hash!r:.90}; "
        "pass the last hash returned by page_hashes() for the preceding pages, or None"
    )


def _prepare(token_ids: object, native: bool) -> tuple[object, bool]:
    """Return ``(tokens, check_sign)``: tokens are a list/tuple (native only) or an LE-uint32 buffer.

    ``check_sign`` is true for int32 buffers, whose negative words the backend must reject.
    """
    if isinstance(token_ids, (bytes, bytearray, str)):
        raise BatchTypeError(
            f"token_ids is a {type(token_ids).__name__} object, not a token list; pass the ids as a list of "
            "ints or array('I', ...) (decode raw little-endian uint32 bytes with array('I', data))"
        )
    if isinstance(token_ids, array):
        return _from_array(token_ids)
    if isinstance(token_ids, memoryview):
        return _from_memoryview(token_ids)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(token_ids, np.ndarray):
        return _from_numpy(token_ids)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(token_ids, torch.Tensor):
        return _from_torch(token_ids, torch)
    if type(token_ids) is list or type(token_ids) is tuple:  # subclasses may override __len__ etc.
        return (token_ids if native else _seq_to_u32(token_ids)), False
    if isinstance(token_ids, Sequence):
        return _seq_to_u32(token_ids), False
    raise BatchTypeError(
        f"token_ids must be a 1-D sequence of ints (list, tuple, array.array, numpy array or CPU "
        f"torch tensor), got {type(token_ids).__name__}"
    )


def _to_le(buf: array[int]) -> array[int]:
    if not _LITTLE:
        buf = array(buf.typecode, buf)
        buf.byteswap()
    return buf


def _from_array(arr: array[int]) -> tuple[object, bool]:
    if arr.typecode in _U32_CODES:
        return _to_le(arr), False
    if arr.typecode in _I32_CODES:
        return _to_le(arr), True
    if arr.typecode in _INT_CODES:
        return _seq_to_u32(arr), False
    raise BatchTypeError(
        f"array.array typecode {arr.typecode!r} does not hold integers; use array('I', ...) of token ids"
    )


def _from_memoryview(view: memoryview) -> tuple[object, bool]:
    if view.ndim != 1:
        raise BatchShapeError(f"token_ids must be 1-D, got a memoryview with shape {view.shape}")
    prefix = view.format[:1] if view.format[:1] in "@=<>!" else ""
    code = view.format[len(prefix) :]
    if code in ("B", "b", "c"):
        raise BatchTypeError(
            "token_ids is a byte memoryview, not a token list; if it holds little-endian uint32 ids, "
            "pass view.cast('I') or array('I', view)"
        )
    if len(code) != 1 or code not in _INT_CODES + "nN":
        raise BatchTypeError(f"memoryview format {view.format!r} is not an integer format; pass token ids")
    little = prefix == "<" or (prefix in ("", "@", "=") and _LITTLE)
    if view.itemsize == 4 and little and view.c_contiguous:
        return view, code in "il"
    try:
        return _seq_to_u32(view), False
    except NotImplementedError as exc:  # non-native formats such as '>I'
        raise BatchShapeError(
            f"memoryview format {view.format!r} is not supported; pass array('I', ...)"
        ) from exc


def _from_numpy(arr: Any) -> tuple[object, bool]:
    if arr.ndim != 1:
        raise BatchShapeError(f"token_ids must be 1-D, got a numpy array of shape {arr.shape}; use .ravel()")
    if arr.dtype.kind not in "iu":
        raise BatchTypeError(f"token_ids must have an integer dtype, got numpy {arr.dtype}")
    if arr.dtype.str in ("<u4", "<i4"):
        return _np_le_buffer(arr), arr.dtype.str == "<i4"
    if arr.size:
        _check_range(int(arr.min()), int(arr.max()), arr)
    return _np_le_buffer(arr.astype("<u4")), False


def _np_le_buffer(arr: Any) -> object:
    """A C-contiguous buffer of ``arr``'s bytes (zero-copy when ``arr`` already is contiguous)."""
    arr = sys.modules["numpy"].ascontiguousarray(arr)
    return arr if _LITTLE else arr.tobytes()


def _numpy_available() -> bool:
    """Import numpy on first use (never at module import); ``False`` if it is not installed."""
    try:
        importlib.import_module("numpy")
    except ImportError:
        return False
    return True


def _from_torch(tensor: Any, torch: Any) -> tuple[object, bool]:
    if tensor.device.type != "cpu":
        raise BatchShapeError(
            f"token_ids must be a CPU tensor, got device {tensor.device}; call .cpu() first"
        )
    if tensor.dim() != 1:
        raise BatchShapeError(f"token_ids must be 1-D, got a tensor of shape {tuple(tensor.shape)}")
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise BatchTypeError(f"token_ids must have an integer dtype, got {tensor.dtype}")
    if not _numpy_available():  # torch without numpy: one C-level conversion (range-checked)
        return _seq_to_u32(tensor.tolist()), False
    if tensor.dtype == torch.int32:  # zero-copy view of the (contiguous) tensor's memory
        return _np_le_buffer(tensor.contiguous().numpy()), True
    wide = tensor if tensor.dtype == torch.int64 else tensor.to(torch.int64)
    if wide.numel():
        _check_range(int(wide.min()), int(wide.max()), wide)
    return _np_le_buffer(wide.numpy().astype("<u4")), False


def _check_range(lo: int, hi: int, values: Any) -> None:
    """Raise if ``[lo, hi]`` (the min and max of ``values``) is not inside ``[0, 2**32)``."""
    if lo < 0:
        index, bad = int(values.argmin()), lo
    elif hi >= _U32_LIMIT:
        index, bad = int(values.argmax()), hi
    else:
        return
    raise BatchShapeError(f"token_ids[{index}] = {bad} is outside [0, 2**32); {_RANGE_HINT}")


def _seq_to_u32(seq: Sequence[int] | memoryview | array[int]) -> array[int]:
    """Convert in one C-level pass (range-checked by ``array``), little-endian.

    An exact list or tuple is read item by item up to its starting length, each read
    bounds-checked, exactly as the native extension reads it; a list whose length has changed
    by the end (an item's ``__index__`` mutated it) is an error. Any other sequence is
    iterated, so a lying ``__len__`` cannot size the conversion.
    """
    exact = type(seq) in (list, tuple)
    n = len(seq) if exact else -1
    try:
        out = array(_U32_CODE, seq if exact else iter(seq))
    except _CONVERSION_ERRORS as exc:
        if exact and len(seq) != n:
            raise BatchShapeError(_CHANGED_SIZE) from exc
        raise _conversion_error(exc, _describe_bad_token(seq)) from exc
    if exact and len(seq) != n:
        raise BatchShapeError(_CHANGED_SIZE)
    return _to_le(out)


def _describe_bad_token(seq: Sequence[object] | memoryview | array[int]) -> str:
    """Error path only: find the first offending element and say how to fix it.

    This reads ``seq`` a second time; elements whose ``__index__`` misbehaves may now pass or
    fail differently, which only makes the message less specific.
    """
    try:
        for i, tok in enumerate(seq):
            try:
                value = operator.index(cast(Any, tok))
            except Exception:
                return (
                    f"token_ids[{i}] is a {type(tok).__name__}, not an int; token ids must be a flat "
                    "(1-D) sequence of ints"
                )
            if not 0 <= value < _U32_LIMIT:
                return f"token_ids[{i}] = {_show_int(value)} is outside [0, 2**32); {_RANGE_HINT}"
    except Exception:
        pass
    return "token_ids could not be converted to uint32 token ids"


def _show_int(value: int) -> str:
    """``value`` in decimal, or a description when it has more than 64 bits (printing those
    can exceed the interpreter's int-to-str digit limit)."""
    if -(1 << 63) <= value < 1 << 63:
        return str(value)
    return "<an int below -2**63>" if value < 0 else "<an int of 2**63 or more>"


def _chain_python(tokens: object, page_size: int, prior: bytes | None, check_sign: bool) -> list[str]:
    """The pure-Python chain: one hashlib call per page over memoryview slices."""
    view = memoryview(cast(Any, tokens))
    try:
        data = view if view.format == "B" else view.cast("B")
    except (TypeError, ValueError):  # e.g. an explicit '<I' format
        data = memoryview(view.tobytes())
    if check_sign:
        match = _HIGH_BYTE.search(data[3::4].tobytes())
        if match is not None:
            i = match.start()
            value = int.from_bytes(data[4 * i : 4 * i + 4], "little", signed=True)
            raise BatchShapeError(f"token_ids[{i}] = {value} is outside [0, 2**32); {_RANGE_HINT}")
    step = 4 * page_size
    end = len(data) - len(data) % step
    sha256 = hashlib.sha256
    out: list[str] = []
    append = out.append
    prev = prior or b""
    for off in range(0, end, step):
        h = sha256(prev)
        h.update(data[off : off + step])
        prev = h.digest()
        append(prev.hex())
    return out
