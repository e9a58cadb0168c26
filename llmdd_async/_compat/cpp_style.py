"""The C++ API's shape (reference §13, seed ``PullKvBlocks``) for clients ported from C++.

``LlmDataDist(cluster_id, role)`` (C++ argument order) with methods that return
``LLMStatusCode``s instead of raising. As in C++, remote-accessible mode is always on; layer
ranges are inclusive ``(first, second)`` pairs with ``-1`` meaning every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._checks import check_int64, check_uint32, check_uint64
from .._cluster import LLMClusterInfo
from .._enums import LLMRole, LLMStatusCode
from .._errors import LLMException
from .._types import BlocksCacheKey, Cache, CacheDesc, CacheKeyByIdAndIndex
from .facade import LLMDataDist

__all__ = ["CacheIndex", "KvCacheExtParam", "LlmDataDist"]


class CacheIndex:
    """``CacheIndex{cluster_id, cache_id, batch_index}``: a remote cache by its id.

    Raises: TypeError / ValueError for values that are not uint64 / int64 / uint32.
    """

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_uint64("cluster_id", cluster_id)
        check_int64("cache_id", cache_id)
        check_uint32("batch_index", batch_index)
        self.cluster_id, self.cache_id, self.batch_index = cluster_id, cache_id, batch_index

    def key(self, batch_index: int | None = None) -> CacheKeyByIdAndIndex:
        """The Python API's key for this cache (``batch_index`` overrides the own one)."""
        return CacheKeyByIdAndIndex(
            self.cluster_id,
            self.cache_id,
            self.batch_index if batch_index is None else batch_index,
        )


@dataclasses.dataclass
class KvCacheExtParam:
    """Inclusive ``(first, second)`` layer ranges, ``(-1, -1)`` for all layers."""

    src_layer_range: tuple[int, int] = (-1, -1)
    dst_layer_range: tuple[int, int] = (-1, -1)
    tensor_num_per_layer: int = 2

    def ranges(self) -> tuple[range | None, range | None, int]:
        """Python ranges (None for all).

        Raises:
            LLMException: LLM_PARAM_INVALID for first > second, a half-default pair, or
                ranges of different lengths.
        """

        def one(pair: tuple[int, int], name: str) -> range | None:
            first, second = pair
            if (first, second) == (-1, -1):
                return None
            if first < 0 or second < first:
                raise LLMException(
                    f"{name} {pair}: need 0 <= first <= second, or (-1, -1) for all",
                    status_code=LLMStatusCode.LLM_PARAM_INVALID,
                )
            return range(first, second + 1)

        src = one(self.src_layer_range, "src_layer_range")
        dst = one(self.dst_layer_range, "dst_layer_range")
        if src is not None and dst is not None and len(src) != len(dst):
            raise LLMException(
                "src and dst layer ranges must span the same number of layers",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        return src, dst, self.tensor_num_per_layer


def _ranges(ext_param: KvCacheExtParam | None) -> tuple[range | None, range | None, int]:
    return (ext_param or KvCacheExtParam()).ranges()


def _cpp_keys(options: Mapping[str, str] | None) -> dict[str, str]:
    """Options with the C++ spelling of the listen key renamed to the Python one."""
    opts = dict(options or {})
    if "llm.ListenIpInfo" in opts:
        opts["llm.listenIpInfo"] = opts.pop("llm.ListenIpInfo")
    return opts


def _codes(
    fn: Callable[[], tuple[LLMStatusCode, list[LLMStatusCode]]],
) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    """Run a link/unlink call; bad arguments become a status code, as the C++ API reports."""
    try:
        return fn()
    except LLMException as exc:
        return exc.status_code, []
    except (TypeError, ValueError):
        return LLMStatusCode.LLM_PARAM_INVALID, []


def _status(fn: Callable[[], Any]) -> LLMStatusCode:
    """Run ``fn`` and turn its outcome into a status code, as the C++ API reports."""
    try:
        fn()
    except LLMException as exc:
        return exc.status_code
    except (TypeError, ValueError):
        return LLMStatusCode.LLM_PARAM_INVALID
    except RuntimeError:  # not initialised
        return LLMStatusCode.LLM_FAILED
    return LLMStatusCode.LLM_SUCCESS


class LlmDataDist:
    """The C++ ``llm_datadist::LlmDataDist`` surface, in Python, over the blocking facade."""

    def __init__(self, cluster_id: int, role: LLMRole) -> None:
        self._dd = LLMDataDist(role, cluster_id)
        self._caches: dict[int, Cache] = {}

    def initialize(self, options: Mapping[str, str]) -> LLMStatusCode:
        """C++ keys (``llm.ListenIpInfo``, ``llm.DeviceId``, ...) are accepted; remote-accessible
        cache-manager mode is always on."""
        opts = _cpp_keys(options)
        if "llm.DeviceId" in opts:
            opts.setdefault("ge.exec.deviceId", opts.pop("llm.DeviceId"))
        opts["llm.EnableCacheManager"] = "1"
        opts["llm.EnableRemoteCacheAccessible"] = "1"
        return _status(lambda: self._dd.init(opts))

    def finalize(self) -> None:
        self._dd.finalize()

    def set_role(self, role: LLMRole, options: Mapping[str, str] | None = None) -> LLMStatusCode:
        opts = _cpp_keys(options)
        return _status(lambda: self._dd.switch_role(role, opts))

    def link_llm_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 1000
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        return _codes(lambda: self._dd.link_clusters(clusters, timeout))

    def unlink_llm_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout: int = 1000, force_flag: bool = False
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        return _codes(lambda: self._dd.unlink_clusters(clusters, timeout, force_flag))

    def register_kv_cache(
        self, cache_desc: CacheDesc, addrs: Sequence[Any], is_blocks: bool = True
    ) -> tuple[LLMStatusCode, int]:
        """Register memory; returns ``(status, cache_id)`` (-1 on failure). C++ caches are used
        with block lists (xLLM's pattern); pass ``is_blocks=False`` for slot transfers."""
        out: list[Cache] = []

        def run() -> None:
            cm = self._dd.cache_manager
            register = cm.register_blocks_cache if is_blocks else cm.register_cache
            out.append(register(cache_desc, list(addrs), None, True))

        status = _status(run)
        if not out:
            return status, -1
        self._caches[out[0].cache_id] = out[0]
        return status, out[0].cache_id

    def unregister_kv_cache(self, cache_id: int) -> LLMStatusCode:
        status = _status(lambda: self._dd.cache_manager.unregister_cache(cache_id))
        if status == LLMStatusCode.LLM_SUCCESS:
            self._caches.pop(cache_id, None)
        return status

    def _cache(self, cache: Cache | int) -> Cache:
        if not self._dd.is_initialized():
            raise RuntimeError("llm datadist is not initialized")
        if isinstance(cache, Cache):
            return cache
        found = self._caches.get(int(cache))
        if found is None:
            raise LLMException(
                f"cache {cache} was not registered here",
                status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
            )
        return found

    def pull_kv_cache(
        self,
        src_cache_index: CacheIndex,
        dst_cache: Cache | int,
        batch_index: int = 0,
        size: int = -1,
        ext_param: KvCacheExtParam | None = None,
    ) -> LLMStatusCode:
        def run() -> None:
            src, dst, n = _ranges(ext_param)
            self._dd.cache_manager.pull_cache(
                src_cache_index.key(),
                self._cache(dst_cache),
                batch_index,
                size,
                src_layer_range=src,
                dst_layer_range=dst,
                tensor_num_per_layer=n,
            )

        return _status(run)

    def pull_kv_blocks(
        self,
        src_cache_index: CacheIndex,
        dst_cache: Cache | int,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
    ) -> LLMStatusCode:
        """``src_cache_index.batch_index`` must be 0 (LLM_PARAM_INVALID otherwise)."""

        def run() -> None:
            if src_cache_index.batch_index != 0:
                raise LLMException(
                    "batch_index must be 0 for blocks", status_code=LLMStatusCode.LLM_PARAM_INVALID
                )
            src, dst, n = _ranges(ext_param)
            # Blocks by cache id: the C++ API addresses caches by id, not by model_id.
            self._dd.cache_manager.pull_blocks_by_id(
                src_cache_index.key(0),
                self._cache(dst_cache),
                list(src_blocks),
                list(dst_blocks),
                src,
                dst,
                n,
            )

        return _status(run)

    def push_kv_cache(
        self,
        src_cache: Cache | int,
        dst_cache_index: CacheIndex,
        src_batch_index: int = 0,
        size: int = -1,
        ext_param: KvCacheExtParam | None = None,
    ) -> LLMStatusCode:
        def run() -> None:
            src, dst, n = _ranges(ext_param)
            self._dd.cache_manager.push_cache(
                dst_cache_index.key(), self._cache(src_cache), src_batch_index, src, dst, size, n
            )

        return _status(run)

    def push_kv_blocks(
        self,
        src_cache: Cache | int,
        dst_cache_index: CacheIndex,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
    ) -> LLMStatusCode:
        def run() -> None:
            src, dst, n = _ranges(ext_param)
            self._dd.cache_manager.push_blocks_by_id(
                dst_cache_index.key(0),
                self._cache(src_cache),
                list(src_blocks),
                list(dst_blocks),
                src,
                dst,
                n,
            )

        return _status(run)

    def blocks_key(self, cluster_id: int, model_id: int = 0) -> BlocksCacheKey:
        """Convenience for mixing with the Python API."""
        return BlocksCacheKey(cluster_id, model_id)
