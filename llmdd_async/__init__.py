"""llmdd_async: asyncio-native (and trio) KV-cache transfer, compatible with LLM-DataDist.

``import llmdd_async as dd`` gives the async API; ``llmdd_async.sync`` is the blocking facade
with upstream's exact names and semantics.
"""

from ._cache_manager import CacheManager
from ._cluster import LLMClusterInfo
from ._config import LLMConfig, LlmConfig
from ._datadist import LLMDataDist
from ._enums import (
    DataType,
    LLMRole,
    LLMStatusCode,
    Memtype,
    Placement,
    PushType,
    RegisterMemStatus,
)
from ._errors import LLMException, Status, SynchronizerAborted, TransferCancelled
from ._net.requests import LinkStatistics, TransferRecord
from ._synchronizer import AsyncLayerSynchronizer, LayerEvents, LayerSynchronizer
from ._task import CacheTask, LayerTiming, TaskStatistics
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

__version__ = "0.1.0"

__all__ = [
    "AsyncLayerSynchronizer",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerEvents",
    "LayerSynchronizer",
    "LayerTiming",
    "LinkStatistics",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "PushType",
    "RegisterMemStatus",
    "Status",
    "SynchronizerAborted",
    "TaskStatistics",
    "TransferCancelled",
    "TransferConfig",
    "TransferRecord",
    "TransferWithCacheKeyConfig",
]
