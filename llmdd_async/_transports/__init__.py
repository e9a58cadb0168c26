"""Transports: how the bytes of a granted plan move between two endpoints.

* ``tcp``: the bytes travel on the link's socket as DATA frames, received straight into the
  destination blocks with ``recvmsg_into`` and sent from the source blocks with ``sendmsg``.
  A link without an access (``Link.access is None``) moves every byte this way.
* ``same_host``: the initiator copies straight from/to the peer's memory: pool memory through
  a shared mapping of the peer's ``memfd``, other memory with ``process_vm_readv/writev``.
* ``in_process``: both endpoints share an address space; one memmove.
* ``nixl``: one-sided NIXL READ/WRITE (UCX: RDMA, cma, shm, tcp, cuda_ipc) between the granted
  ranges, when both endpoints set ``llm.Transport=nixl`` (loaded only then).
* ``mooncake``: one-sided Mooncake Transfer Engine READ/WRITE (its TCP protocol) between the
  granted ranges, when both endpoints set ``llm.Transport=mooncake`` (loaded only then).

The link picks per transfer; ``llm.Transport`` (one key of :data:`TRANSPORTS`) constrains it.
Two interfaces, both here:

* :class:`PeerAccess`: one link's one-copy access to its peer's memory (``read`` / ``write`` of
  granted ranges, ``caps``, ``close``), with default implementations of the optional hooks, so
  nothing outside a transport's file asks which transport it has.
* :class:`TransportEndpoint`: the endpoint-wide half of a transport that has one (NIXL's
  agent), made when the engine starts by the module :data:`TRANSPORTS` names, loaded lazily.

Accesses to a process the same-host side channel proved (``_net/side_channel``) come from
:func:`direct_access`. Each transfer engine (NIXL, Mooncake TE) is one entry of
:data:`TRANSPORTS` and one module offering both shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import anyio
import numpy as np

from .._enums import LLMStatusCode
from .._errors import LLMException
from .._memory import CancelToken
from .._messages import Identity, Proof, TableSnapshot, no_regions
from .._planner import Plan

if TYPE_CHECKING:
    from .._devices import DeviceAdapter

__all__ = [
    "NO_CAPS",
    "TRANSPORTS",
    "AccessLink",
    "CopyRunner",
    "EndpointHost",
    "EngineAccess",
    "PeerAccess",
    "RegisteredCache",
    "Transport",
    "TransportEndpoint",
    "direct_access",
    "installed",
    "peer_asks_for",
    "require_installed",
    "start_endpoint",
    "transport",
]

#: caps of a request whose local memory only the stream can reach
NO_CAPS: Mapping[str, bool] = {"inproc": False, "pools": False, "pvr": False}

#: an async memmove runner over a local plan (the device adapter's ``copy``)
CopyRunner = Callable[[Plan, CancelToken], Awaitable[int]]


# ---------------------------------------------------------------------- what a transport sees
class RegisteredCache(Protocol):
    """What a transport reads of a registered cache (the registry's entry)."""

    cache_id: int
    addrs: np.ndarray
    tensor_bytes: int
    count: int
    remote_accessible: bool


class PeerTableView(Protocol):
    """A link's view of its peer's table (``_net.peer_view.PeerView``), as an access sees it."""

    async def refetch(self, timeout_s: float) -> TableSnapshot | None:
        """Ask the peer for its table now and make it the view's (its regions, caches and
        epoch, all from that copy); that copy, or None if no answer came in time. Raises
        LinkBroken: the link failed meanwhile; LLMException: the peer's table is too big to
        be sent (it says so), or it waited the timeout for a build slot (LLM_TIMEOUT)."""
        ...


class AccessLink(Protocol):
    """What an access may use of the link it serves (:meth:`PeerAccess.attach`)."""

    log: Any

    @property
    def view(self) -> PeerTableView: ...

    #: the worker threads this link may hold
    threads: anyio.CapacityLimiter

    @property
    def peer_host(self) -> str:
        """The address the link's socket is connected to (where the peer really is)."""
        ...

    @property
    def alive(self) -> bool: ...

    def fail(self, exc: BaseException, expected: bool = False) -> None: ...


class EndpointHost(Protocol):
    """What a :class:`TransportEndpoint` may use of the engine it serves."""

    cluster_id: int
    log: Any
    adapter: DeviceAdapter

    @property
    def listen_host(self) -> str | None:
        """The address of ``llm.listenIpInfo``, or None when the endpoint does not listen."""
        ...

    @property
    def sync_kv_timeout_s(self) -> float: ...

    @property
    def stall_timeout_s(self) -> float: ...

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


# ---------------------------------------------------------------------- the interfaces
class PeerAccess(ABC):
    """One-copy access to a linked peer's memory, used by the initiator of a transfer.

    Subclasses implement :meth:`caps`, :meth:`read`, :meth:`write` and :meth:`close`; every
    other hook has a default that suits an access with nothing more to say.
    """

    #: the kind of link it makes (``LinkStatistics.transport``, the ``link.up`` log line)
    name: ClassVar[str]
    #: the direct-access caps a peer on a link of this kind may use in its requests (what it
    #: claims beyond them is ignored: it gets stream grants)
    peer_caps: ClassVar[tuple[str, ...]] = ()
    #: reaches the peer's memory without the peer's help (:meth:`reaches`, :meth:`read_word`
    #: answer), so remote-accessible pulls may be planned and run one-sidedly
    one_sided: ClassVar[bool] = False

    def __init__(self) -> None:
        #: (starts, ends) of the peer's memory it published as reachable
        self.regions: tuple[np.ndarray, np.ndarray] = no_regions()

    @abstractmethod
    def caps(self) -> dict[str, bool]:
        """Which of the peer's memory this access reaches, as sent with each request:
        ``inproc`` (all of it), ``pools`` (its shared pools), ``pvr`` (any of its memory),
        or a transport's own (``nixl``)."""

    @abstractmethod
    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """Copy peer memory into local memory; returns bytes. Raises CopyCancelled, OSError."""

    @abstractmethod
    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """Copy local memory into peer memory; returns bytes. Raises CopyCancelled, OSError."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the peer's memory (called once no request of the link runs). Never
        raises."""

    # ------------------------------------------------------------------ optional hooks
    def attach(self, link: AccessLink) -> None:
        """The link this access serves is registered (an access may fetch what it needs
        over it). Default: nothing."""
        return None

    async def ready(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until what :meth:`attach` started is done, before the
        link_clusters that made the link returns. Default: ready at once."""
        return None

    def caps_for(self, entry: RegisteredCache, host_reachable: bool) -> dict[str, bool]:
        """Caps of a request from/to local cache ``entry`` (``host_reachable``: the CPU can
        address its memory). Default: :meth:`caps` for host memory, none for device memory."""
        return self.caps() if host_reachable else dict(NO_CAPS)

    def reaches(self, remote: np.ndarray, nbytes: np.ndarray) -> bool:
        """True if every range of the peer's memory can be copied without the peer's help
        (one-sided pulls, and local grants of caches the peer does not publish). Default:
        False."""
        return False

    def copy_now(
        self,
        remote: np.ndarray,
        local: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
        read: bool,
    ) -> int | None:
        """Copy a small plan on the loop, where that costs less than a task (peer to local
        when ``read``, else local to peer); returns bytes, or None (nothing copied) when
        :meth:`read` / :meth:`write` must do it. Default: None.

        Raises:
            CopyCancelled: the token had tripped. OSError: the copy failed.
        """
        return None

    def read_word(self, addr: int) -> int | None:
        """The uint64 at the peer's ``addr`` read without the peer's help (its epoch page), or
        None when it cannot be. Default: None."""
        return None

    def table_fields(self) -> dict[str, Any]:
        """Fields this endpoint adds to its cache table when the peer on this access's link
        fetches it (NIXL: the agent's metadata, for NIXL links only). Default: none."""
        return {}


def peer_asks_for(peer: Identity, transport: str, log: Any) -> bool:
    """True if the peer asked for ``llm.Transport=<transport>`` too; else ``log`` says
    ``transport.fallback`` (the link moves bytes over its stream)."""
    if peer.transport == transport:
        return True
    log.info(
        "transport.fallback",
        peer_cluster_id=peer.cluster_id,
        reason=f"the peer does not use llm.Transport={transport} ({peer.transport!r})",
    )
    return False


class EngineAccess(PeerAccess):
    """A :class:`PeerAccess` through a transfer engine (NIXL, Mooncake): the peer's entry is
    fetched over the link when it is attached (:meth:`refresh`), and reads and writes are one
    :meth:`_move` each, between ranges the peer granted."""

    #: the engine as messages name it (``NIXL``)
    label: ClassVar[str] = ""

    def __init__(self, host: EndpointHost) -> None:
        super().__init__()
        self._host = host
        self.link: AccessLink | None = None
        #: the generation of the peer's registrations last fetched
        self.peer_gen = -1
        self._refresh_lock = anyio.Lock()
        self._primed: anyio.Event | None = None
        self.closed = False

    @property
    def _served(self) -> AccessLink:
        """The link this access serves. Raises OSError before :meth:`attach`."""
        if self.link is None:
            raise OSError(f"the link's {self.label} access is not attached to a link")
        return self.link

    def attach(self, link: AccessLink) -> None:
        """Bind to the link and fetch the peer's entry in the background (the first transfer
        then does not pay for it within its deadline)."""
        self.link = link
        self._primed = anyio.Event()
        self._host.spawn(self._prime)

    async def _prime(self) -> None:
        assert self._primed is not None
        try:
            await self.refresh(max(10.0, self._host.sync_kv_timeout_s))
            await self._connect()
        except Exception as exc:  # transfers fetch the entry again and report failures
            self._served.log.info(f"{self.name}.prime_failed", reason=str(exc) or repr(exc))
        finally:
            self._primed.set()

    async def _connect(self) -> None:
        """After the first fetch: what else the engine sets up ahead of the first transfer
        (NIXL: its connection to the peer's agent). Default: nothing."""
        return None

    async def ready(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the background fetch has finished."""
        if self._primed is not None:
            with anyio.move_on_after(timeout_s):
                await self._primed.wait()

    @abstractmethod
    async def refresh(self, timeout_s: float) -> None:
        """Fetch the peer's table over the link (at most ``timeout_s``, and as long again for
        the endpoint's build slot), make it the link's view, and take its entry.

        Raises:
            OSError: no answer, or an entry that is malformed or refused.
            LLMException: the link failed meanwhile, the peer's table is too big to be sent
                (it says so), or it waited ``timeout_s`` for a build slot (LLM_TIMEOUT).
        """

    @abstractmethod
    async def _move(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: np.ndarray,
        token: CancelToken,
    ) -> int:
        """Move ``nbytes`` between local and granted peer ranges (``op``: ``READ`` from the
        peer, ``WRITE`` to it); returns bytes.

        Raises:
            CopyCancelled: the token tripped (what the engine had in flight finished first).
            OSError: the engine failed, or the peer's entry does not cover the ranges.
        """

    async def read(
        self, remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """Engine READ of granted peer ranges into local ranges; returns bytes (raises as
        :meth:`_move`)."""
        return await self._move("READ", local, remote, nbytes, token)

    async def write(
        self, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, token: CancelToken
    ) -> int:
        """Engine WRITE of local ranges into granted peer ranges; returns bytes (raises as
        :meth:`_move`)."""
        return await self._move("WRITE", local, remote, nbytes, token)


class TransportEndpoint(ABC):
    """The endpoint-wide half of a transport (one per engine, e.g. NIXL's agent): made when the
    engine starts, closed after its registry (every cache deregistered)."""

    def register(self, entry: RegisteredCache) -> None:
        """A cache was registered or allocated. Default: nothing. Raises LLMException."""
        return None

    def deregister(self, entry: RegisteredCache) -> None:
        """A cache's memory goes (no request uses it). Default: nothing. Never raises."""
        return None

    def serves(self, caps: Any, ranges: np.ndarray, nbytes: np.ndarray) -> bool | None:
        """Whether the initiator that sent ``caps`` may copy these ranges of ours through this
        transport; None when its caps do not ask for this transport. Default: None."""
        return None

    @abstractmethod
    def new_access(self, peer: Identity, log: Any) -> PeerAccess | None:
        """The access for a new link to ``peer`` (its handshake identity), or None when the
        peer does not use this transport (logged as ``transport.fallback``: the link moves
        bytes over its stream)."""

    @abstractmethod
    def close(self) -> None:
        """Close every access it made and let go of the transport. Never raises."""


# ---------------------------------------------------------------------- the registry
@dataclasses.dataclass(frozen=True)
class Transport:
    """One value of ``llm.Transport``: what it lets this endpoint do."""

    #: open the same-host side channel, and reach proven peers on this host (or in this
    #: process) directly
    direct: bool
    #: refuse a peer on another host (instead of moving bytes over TCP)
    direct_only: bool = False
    #: bytes only ever move over the link's stream: a peer asking for this is not offered
    #: direct access
    stream_only: bool = False
    #: module (relative to this package) whose ``start_endpoint(host)`` makes the endpoint-wide
    #: half (:class:`TransportEndpoint`), imported only when this value is chosen
    module: str | None = None
    #: optional packages that provide it (any one of them), and how to install them
    packages: tuple[str, ...] = ()
    install_hint: str = ""


TRANSPORTS: dict[str, Transport] = {
    "auto": Transport(direct=True),
    "tcp": Transport(direct=False, stream_only=True),
    "same-host": Transport(direct=True, direct_only=True),
    "nixl": Transport(
        direct=False,
        module=".nixl",
        packages=("nixl", "nixl_cu12", "nixl_cu13"),
        install_hint=(
            "pip install --no-deps nixl-cu12  (NIXL with UCX bundled, about 68 MB, enough on "
            "CPU); 'pip install llmdd-async[nixl]' pulls NIXL's CUDA dependencies too"
        ),
    ),
    "mooncake": Transport(
        direct=False,
        module=".mooncake",
        packages=("mooncake",),
        install_hint=(
            "pip install mooncake-transfer-engine-non-cuda  (CPU build; it needs the system "
            "libraries libibverbs1, librdmacm1 and libnuma1), or mooncake-transfer-engine for "
            "CUDA; 'pip install llmdd-async[mooncake]' installs the CPU build"
        ),
    ),
}


def transport(name: object) -> Transport | None:
    """The entry of ``llm.Transport`` value ``name`` (a peer's claim may be anything), or
    None."""
    return TRANSPORTS.get(name) if isinstance(name, str) else None


def installed(name: str) -> bool:
    """True if transport ``name`` needs no optional package or one of its packages is installed
    (found, not imported: cheap, and no transport module is loaded)."""
    spec = TRANSPORTS.get(name)
    if spec is None or not spec.packages:
        return True
    for pkg in spec.packages:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(pkg) is not None:
                return True
    return False


def require_installed(name: str) -> None:
    """Raises:
    LLMException: LLM_PARAM_INVALID naming the install line when transport ``name``'s optional
        package is missing."""
    if not installed(name):
        raise LLMException(
            f"llm.Transport={name} needs {name.upper()}, which is not installed: "
            f"{TRANSPORTS[name].install_hint}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )


async def start_endpoint(name: str, host: EndpointHost) -> TransportEndpoint | None:
    """The endpoint-wide half of transport ``name`` (its module loaded now), or None when it
    has none.

    Raises:
        LLMException: LLM_PARAM_INVALID when its optional package is missing; what the
            transport's ``start_endpoint`` raises (LLM_FAILED when it cannot start).
    """
    spec = TRANSPORTS[name]
    if spec.module is None:
        return None
    require_installed(name)
    module = importlib.import_module(spec.module, __name__)
    endpoint: TransportEndpoint = await module.start_endpoint(host)
    return endpoint


def direct_access(
    pid: int,
    pidfd: int | None,
    proof: Proof,
    fds: Sequence[int],
    own_name: bool,
    copy: CopyRunner,
    log: Any,
) -> PeerAccess | None:
    """Direct access to the process the kernel named on the side channel (of our uid: the
    caller checked), from what it sent: in-process for this very process, same-host for
    another; None if there is nothing it lets us reach. ``fds``: the descriptors that came
    with ``proof``, one per pool (they stay the caller's: it closes them). ``own_name``: the
    peer answered on one of this process's own side channels (needed to believe it is this
    very process). Takes ``pidfd``."""
    if pid <= 0 or pid == os.getpid():
        if pidfd is not None:
            os.close(pidfd)
        if pid <= 0 or not own_name:
            return None
        from .in_process import InProcessAccess

        access: PeerAccess = InProcessAccess(copy)
    else:
        from .same_host import open_access

        found = open_access(pid, pidfd, proof, fds, copy, log)
        if found is None:
            return None
        access = found
    access.regions = proof.regions()
    return access
