"""In-process: both endpoints live in one address space, so a transfer is one memmove."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._memory import CancelToken
from .._planner import Plan

__all__ = ["InProcessAccess"]


class InProcessAccess:
    """Initiator-side access to a peer endpoint of the same process."""

    name = "in-process"

    def __init__(self, copy: Any) -> None:
        self._copy = copy  # async (Plan, token) -> int, the device adapter's memmove runner

    def caps(self) -> dict[str, bool]:
        return {"inproc": True, "pools": True, "pvr": True}

    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        result: int = await self._copy(Plan(remote, local, nbytes), token)
        return result

    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        result: int = await self._copy(Plan(local, remote, nbytes), token)
        return result

    def close(self) -> None:
        pass
