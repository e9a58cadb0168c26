"""Transports: how the bytes of a granted plan move between two endpoints.

* ``tcp``: the bytes travel on the link's socket as DATA frames, received straight into the
  destination blocks with ``recvmsg_into`` and sent from the source blocks with ``sendmsg``.
* ``same_host``: the initiator copies straight from/to the peer's memory: pool memory through
  a shared mapping of the peer's ``memfd``, other memory with ``process_vm_readv/writev``.
* ``in_process``: both endpoints share an address space; one memmove.
* ``nixl``: one-sided NIXL READ/WRITE (UCX: RDMA, cma, shm, tcp, cuda_ipc) between the granted
  ranges, when both endpoints set ``llm.Transport=nixl`` (loaded only then).

The link picks per transfer; ``llm.Transport`` (``auto``, ``tcp``, ``same-host``, ``nixl``)
constrains it. Another transfer engine (Mooncake TE) would be one more module offering the same
:class:`PeerAccess` shape: ``read`` / ``write`` of granted ranges, ``caps``, ``close``, plus the
optional hooks ``attach(link)`` (fetch its metadata over the link) and ``caps_for(entry)``
(which local caches it can reach). An access that also offers ``reaches(remote, nbytes)`` and
``read_word(addr)`` (reading the peer's epoch page without a syscall into the peer) lets
remote-accessible pulls run one-sidedly; only the same-host access does.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .._memory import CancelToken

__all__ = ["PeerAccess"]


class PeerAccess(Protocol):
    """One-copy access to a linked peer's memory, used by the initiator of a transfer."""

    name: str

    def caps(self) -> dict[str, bool]:
        """Which of the peer's memory this access reaches, as sent with each request:
        ``inproc`` (all of it), ``pools`` (its shared pools), ``pvr`` (any of its memory)."""
        ...

    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """Copy peer memory into local memory; returns bytes. Raises CopyCancelled, OSError."""
        ...

    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """Copy local memory into peer memory; returns bytes. Raises CopyCancelled, OSError."""
        ...

    def close(self) -> None: ...
