"""Value types of the llm_datadist API (reference §7), validated as upstream does: cache
descriptions, caches, keys and transfer configs (``LLMClusterInfo`` is in :mod:`._cluster`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._checks import (
    UINT64_MAX,
    check_int64,
    check_isinstance,
    check_range,
    check_uint32,
    check_uint64,
)
from ._enums import DataType, Memtype, Placement
from ._errors import raise_if_false

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "MemInfo",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]


class CacheDesc:
    """Shape of a cache: ``num_tensors`` tensors of ``shape`` and ``data_type`` each.

    ``size`` is the bytes of ONE tensor. Dim 0 is the batch (contiguous caches) or block
    (paged caches) axis, whatever ``batch_dim_index`` says: like upstream, the engine ignores it.

    Raises:
        TypeError / ValueError: wrong argument types or integer ranges.
        LLMException: LLM_PARAM_INVALID for an index outside the shape.
    """

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_uint32("num_tensors", num_tensors)
        check_isinstance("shape", shape, (list, tuple))
        for i, dim in enumerate(shape):
            check_int64(f"shape[{i}]", dim)
        check_isinstance("data_type", data_type, DataType)
        check_isinstance("placement", placement, Placement)
        check_isinstance("batch_dim_index", batch_dim_index, int)
        check_isinstance("seq_len_dim_index", seq_len_dim_index, int)
        check_isinstance("kv_tensor_format", kv_tensor_format, str, optional=True)
        raise_if_false(
            0 <= batch_dim_index < max(len(shape), 1),
            f"batch_dim_index {batch_dim_index} is outside shape {list(shape)}",
        )
        raise_if_false(
            seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape),
            f"seq_len_dim_index {seq_len_dim_index} must be -1 or inside shape {list(shape)}",
        )
        self._num_tensors = int(num_tensors)
        self._shape = [int(d) for d in shape]
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = batch_dim_index
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        self._size: int | None = None
        #: upstream's hidden flag, set by registering or allocating a blocks cache over it
        self._is_blocks = False

    num_tensors = property(lambda self: self._num_tensors)
    data_type = property(lambda self: self._data_type)
    placement = property(lambda self: self._placement)
    batch_dim = property(lambda self: self._batch_dim_index)
    batch_dim_index = property(lambda self: self._batch_dim_index)
    seq_len_dim_index = property(lambda self: self._seq_len_dim_index)
    kv_tensor_format = property(lambda self: self._kv_tensor_format)

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    @property
    def batch_size(self) -> int:
        return self._shape[self._batch_dim_index]

    @property
    def size(self) -> int:
        """Bytes of one tensor: ``prod(shape) * itemsize``.

        Raises:
            ValueError: for ``DT_STRING``.
        """
        if self._size is None:
            self._size = math.prod(self._shape) * self._data_type.itemsize
        return self._size

    def update_dim(self, dim_index: int, value: int) -> None:
        """Change one dimension in place; ``size`` is recomputed.

        Raises:
            TypeError / ValueError: bad types; LLMException: index outside the shape.
        """
        check_isinstance("dim_index", dim_index, int)
        check_int64("value", value)
        raise_if_false(0 <= dim_index < len(self._shape), f"dim_index {dim_index} out of range")
        self._shape[dim_index] = int(value)
        self._size = None

    def mark_blocks(self) -> None:
        """Set the hidden blocks flag, as upstream's blocks registration does to the caller's
        description."""
        self._is_blocks = True

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type}, placement={self._placement})"
        )


class Cache:
    """A cache known to a CacheManager (or a CPU cache for ``swap_blocks``).

    Users do not construct it. ``tensors`` gives numpy views of its memory so contents can be
    read and written without address arithmetic.
    """

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: list[int],
        is_blocks_cache: bool,
        *,
        is_registered: bool = False,
        views: Callable[[], list[np.ndarray]] | None = None,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = list(tensor_addrs)
        self._is_blocks = is_blocks_cache
        self._is_registered = is_registered
        self._views = views
        self._valid = True
        #: the CacheManager that issued it (None for CPU caches); see :meth:`issued_by`
        self.issuer: Any = None

    cache_id = property(lambda self: self._cache_id)
    cache_desc = property(lambda self: self._cache_desc)
    is_blocks_cache = property(lambda self: self._is_blocks)
    is_registered = property(lambda self: self._is_registered)

    @property
    def tensor_addrs(self) -> list[int]:
        return list(self._tensor_addrs)

    @property
    def valid(self) -> bool:
        """False once the cache was deallocated or its engine finalized."""
        return self._valid and not getattr(self.issuer, "closed", False)

    @property
    def tensors(self) -> list[np.ndarray]:
        """numpy views of the tensors, shaped ``cache_desc.shape`` with its dtype.

        Raises:
            LLMException: LLM_PARAM_INVALID if the cache is no longer valid, or if its memory
                is not host-addressable (accelerator memory: use your framework's tensors).
        """
        raise_if_false(self.valid, f"cache {self._cache_id} is no longer valid")
        if self._views is None:
            from ._memory import host_view

            desc = self._cache_desc
            return [
                host_view(addr, desc.size).view(desc.data_type.numpy_dtype).reshape(desc.shape)
                for addr in self._tensor_addrs
            ]
        return self._views()

    def issued_by(self, manager: object) -> bool:
        """True when ``manager`` issued this cache (caches of other endpoints are not its)."""
        return self.issuer is manager

    def invalidate(self) -> None:
        """Mark the cache deallocated: it is no longer valid and has no views."""
        self._valid = False
        self._views = None

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Sequence[int]) -> Cache:
        """An unregistered host blocks cache (``cache_id=-1``) for :meth:`swap_blocks`.

        Raises:
            TypeError: bad argument types.
            LLMException: LLM_PARAM_INVALID unless placement is HOST and there is one address
                per tensor.
        """
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        check_isinstance("addrs", addrs, (list, tuple))
        for i, a in enumerate(addrs):
            check_uint64(f"addrs[{i}]", a)
        raise_if_false(cache_desc.placement == Placement.HOST, "cpu cache placement must be HOST")
        raise_if_false(
            len(addrs) == cache_desc.num_tensors,
            f"cpu cache needs {cache_desc.num_tensors} addresses, got {len(addrs)}",
        )
        return cls(-1, cache_desc, [int(a) for a in addrs], True)

    def __str__(self) -> str:
        return (
            f"Cache(cache_id={self._cache_id}, tensor_addrs_num={len(self._tensor_addrs)}, "
            f"is_blocks_cache={self._is_blocks})"
        )

    __repr__ = __str__


def _valid_id(value: int) -> bool:
    return 0 <= value != UINT64_MAX


def slot_key_of(key: CacheKey) -> tuple[str, int, int] | None:
    """The engine identity of a key, ``("req" | "prefix", id, model_id)``; None for a
    placeholder (neither id valid)."""
    if key.req_id != UINT64_MAX:
        return ("req", key.req_id, key.model_id)
    if key.prefix_id != UINT64_MAX:
        return ("prefix", key.prefix_id, key.model_id)
    return None


def _bind_key_args(
    cls_name: str,
    fields: tuple[str, ...],
    required: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Map a key's positional and keyword arguments to its fields, as upstream binds them
    (``prompt_cluster_id`` is an alias of ``cluster_id``; the first ``required`` fields must be
    given).

    Raises:
        LLMException: LLM_PARAM_INVALID for too many, missing, unknown or repeated parameters.
    """
    raise_if_false(
        len(args) + len(kwargs) <= len(fields),
        f"{cls_name} takes at most {len(fields)} parameters",
    )
    if "prompt_cluster_id" in kwargs:
        raise_if_false("cluster_id" not in kwargs, "cluster_id given twice")
        kwargs["cluster_id"] = kwargs.pop("prompt_cluster_id")
    values = dict(zip(fields, args, strict=False))
    for name, value in kwargs.items():
        raise_if_false(name in fields, f"{cls_name} got an unknown parameter {name!r}")
        raise_if_false(name not in values, f"{cls_name} got {name!r} twice")
        values[name] = value
    for name in fields[:required]:
        raise_if_false(name in values, f"{cls_name} needs {name}")
    return values


class CacheKey:
    """Key of a contiguous cache slot: ``(cluster_id, req_id, model_id=0, prefix_id=2**64-1)``.

    ``prompt_cluster_id`` is a keyword alias of ``cluster_id``.

    Raises:
        TypeError / ValueError: a field that is not a uint64.
        LLMException: LLM_PARAM_INVALID for too many, missing or unknown parameters.
    """

    _FIELDS = ("cluster_id", "req_id", "model_id", "prefix_id")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = _bind_key_args("CacheKey", self._FIELDS, 2, args, kwargs)
        values.setdefault("model_id", 0)
        values.setdefault("prefix_id", UINT64_MAX)
        for name in self._FIELDS:
            check_uint64(name, values[name])
        self._cluster_id = int(values["cluster_id"])
        self._req_id = int(values["req_id"])
        self._model_id = int(values["model_id"])
        self._prefix_id = int(values["prefix_id"])

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    req_id = property(lambda self: self._req_id)
    model_id = property(lambda self: self._model_id)
    prefix_id = property(lambda self: self._prefix_id)

    @property
    def is_prefix(self) -> bool:
        return not _valid_id(self._req_id) and _valid_id(self._prefix_id)

    def check_pullable(self) -> None:
        """Exactly one of req_id / prefix_id must be valid.

        Raises:
            LLMException: LLM_PARAM_INVALID otherwise.
        """
        raise_if_false(
            _valid_id(self._req_id) != _valid_id(self._prefix_id),
            f"{self!r} must have exactly one valid req_id or prefix_id",
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and (
            self._cluster_id,
            self._req_id,
            self._model_id,
            self._prefix_id,
        ) == (other._cluster_id, other._req_id, other._model_id, other._prefix_id)

    def __hash__(self) -> int:
        return hash((CacheKey, self._cluster_id, self._req_id, self._model_id, self._prefix_id))

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"model_id={self._model_id}, prefix_id={self._prefix_id})"
        )


class CacheKeyByIdAndIndex:
    """Address of a remote cache by its cache_id and batch slot.

    Raises:
        TypeError / ValueError: cluster_id not uint64, cache_id not int64, batch_index not uint32.
    """

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self._cluster_id = int(cluster_id)
        self._cache_id = int(cache_id)
        self._batch_index = int(batch_index)

    cluster_id = property(lambda self: self._cluster_id)
    cache_id = property(lambda self: self._cache_id)
    batch_index = property(lambda self: self._batch_index)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKeyByIdAndIndex) and (
            self._cluster_id,
            self._cache_id,
            self._batch_index,
        ) == (other._cluster_id, other._cache_id, other._batch_index)

    def __hash__(self) -> int:
        return hash((CacheKeyByIdAndIndex, self._cluster_id, self._cache_id, self._batch_index))

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksCacheKey:
    """Key of a paged cache: ``(cluster_id, model_id=0)``; alias ``prompt_cluster_id``.

    Raises:
        TypeError: a value that is not an int.
        LLMException: LLM_PARAM_INVALID for too many, missing or unknown parameters.
    """

    _FIELDS = ("cluster_id", "model_id")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        values = _bind_key_args("BlocksCacheKey", self._FIELDS, 1, args, kwargs)
        values.setdefault("model_id", 0)
        for name in self._FIELDS:
            check_isinstance(name, values[name], int)
        self._cluster_id = int(values["cluster_id"])
        self._model_id = int(values["model_id"])

    cluster_id = property(lambda self: self._cluster_id)
    prompt_cluster_id = property(lambda self: self._cluster_id)
    model_id = property(lambda self: self._model_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlocksCacheKey) and (self._cluster_id, self._model_id) == (
            other._cluster_id,
            other._model_id,
        )

    def __hash__(self) -> int:
        return hash((BlocksCacheKey, self._cluster_id, self._model_id))

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


class MemInfo:
    """Memory description for ``remap_registered_memory`` (type-checked only)."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_isinstance("mem_type", mem_type, Memtype)
        check_uint64("addr", addr)
        check_uint64("size", size)
        self._mem_type, self._addr, self._size = mem_type, int(addr), int(size)

    mem_type = property(lambda self: self._mem_type)
    addr = property(lambda self: self._addr)
    size = property(lambda self: self._size)


class TransferConfig:
    """Destination of ``transfer_cache_async`` by raw remote tensor addresses.

    ``dst_addrs`` are the peer's addresses of the layers being sent, ``tensor_num`` (2) per
    layer; they are resolved and bounds-checked against the peer's registered memory.

    Raises:
        TypeError / ValueError: wrong types or integer ranges.
        LLMException: LLM_PARAM_INVALID for a bad layer range.
    """

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: Sequence[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, value: int) -> None:
        check_uint64("dst_cluster_id", value)
        self._dst_cluster_id = int(value)

    @property
    def dst_addrs(self) -> list[int]:
        return list(self._dst_addrs)

    @dst_addrs.setter
    def dst_addrs(self, value: Sequence[int]) -> None:
        check_isinstance("dst_addrs", value, (list, tuple))
        for i, a in enumerate(value):
            check_uint64(f"dst_addrs[{i}]", a)
        self._dst_addrs = [int(a) for a in value]

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range | None) -> None:
        self._src_layer_range = check_range("src_layer_range", value)

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        check_uint32("src_batch_index", value)
        self._src_batch_index = int(value)


class TransferWithCacheKeyConfig:
    """Destination of ``transfer_cache_async`` by key (remote-accessible mode).

    Raises:
        TypeError: a bad key type, or a layer range that is None.
        LLMException: LLM_PARAM_INVALID for bad or unequal ranges, or a non-zero
            ``src_batch_index`` with a BlocksCacheKey.
    """

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range,
        dst_layer_range: range,
        src_batch_index: int = 0,
    ) -> None:
        self._init = False
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        self.src_batch_index = src_batch_index
        self._init = True
        self._check_consistency()

    def _check_consistency(self) -> None:
        if not self._init:
            return
        raise_if_false(
            len(self._src_layer_range) == len(self._dst_layer_range),
            f"src_layer_range {self._src_layer_range} and dst_layer_range "
            f"{self._dst_layer_range} differ in length",
        )
        if isinstance(self._cache_key, BlocksCacheKey):
            raise_if_false(
                self._src_batch_index == 0, "src_batch_index must be 0 with a BlocksCacheKey"
            )

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, value: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        check_isinstance("cache_key", value, (BlocksCacheKey, CacheKeyByIdAndIndex))
        self._cache_key = value
        self._check_consistency()

    @property
    def dst_cluster_id(self) -> int:
        return self._cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, value: range) -> None:
        if value is None:
            raise TypeError("src_layer_range is required")
        checked = check_range("src_layer_range", value, optional=False)
        assert checked is not None
        self._src_layer_range = checked
        self._check_consistency()

    @property
    def dst_layer_range(self) -> range:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range) -> None:
        if value is None:
            raise TypeError("dst_layer_range is required")
        checked = check_range("dst_layer_range", value, optional=False)
        assert checked is not None
        self._dst_layer_range = checked
        self._check_consistency()

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, value: int) -> None:
        check_uint32("src_batch_index", value)
        self._src_batch_index = int(value)
        self._check_consistency()
