"""Pure argument checkers with upstream's exception classes (reference §3).

Type errors raise ``TypeError``, integers out of range raise ``ValueError``, and semantic
checks raise ``LLMException(LLM_PARAM_INVALID)`` (via :func:`raise_if_false`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._enums import DataType
from ._errors import raise_if_false

UINT64_MAX = 2**64 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT16_MAX = 2**16 - 1


def type_name(types: type | tuple[type, ...]) -> str:
    if isinstance(types, tuple):
        return " or ".join(t.__name__ for t in types)
    return types.__name__


def check_isinstance(
    name: str, value: Any, types: type | tuple[type, ...], *, optional: bool = False
) -> None:
    """Raise ``TypeError`` unless ``value`` is an instance of ``types`` (or None when optional)."""
    if value is None and optional:
        return
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {type_name(types)}, got {type(value).__name__}")


def _check_int(name: str, value: Any, lo: int, hi: int, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def check_uint64(name: str, value: Any, *, optional: bool = False) -> None:
    """Raises TypeError for a non-int, ValueError outside [0, 2**64-1]."""
    _check_int(name, value, 0, UINT64_MAX, optional)


def check_int64(name: str, value: Any, *, optional: bool = False) -> None:
    """Raises TypeError for a non-int, ValueError outside int64."""
    _check_int(name, value, INT64_MIN, INT64_MAX, optional)


def check_uint32(name: str, value: Any, *, optional: bool = False) -> None:
    """Raises TypeError for a non-int, ValueError outside uint32."""
    _check_int(name, value, 0, UINT32_MAX, optional)


def check_int32(name: str, value: Any, *, optional: bool = False) -> None:
    """Raises TypeError for a non-int, ValueError outside int32."""
    _check_int(name, value, INT32_MIN, INT32_MAX, optional)


def check_uint16(name: str, value: Any, *, optional: bool = False) -> None:
    """Raises TypeError for a non-int, ValueError outside uint16."""
    _check_int(name, value, 0, UINT16_MAX, optional)


#: index lists up to this long are checked with Python ints
_FEW = 64


def check_index_list(name: str, value: Any, *, optional: bool = False) -> np.ndarray | None:
    """Check a list/tuple of uint64 and return it as an int64 numpy array.

    Vectorised so that block lists of thousands of entries cost microseconds.

    Raises:
        TypeError: not a list/tuple, or an element that is not an int.
        ValueError: an element outside [0, 2**63-1] (offsets are int64 inside the library).
    """
    if value is None and optional:
        return None
    if not isinstance(value, list | tuple):
        raise TypeError(f"{name} must be list or tuple, got {type(value).__name__}")
    n = len(value)
    if n == 1 and type(value[0]) is int and 0 <= value[0] <= INT64_MAX:
        return np.array(value, dtype=np.int64)  # (one block: most small requests)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if n <= _FEW and all(type(v) is int for v in value):
        # numpy's conversion and reductions cost microseconds each on a few indices.
        if min(value) < 0:
            raise ValueError(f"{name} holds a negative value")
        if max(value) > INT64_MAX:
            raise ValueError(f"{name} holds a value outside [0, 2**63-1]")
        return np.array(value, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError) as exc:  # ragged or absurd input
        raise TypeError(f"{name} must hold ints: {exc}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iub":
        if arr.dtype.kind == "O" and all(isinstance(v, int) for v in value):
            # Values beyond int64 arrive as Python ints in an object array.
            raise ValueError(f"{name} holds a value outside [0, 2**63-1]")
        bad = next((v for v in value if not isinstance(v, int | np.integer)), value[0])
        raise TypeError(f"{name} must hold ints, got {type(bad).__name__}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > INT64_MAX:
        raise ValueError(f"{name} holds a value outside [0, 2**63-1]")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name} holds a negative value")
    return arr


def check_range(name: str, value: Any, *, optional: bool = True) -> range | None:
    """A layer range: a ``range`` with step 1 and ``0 <= start < stop``.

    Raises:
        TypeError: not a range.
        LLMException: LLM_PARAM_INVALID for a bad step, start or an empty range.
    """
    if value is None and optional:
        return None
    check_isinstance(name, value, range)
    raise_if_false(value.step == 1, f"{name} step must be 1, got {value.step}")
    raise_if_false(value.start >= 0, f"{name} start must be >= 0, got {value.start}")
    raise_if_false(value.start < value.stop, f"{name} must not be empty ({value})")
    check_uint32(f"{name}.stop", value.stop)
    return value


def check_list_of(name: str, value: Any, item_types: type | tuple[type, ...]) -> Sequence[Any]:
    """A list/tuple whose items are all instances of ``item_types`` (TypeError otherwise)."""
    check_isinstance(name, value, (list, tuple))
    for i, item in enumerate(value):
        check_isinstance(f"{name}[{i}]", item, item_types)
    return value


def _dtype_name(code: int) -> str:
    try:
        return DataType(code).name
    except ValueError:
        return f"data type {code}"


def check_same_dtype(src: int | None, dst: int | None, what: str) -> None:
    """Check that a transfer's source and destination caches hold the same element type.

    ``None`` (a peer that does not say, e.g. an older release) and ``DT_UINT8`` (a raw byte
    cache, which takes any element type) match anything. ``what`` names the two caches.

    Raises:
        LLMException: LLM_PARAM_INVALID naming both data types when they differ.
    """
    if src is None or dst is None or src == dst:
        return
    raw = DataType.DT_UINT8.value
    raise_if_false(
        src == raw or dst == raw,
        f"data type mismatch: {what}: the source holds {_dtype_name(src)}, the destination "
        f"{_dtype_name(dst)} (the same bytes would be read as another type; register the caches "
        "with the same DataType, or DT_UINT8 for raw bytes)",
    )
