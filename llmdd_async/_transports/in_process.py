"""In-process: both endpoints live in one address space, so a transfer is one memmove."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .._memory import CancelToken
from .._planner import Plan
from . import CopyRunner, PeerAccess

__all__ = ["InProcessAccess"]


class InProcessAccess(PeerAccess):
    """Initiator-side access to a peer endpoint of the same process."""

    name: ClassVar[str] = "in-process"
    peer_caps: ClassVar[tuple[str, ...]] = ("inproc", "pools", "pvr")

    def __init__(self, copy: CopyRunner) -> None:
        super().__init__()
        self._copy = copy  # the device adapter's memmove runner

    def caps(self) -> dict[str, bool]:
        return {"inproc": True, "pools": True, "pvr": True}

    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        return await self._copy(Plan(remote, local, nbytes), token)

    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        return await self._copy(Plan(local, remote, nbytes), token)

    def close(self) -> None:
        pass
