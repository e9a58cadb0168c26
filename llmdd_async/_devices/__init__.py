"""Device ("stream") adapters: how the engine reaches memory that ``Placement.DEVICE`` names.

One small interface, one file per implementation, imported lazily so that a missing optional
dependency only matters to whoever selects that adapter.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._memory import CancelToken, PoolConfig
from .._planner import Plan

__all__ = ["DeviceAdapter", "DevicePool", "load_adapter", "ADAPTERS"]


class DevicePool(Protocol):
    """Memory handed out by ``allocate_cache`` for one placement."""

    base: int
    nbytes: int
    page_size: int

    def allocate(self, nbytes: int) -> Any: ...
    def free(self, alloc: Any) -> None: ...
    def view(self, alloc: Any, offset: int, nbytes: int) -> Any: ...
    def close(self) -> None: ...


class DeviceAdapter(Protocol):
    """What the engine needs from a kind of device memory."""

    name: str
    #: True when the CPU can read and write DEVICE memory at its addresses (host adapter).
    host_addressable: bool

    def resolve(self, obj: Any, nbytes: int, name: str) -> tuple[int, Any]:
        """Registration argument -> (address, keepalive). Raises LLMException(PARAM)."""
        ...

    def create_pool(self, config: PoolConfig, name: str) -> DevicePool:
        """A pool for ``allocate_cache`` of DEVICE caches. Raises LLMException(OUT_OF_MEMORY)."""
        ...

    def owns(self, addrs: Any) -> bool:
        """True if these addresses are device memory this adapter reaches only itself."""
        ...

    async def copy(self, plan: Plan, token: CancelToken) -> int:
        """Run a local plan without blocking the event loop; returns bytes copied.

        Raises:
            CopyCancelled: the token was cancelled (nothing after the current chunk was touched).
        """
        ...

    def close(self) -> None: ...


ADAPTERS = {"host": "._host", "torch": "._torch"}


def load_adapter(name: str, options: dict[str, str]) -> DeviceAdapter:
    """Instantiate the adapter named by ``llm.DeviceAdapter`` (default ``host``).

    Raises:
        LLMException: LLM_PARAM_INVALID for an unknown name, or a missing optional dependency
            (the message names the extra to install).
    """
    module_name = ADAPTERS.get(name)
    if module_name is None:
        raise LLMException(
            f"llm.DeviceAdapter must be one of {sorted(ADAPTERS)}, got {name!r}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    try:
        module = importlib.import_module(module_name, __name__)
    except ImportError as exc:
        raise LLMException(
            f"device adapter {name!r} needs an optional dependency ({exc}); "
            f"install it with: pip install 'llmdd-async[{name}]'",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None
    adapter: DeviceAdapter = module.create(options)
    return adapter
