"""A multi-host test bed on Linux network namespaces (root only).

::

    async with NetnsBed.create(2, rate="1gbit") as bed:
        a, b = bed.hosts
        async with (
            a.peer(dd.LLMRole.PROMPT, 1) as prompt,
            b.peer(dd.LLMRole.DECODER, 2) as decoder,
        ):
            ip, port = prompt.listen  # a.address: 10.213.0.1
            await decoder.request("link", cluster_id=1, ip=ip, port=port)

Each host is a network namespace with loopback up and one veth interface (``eth0``,
``10.213.0.<i + 1>/24`` and ``fd00:10:213::<i + 1>/64``) whose other end is a port of one
bridge. The bridge has a namespace of its own, so nothing of the bed is ever in the caller's
namespace and two beds never see each other. Two processes on two hosts share a kernel but
no network: what a transport sees between them is what a second machine would show (no
loopback, no abstract unix socket, no same-host proof).

``rate`` shapes every link in both directions with a token bucket (``tc ... tbf``: the
kernel may have no ``netem``). Leaving the block, normally, by an exception or by
cancellation, kills every process still in the bed's namespaces and deletes the veths and the
namespaces. :func:`netns_unavailable` says why the bed cannot run here (not root, no
``ip netns``), or None.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from llmdd_async._enums import LLMRole

    from . import PeerProcess

__all__ = ["NetnsBed", "NetnsHost", "netns_unavailable"]

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
ENV = shutil.which("env") or "/usr/bin/env"
NFT = shutil.which("nft") or "/usr/sbin/nft"
#: the nftables table a host's packet drops live in (in that host's namespace only)
_FAULT_TABLE = "llmdd_fault"

#: the hosts' subnet (RFC 1918); host ``i`` is ``.i + 1``, inside the bed's namespaces only
SUBNET = "10.213.0"
PREFIX_LEN = 24
#: the hosts' IPv6 subnet (a unique local one, RFC 4193); host ``i`` is ``::i + 1``
SUBNET6 = "fd00:10:213::"
PREFIX_LEN6 = 64
MAX_HOSTS = 250
#: the host side of each host's veth (in the host's namespace, so every host has its own)
DEVICE = "eth0"
BRIDGE = "br0"
#: how long removing a bed may take before it gives up (and says what it left behind)
_REMOVE_S = 20.0
#: how long processes killed in a namespace may take to be gone
_KILL_S = 5.0

_beds = itertools.count()
_OURS = re.compile(r"^llmdd-(\d+)-\d+-(?:br|\d+)$")


def _tbf(rate: str) -> list[str]:
    return ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]


async def _run(*argv: str, check: bool = True) -> bytes:
    """Run ``argv`` to completion; its stdout.

    Raises:
        RuntimeError: it exited non-zero (with ``check``; its stderr in the message) or
            could not be started.
    """
    try:
        result = await anyio.run_process(list(argv), check=False)
    except OSError as exc:
        raise RuntimeError(f"{' '.join(argv)}: {exc}") from exc
    if check and result.returncode != 0:
        err = result.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"{' '.join(argv)}: exit status {result.returncode}: {err}")
    return bytes(result.stdout)


async def _list_netns() -> set[str]:
    """The names ``ip netns list`` shows (each line: a name, maybe ``(id: n)`` after it).

    Raises:
        RuntimeError: ``ip netns list`` failed.
    """
    out = await _run(IP, "netns", "list")
    return {line.split()[0] for line in out.decode().splitlines() if line.strip()}


async def _kill_all_in(netns: str) -> None:
    """SIGKILL every process in ``netns`` and wait until none is left (zombies hold no
    namespace: ``ip netns pids`` does not list them).

    Raises:
        RuntimeError: ``ip netns pids`` failed, or processes were still there after a while.
    """
    with anyio.move_on_after(_KILL_S):
        while True:
            pids = [int(p) for p in (await _run(IP, "netns", "pids", netns)).split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            await anyio.sleep(0.01)
    raise RuntimeError(f"processes still run in {netns} after SIGKILL")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _sweep_stale() -> None:
    """Remove namespaces of beds whose process is gone (one killed before it could clean up),
    so that their names cannot block a new bed. Never touches a live process's bed.

    Raises:
        RuntimeError: ``ip netns list`` failed.
    """
    for name in sorted(await _list_netns()):
        m = _OURS.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(RuntimeError):
            await _kill_all_in(name)
            await _run(IP, "netns", "del", name)


class NetnsHost:
    """One host of a :class:`NetnsBed`: a network namespace with an address on the bed's
    bridge."""

    def __init__(self, bed: NetnsBed, index: int) -> None:
        self.bed = bed
        self.index = index
        #: the namespace's name (``ip netns list``)
        self.netns = f"{bed.name}-{index}"
        #: this host's address on the bridge
        self.address = f"{SUBNET}.{index + 1}"
        #: and its IPv6 address there
        self.address6 = f"{SUBNET6}{index + 1:x}"
        #: the interface that holds :attr:`address` (in this host's namespace)
        self.device = DEVICE
        #: the bridge's port of this host's veth (in the bed's bridge namespace)
        self.port = f"h{index}"
        #: the rate every packet to and from this host is shaped to, or None
        self.rate: str | None = None

    def __repr__(self) -> str:
        return f"NetnsHost({self.netns!r}, {self.address!r})"

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command line that runs a program in this host (``ip netns exec NAME``); it
        execs the program in place, so the process it starts is the program itself."""
        return (IP, "netns", "exec", self.netns)

    async def run(self, *argv: str, check: bool = True) -> bytes:
        """Run ``argv`` in this host to completion; its stdout.

        Raises:
            RuntimeError: it exited non-zero (with ``check``) or could not be started.
        """
        return await _run(*self.prefix, *argv, check=check)

    def peer(
        self,
        role: LLMRole,
        cluster_id: int,
        options: Mapping[str, str] | None = None,
        loop: str = "asyncio",
        env: Mapping[str, str] | None = None,
    ) -> AbstractAsyncContextManager[PeerProcess]:
        """A :class:`~llmdd_async.testing.PeerProcess` in this host, as
        ``PeerProcess.start`` (entering raises ``PeerError`` if its endpoint fails to start).

        ``options`` are merged over :data:`~llmdd_async.testing.DEFAULT_OPTIONS` plus
        ``llm.listenIpInfo=<address>:0`` (its listen address: ``peer.listen``); ``loop``:
        the child's event loop (``asyncio``, ``uvloop`` or ``trio``); ``env``: variables set
        for the child over this process's environment (e.g. :meth:`ucx_env` for NIXL).
        """
        from . import DEFAULT_OPTIONS, PeerProcess

        opts = {
            "llm.listenIpInfo": f"{self.address}:0",
            **DEFAULT_OPTIONS,
            **(options or {}),
        }
        prefix = self.prefix
        if env:
            prefix = (*prefix, ENV, *(f"{k}={v}" for k, v in env.items()))
        return PeerProcess.start(role, cluster_id, opts, loop, prefix=prefix)

    def ucx_env(self) -> dict[str, str]:
        """The environment that keeps NIXL's UCX on this host's interface, over TCP (the bed
        has no RDMA device, and a second machine has no shared memory to take)."""
        return {"UCX_NET_DEVICES": self.device, "UCX_TLS": "tcp"}

    async def set_link(self, up: bool) -> None:
        """Take this host's interface down (administratively: the host knows, and its
        connects and sends fail at once) or bring it back up.

        Raises:
            RuntimeError: ``ip link set`` failed.
        """
        await _run(IP, "-n", self.netns, "link", "set", self.device, "up" if up else "down")

    async def set_cable(self, plugged: bool) -> None:
        """Unplug this host's cable (its bridge port goes down: the host's interface loses
        carrier and what it sends is dropped silently, so its peers see a partition and
        TCP retransmits) or plug it back in.

        Raises:
            RuntimeError: ``ip link set`` failed.
        """
        await _run(
            IP, "-n", self.bed.bridge_netns, "link", "set", self.port, "up" if plugged else "down"
        )

    async def set_partition(self, inbound: bool, outbound: bool = False) -> None:
        """Silently drop what reaches this host (``inbound``) and what it sends (``outbound``)
        on its interface, with nftables in its namespace: both, a partition; one, a one-way
        partition. Links stay up as far as either side can tell: no FIN, no RST, no carrier
        change. ``set_partition(False)`` heals it.

        Raises:
            RuntimeError: ``nft`` failed (see :func:`netns_unavailable` with ``drop=True``).
        """
        await self.run(NFT, "delete", "table", "inet", _FAULT_TABLE, check=False)
        if not (inbound or outbound):
            return
        await self.run(NFT, "add", "table", "inet", _FAULT_TABLE)
        for hook, wanted, match in (("input", inbound, "iifname"), ("output", outbound, "oifname")):
            if not wanted:
                continue
            spec = f"{{ type filter hook {hook} priority 0; policy accept; }}"
            await self.run(NFT, "add", "chain", "inet", _FAULT_TABLE, hook, spec)
            await self.run(
                NFT, "add", "rule", "inet", _FAULT_TABLE, hook, match, self.device, "drop"
            )

    async def reboot(self) -> None:
        """ "Reboot" this host: kill every process in it and make its namespace anew, with
        the same name, addresses, MAC address and rate, its cable plugged in. What its
        kernel held goes with the old one (TCP connections, ports in TIME-WAIT, nftables
        rules), as after a real reboot; its peers are told nothing (no FIN, no RST).

        Raises:
            RuntimeError: a process would not die, or remaking the namespace failed.
        """
        # Its interface keeps its MAC address, as a NIC does: its peers' ARP entries stay
        # right (a new one would leave them sending into the void until those expire).
        shown = (await _run(IP, "-n", self.netns, "-o", "link", "show", self.device)).decode()
        mac = shown.split("link/ether", 1)[1].split()[0]
        await _kill_all_in(self.netns)
        await _run(IP, "-n", self.bed.bridge_netns, "link", "del", self.port)
        await _run(IP, "netns", "del", self.netns)
        self.bed._made.remove(self.netns)  # (made again next: then the bed's once more)
        rate, self.rate = self.rate, None
        await self.bed._build_host(self, rate, mac)

    async def set_rate(self, rate: str | None) -> None:
        """Shape this host's link to ``rate`` (a ``tc`` rate: ``1gbit``, ``100mbit``) in both
        directions, or with None stop shaping it.

        Raises:
            RuntimeError: ``tc`` refused the rate or failed.
        """
        ends = ((self.netns, self.device), (self.bed.bridge_netns, self.port))
        for netns, dev in ends:
            if rate is not None:
                await _run(TC, "-n", netns, "qdisc", "replace", "dev", dev, *_tbf(rate))
            elif self.rate is not None:
                await _run(TC, "-n", netns, "qdisc", "del", "dev", dev, "root")
        self.rate = rate


class NetnsBed:
    """Hosts in network namespaces, joined by one bridge (see :meth:`create`)."""

    def __init__(self, n_hosts: int) -> None:
        #: the prefix of the bed's namespace names
        self.name = f"llmdd-{os.getpid()}-{next(_beds)}"
        #: the namespace that holds the bridge (no address, no processes)
        self.bridge_netns = f"{self.name}-br"
        self.hosts = tuple(NetnsHost(self, i) for i in range(n_hosts))
        #: the namespaces made so far, in order (what removal deletes)
        self._made: list[str] = []

    def __repr__(self) -> str:
        return f"NetnsBed({self.name!r}, hosts={len(self.hosts)})"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of the bed: the bridge's, then the hosts'."""
        return (self.bridge_netns, *(h.netns for h in self.hosts))

    @classmethod
    @contextlib.asynccontextmanager
    async def create(cls, n_hosts: int = 2, *, rate: str | None = None) -> AsyncIterator[NetnsBed]:
        """Build a bed of ``n_hosts`` hosts (each link shaped to ``rate`` when given, as
        :meth:`NetnsHost.set_rate`), yield it, and remove it on exit, also after an
        exception or a cancellation: processes still in its namespaces are killed, its veths
        and namespaces deleted.

        Raises:
            ValueError: ``n_hosts`` is not within 1..250.
            RuntimeError: building the bed failed (not root, no ``ip netns``, a ``tc`` rate it
                refused: the command and its stderr are in the message), or on a clean exit
                of the block, something of the bed could not be removed. (An exception of
                the block is never replaced by a removal problem.)
        """
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be within 1..{MAX_HOSTS}, got {n_hosts}")
        bed = cls(n_hosts)
        try:
            await bed._build(rate)
            yield bed
        except BaseException:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(RuntimeError):
                    await bed._remove()
            raise
        with anyio.CancelScope(shield=True):
            await bed._remove()

    async def _build(self, rate: str | None) -> None:
        await _sweep_stale()
        br = self.bridge_netns
        await self._add_netns(br)
        await _run(IP, "-n", br, "link", "add", BRIDGE, "type", "bridge")
        await _run(IP, "-n", br, "link", "set", BRIDGE, "up")
        for h in self.hosts:
            await self._build_host(h, rate)

    async def _build_host(self, h: NetnsHost, rate: str | None, mac: str | None = None) -> None:
        """Make ``h``'s namespace, its veth on the bridge (its end's MAC address ``mac`` when
        given) and its addresses."""
        br = self.bridge_netns
        await self._add_netns(h.netns)
        await _run(IP, "-n", h.netns, "link", "set", "lo", "up")
        # made inside the bridge's namespace with its peer sent straight to the host's,
        # so the veth never exists in (nor can clash with anything of) the caller's
        await _run(
            IP, "-n", br, "link", "add", h.port, "type", "veth",
            "peer", "name", h.device, *(("address", mac) if mac else ()), "netns", h.netns,
        )  # fmt: skip
        await _run(IP, "-n", br, "link", "set", h.port, "master", BRIDGE, "up")
        cidr = f"{h.address}/{PREFIX_LEN}"
        await _run(IP, "-n", h.netns, "addr", "add", cidr, "dev", h.device)
        # nodad: usable at once (duplicate detection would hold it for a second or two)
        cidr6 = f"{h.address6}/{PREFIX_LEN6}"
        await _run(IP, "-n", h.netns, "addr", "add", cidr6, "dev", h.device, "nodad")
        await _run(IP, "-n", h.netns, "link", "set", h.device, "up")
        if rate is not None:
            await h.set_rate(rate)

    async def _add_netns(self, name: str) -> None:
        await _run(IP, "netns", "add", name)
        self._made.append(name)

    async def _remove(self) -> None:
        """Kill what runs in the bed, delete its veths and namespaces.

        Raises:
            RuntimeError: something of the bed is left (each problem in the message).
        """
        problems: list[str] = []
        with anyio.move_on_after(_REMOVE_S) as scope:
            for name in reversed(self._made):
                try:
                    await _kill_all_in(name)
                except RuntimeError as exc:
                    problems.append(str(exc))
            if self.bridge_netns in self._made:
                # deleting one end deletes the pair; done here, not left to the namespaces'
                # (asynchronous) teardown, so the veths are gone when this returns
                for h in self.hosts:
                    with contextlib.suppress(RuntimeError):
                        await _run(IP, "-n", self.bridge_netns, "link", "del", h.port)
            for name in reversed(self._made):
                try:
                    await _run(IP, "netns", "del", name)
                except RuntimeError as exc:
                    problems.append(str(exc))
        if scope.cancelled_caught:
            problems.append(f"removal took more than {_REMOVE_S} s")
        left = set(self._made) & await _list_netns()
        self._made = [n for n in self._made if n in left]
        if left or problems:
            raise RuntimeError(
                f"bed {self.name} not removed completely (left: {sorted(left)}): "
                + "; ".join(problems)
            )


def _probe(argv: Sequence[str]) -> str | None:
    """None if ``argv`` succeeds, else why not."""
    try:
        r = subprocess.run(list(argv), capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(argv)}: {exc}"
    if r.returncode != 0:
        return f"{' '.join(argv)}: {r.stderr.decode(errors='replace').strip()}"
    return None


@functools.cache
def netns_unavailable(rate: bool = False, drop: bool = False) -> str | None:
    """Why a :class:`NetnsBed` cannot run here (not Linux, not root, no ``ip``, or making a
    namespace, a bridge or a veth failed; with ``rate``, also shaping with ``tc ... tbf``;
    with ``drop``, also dropping packets with ``nft``, :meth:`NetnsHost.set_partition`), or
    None when it can. Tries once per process (a namespace made and deleted again).

    Raises nothing: every failure is the reason returned.
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (the bed runs ip netns)"
    for tool in (IP, TC) if rate else (IP,):
        if not os.access(tool, os.X_OK):
            return f"{tool} not found (iproute2)"
    if drop and not os.access(NFT, os.X_OK):
        return f"{NFT} not found (Debian: apt-get install nftables)"
    name = f"llmdd-{os.getpid()}-probe"
    why = _probe([IP, "netns", "add", name])
    if why is not None:
        return why
    try:
        steps = [
            [IP, "-n", name, "link", "add", BRIDGE, "type", "bridge"],
            [IP, "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
        ]
        if rate:
            steps.append([TC, "-n", name, "qdisc", "add", "dev", "v0", *_tbf("1gbit")])
        if drop:
            steps.append([IP, "netns", "exec", name, NFT, "add", "table", "inet", _FAULT_TABLE])
        for step in steps:
            why = _probe(step)
            if why is not None:
                return why
    finally:
        _probe([IP, "netns", "del", name])
    return None
