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

import contextlib
import importlib.util
from typing import Protocol

import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._memory import CancelToken

__all__ = ["INSTALL_HINTS", "PeerAccess", "installed", "require_installed"]

#: the optional transports: the packages that provide each (any one of them) and how to install
_PACKAGES: dict[str, tuple[str, ...]] = {"nixl": ("nixl", "nixl_cu12", "nixl_cu13")}
INSTALL_HINTS: dict[str, str] = {
    "nixl": (
        "pip install --no-deps nixl-cu12  (NIXL with UCX bundled, about 68 MB, enough on CPU); "
        "'pip install llmdd-async[nixl]' pulls NIXL's CUDA dependencies too"
    ),
}


def installed(name: str) -> bool:
    """True if transport ``name`` needs no optional package or one of its packages is installed
    (found, not imported: cheap, and no transport module is loaded)."""
    for pkg in _PACKAGES.get(name, ()):
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(pkg) is not None:
                return True
    return name not in _PACKAGES


def require_installed(name: str) -> None:
    """Raises:
    LLMException: LLM_PARAM_INVALID naming the install line when transport ``name``'s optional
        package is missing."""
    if not installed(name):
        raise LLMException(
            f"llm.Transport={name} needs {name.upper()}, which is not installed: "
            f"{INSTALL_HINTS[name]}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )


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
