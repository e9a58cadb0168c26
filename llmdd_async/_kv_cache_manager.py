"""The legacy ``KvCacheManager`` (reference §11): upstream's older API, on the same engine.

Selected when cache-manager mode is off (the upstream default). It differs from
:class:`CacheManager` in its role rules (§10), its ``KvCache`` type with per-device address
lists, list-only ``pull_blocks``, offsets on ``pull_cache``, ``get_cache_tensors``, and its
timeout code ``LLM_WAIT_PROCESS_TIMEOUT``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ._cache_manager import CacheManager
from ._checks import check_isinstance, check_uint64
from ._enums import DataType, LLMRole, Placement
from ._errors import raise_if_false
from ._faces import face_of
from ._task import CacheTask
from ._types import BlocksCacheKey, Cache, CacheDesc, CacheKey, CacheKeyByIdAndIndex

if TYPE_CHECKING:
    from ._datadist import LLMDataDist
    from ._engine import Engine

__all__ = ["KvCache", "KvCacheManager", "Tensor", "TensorDesc"]


class KvCache(Cache):
    """A legacy cache: like :class:`Cache`, with addresses per device.

    In single-process multi-device mode one KvCache stands for one cache per device
    (:attr:`devices`); ``tensor_addrs``, ``tensors`` and ``cache_id`` are device 0's.
    Dropping the last reference deallocates it while its manager still runs (as upstream).
    """

    _devices: list[KvCache] | None = None

    @property
    def devices(self) -> list[KvCache]:
        """The per-device caches (``[self]`` with one device)."""
        return list(self._devices) if self._devices is not None else [self]

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        return [d.tensor_addrs for d in self.devices]

    @property
    def valid(self) -> bool:
        if self._devices is not None:
            return self._valid and all(d.valid for d in self._devices)
        return super().valid

    @property
    def tensors(self) -> list[np.ndarray]:
        if self._devices is not None:
            return self._devices[0].tensors
        return super().tensors

    @classmethod
    def of_devices(cls, parts: Sequence[KvCache]) -> KvCache:
        """One KvCache over the caches of every device (same id and description on each).

        Raises:
            LLMException: LLM_PARAM_INVALID for no parts.
        """
        raise_if_false(len(parts) > 0, "a cache needs at least one device")
        first = parts[0]
        cache = cls(
            first.cache_id,
            first.cache_desc,
            first.tensor_addrs,
            first.is_blocks_cache,
            is_registered=first.is_registered,
        )
        cache._devices = list(parts)
        return cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Sequence[Any]) -> KvCache:
        """An unregistered host cache; ``addrs`` is a list, or a list with one list per device.

        Raises:
            TypeError / ValueError: bad types. LLMException: LLM_PARAM_INVALID as
                :meth:`Cache.create_cpu_cache`, or lists mixed with plain addresses.
        """
        check_isinstance("addrs", addrs, (list, tuple))
        if addrs and any(isinstance(a, list | tuple) for a in addrs):
            raise_if_false(
                all(isinstance(a, list | tuple) for a in addrs),
                "per-device address lists should be consistent: all lists, or all addresses",
            )
            parts = [cls.create_cpu_cache(cache_desc, list(a)) for a in addrs]
            return parts[0] if len(parts) == 1 else cls.of_devices(parts)
        base = Cache.create_cpu_cache(cache_desc, addrs)
        return cls(-1, base.cache_desc, base.tensor_addrs, True)

    def __del__(self) -> None:
        owner = getattr(self, "issuer", None)
        if owner is None or not self.valid or self.cache_id < 0:
            return
        owner.release_dropped(self.cache_id)


def _delegate(definition: Callable[..., Any], role: LLMRole | None = None) -> Callable[..., Any]:
    """A legacy method that is the CacheManager's (same signature), after the legacy role
    rule (§10) when ``role`` is given."""

    def call(self: KvCacheManager, name: str, *args: Any, **kwargs: Any) -> Any:
        if role is not None:
            self._require(role, name)
        return getattr(self._cm, name)(*args, **kwargs)

    rule = f"Only on a {role.name} endpoint. " if role is not None else ""
    return face_of(definition, call, doc=f"{rule}As :meth:`CacheManager.{definition.__name__}`.")


class TensorDesc:
    """Deprecated upstream: the data type and shape of a :class:`Tensor`."""

    def __init__(self, dtype: DataType, shape: Sequence[int]) -> None:
        self.dtype = dtype
        self.shape = list(shape)


class Tensor:
    """Deprecated upstream: a numpy-backed view of one cache tensor."""

    def __init__(self, array: np.ndarray, desc: TensorDesc) -> None:
        self._array = array
        self._desc = desc

    def numpy(self) -> np.ndarray:
        return self._array

    @property
    def desc(self) -> TensorDesc:
        return self._desc


class KvCacheManager:
    """``LLMDataDist.kv_cache_manager`` in legacy mode. Movements return CacheTasks."""

    def __init__(self, engine: Engine, datadist: LLMDataDist) -> None:
        self._cm = CacheManager(engine, cache_cls=KvCache)
        self._engine = engine
        self._datadist = datadist

    # ------------------------------------------------------------------ helpers
    def is_initialized(self) -> bool:
        return not self._engine.closed

    def _require(self, role: LLMRole, what: str) -> None:
        raise_if_false(
            self._datadist.role == role,
            f"{what} is only available on a {role.name} endpoint in legacy mode",
        )

    # ------------------------------------------------------------------ memory
    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> KvCache:
        """Raises: as CacheManager.allocate_cache; LLM_PARAM_INVALID for a HOST cache, or
        keys on a decoder."""
        check_isinstance("cache_desc", cache_desc, CacheDesc)
        raise_if_false(cache_desc.placement == Placement.DEVICE, "legacy caches live on DEVICE")
        if cache_keys:
            self._require(LLMRole.PROMPT, "allocate_cache with cache_keys")
        return cast(KvCache, self._cm.allocate_cache(cache_desc, cache_keys))

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> KvCache:
        if blocks_cache_key is not None:
            self._require(LLMRole.PROMPT, "allocate_blocks_cache with a key")
        return cast(KvCache, self._cm.allocate_blocks_cache(cache_desc, blocks_cache_key))

    def deallocate_cache(self, cache: Cache) -> None:
        """Frees contiguous and blocks caches alike.

        Raises: TypeError; LLMException(LLM_PARAM_INVALID) for a CPU cache."""
        check_isinstance("cache", cache, Cache)
        raise_if_false(cache.cache_id >= 0, "a CPU cache cannot be deallocated")
        if cache.is_blocks_cache:
            self._cm.deallocate_blocks_cache(cache)
        else:
            self._cm.deallocate_cache(cache)

    remove_cache_key = _delegate(CacheManager.remove_cache_key, LLMRole.PROMPT)

    def get_cache_tensors(self, cache: Cache, tensor_index: int = 0) -> list[Tensor]:
        """The cache's tensor ``tensor_index`` as a numpy-backed Tensor (one per device).

        Raises: LLMException(LLM_PARAM_INVALID) for an index out of range."""
        check_isinstance("cache", cache, Cache)
        check_uint64("tensor_index", tensor_index)
        desc = cache.cache_desc
        raise_if_false(tensor_index < desc.num_tensors, f"tensor_index {tensor_index} >= count")
        array = cache.tensors[tensor_index]
        return [Tensor(array, TensorDesc(desc.data_type, desc.shape))]

    # ------------------------------------------------------------------ movement
    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        kv_cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> CacheTask:
        """Decoder only. ``size=-1``: the local slot after ``dst_cache_offset``.

        Raises: as CacheManager.pull_cache; LLM_PARAM_INVALID on a prompt endpoint."""
        self._require(LLMRole.DECODER, "pull_cache")
        return self._cm.pull_cache(cache_key, kv_cache, batch_index, size, **kwargs)

    def pull_blocks(
        self,
        prompt_cache_key: BlocksCacheKey,
        decoder_kv_cache: Cache,
        prompt_blocks: list[int],
        decoder_blocks: list[int],
        **kwargs: Any,
    ) -> CacheTask:
        """Decoder only; block lists must be non-empty lists (not tuples) of equal length.

        Raises: TypeError for tuples or a non-BlocksCacheKey; LLMException(LLM_PARAM_INVALID)
            for empty or unequal lists, or on a prompt endpoint."""
        self._require(LLMRole.DECODER, "pull_blocks")
        check_isinstance("prompt_cache_key", prompt_cache_key, BlocksCacheKey)
        check_isinstance("prompt_blocks", prompt_blocks, list)
        check_isinstance("decoder_blocks", decoder_blocks, list)
        raise_if_false(prompt_blocks and decoder_blocks, "block lists must not be empty")
        raise_if_false(len(prompt_blocks) == len(decoder_blocks), "block lists differ in length")
        return self._cm.pull_blocks(
            prompt_cache_key, decoder_kv_cache, prompt_blocks, decoder_blocks, **kwargs
        )

    copy_cache = _delegate(CacheManager.copy_cache)
    copy_blocks = _delegate(CacheManager.copy_blocks)

    def swap_blocks(self, src: Cache, dst: Cache, src_to_dst: dict[int, int]) -> CacheTask:
        """Raises: as CacheManager.swap_blocks; LLM_PARAM_INVALID for a cache of several
        devices (this endpoint serves one)."""
        for name, cache in (("src", src), ("dst", dst)):
            raise_if_false(
                not isinstance(cache, KvCache) or len(cache.devices) == 1,
                f"{name} holds addresses of several devices; this endpoint serves one",
            )
        return self._cm.swap_blocks(src, dst, src_to_dst)

    #: prompt only; TransferConfig only (raw peer addresses), as legacy mode is not
    #: remote-accessible
    transfer_cache_async = _delegate(CacheManager.transfer_cache_async, LLMRole.PROMPT)
