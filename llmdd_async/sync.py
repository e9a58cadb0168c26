"""The blocking facade: ``llm_datadist``'s API, names and semantics, over llmdd_async.

Client code written for Huawei's ``llm_datadist`` runs by changing its import::

    from llmdd_async.sync import LLMDataDist, LLMConfig, LLMRole, CacheDesc, ...

Every call blocks its calling thread (never an event loop) and is safe from many threads at
once: the work runs on one background event-loop thread per process (uvloop when installed).
As upstream, one ``LLMDataDist`` may be initialised per process (a second raises
``LLMException(LLM_FAILED)``), ``finalize()`` then ``init()`` again on the same object works,
calls before ``init()`` raise ``RuntimeError("llm datadist is not initialized")``, an
``atexit`` hook finalises the live instance, ``link_clusters`` returns codes, and transfers
raise ``LLMException`` with upstream's status codes. ``transfer_cache_async`` returns a
:class:`CacheTask` whose ``synchronize()`` / ``get_results()`` block.

The C++-style surface (``LlmDataDist``, ``CacheIndex``, ``KvCacheExtParam``, returning status
codes) is here too, for clients ported from the C++ API.
"""

from __future__ import annotations

from ._cluster import LLMClusterInfo
from ._compat.cpp_style import CacheIndex, KvCacheExtParam, LlmDataDist
from ._compat.facade import CacheManager, CacheTask, KvCacheManager, LLMDataDist
from ._config import LLMConfig, LlmConfig
from ._enums import DataType, LLMRole, LLMStatusCode, Memtype, Placement, RegisterMemStatus
from ._errors import LLMException, Status
from ._kv_cache_manager import KvCache, Tensor, TensorDesc
from ._synchronizer import LayerSynchronizer
from ._types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "KvCache",
    "KvCacheExtParam",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LlmConfig",
    "LlmDataDist",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "Tensor",
    "TensorDesc",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]
