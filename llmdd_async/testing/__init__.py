"""Test kit: real peer endpoints in child processes, for testing code that uses llmdd_async.

::

    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, options) as prompt:
        cache_id = await prompt.request("alloc", kind="blocks", num_tensors=2,
                                        shape=[8, 64], blocks_key=[1, 0], seed=7)
        ip, port = prompt.listen
        ...  # link to it, pull from it; compare with pattern(7 + tensor, nbytes)

The child fills tensor ``i`` of a cache allocated with ``seed=s`` with ``pattern(s + i, n)``,
so tests can compute the expected bytes without moving them through the test harness.

:func:`linked_pair` runs two linked endpoints in this process. The pytest plugin (entry point
``llmdd_async``, in ``_pytest_plugin``) offers both as fixtures: ``llmdd_peer``, ``llmdd_pair``.
:class:`LoopLagProbe` measures how long the event loop was held away from a sleeping task.
:func:`wait_until` waits for a condition with a deadline; :func:`free_ports` finds unused ports.
:func:`link_of`, :func:`links_of` and the other accessors of ``_inspect`` show an endpoint's
links, caches and options to tests without reaching into its internals.
:class:`NetnsBed` (root only) runs hosts in network namespaces joined by a bridge, each with
an address of its own, to run peers as if on separate machines (:meth:`NetnsHost.peer`);
:func:`netns_unavailable` says why it cannot run here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import numpy as np

import llmdd_async as dd
from llmdd_async._childproc import ChildProcess
from llmdd_async._errors import ChildError

from ._forkserver import fork_server
from ._inspect import (
    LinkView,
    cache_entries,
    cache_entry,
    engine_of,
    has_link,
    link_of,
    links_of,
    options_of,
    pool_of,
    populated,
    side_channel_name,
    wait_link_down,
    wait_link_listed,
)
from ._loop_lag import LoopLagProbe
from ._netns import NetnsBed, NetnsHost, netns_unavailable
from ._pair import DEFAULT_OPTIONS, linked_pair
from ._wait import wait_until

__all__ = [
    "DEFAULT_OPTIONS",
    "LinkView",
    "LoopLagProbe",
    "PairFactory",
    "NetnsBed",
    "NetnsHost",
    "PeerError",
    "PeerFactory",
    "PeerProcess",
    "cache_entries",
    "cache_entry",
    "decode_key",
    "encode_key",
    "engine_of",
    "free_port",
    "free_ports",
    "has_link",
    "link_of",
    "linked_pair",
    "links_of",
    "netns_unavailable",
    "options_of",
    "pattern",
    "pool_of",
    "populated",
    "side_channel_name",
    "wait_link_down",
    "wait_link_listed",
    "wait_until",
]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago (all are held
    open together while chosen, so they differ).

    Raises:
        OSError: no port could be bound.
    """
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Raises:
        OSError: no port could be bound.
    """
    return free_ports(1)[0]


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for seed ``seed`` (what a peer writes into filled tensors)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def encode_key(key: Any) -> list[Any] | None:
    """A key as JSON: ``["CacheKey", cluster, req, model, prefix]`` and so on."""
    if key is None:
        return None
    if isinstance(key, dd.CacheKey):
        return ["CacheKey", key.cluster_id, key.req_id, key.model_id, key.prefix_id]
    if isinstance(key, dd.CacheKeyByIdAndIndex):
        return ["CacheKeyByIdAndIndex", key.cluster_id, key.cache_id, key.batch_index]
    if isinstance(key, dd.BlocksCacheKey):
        return ["BlocksCacheKey", key.cluster_id, key.model_id]
    raise TypeError(f"cannot encode {key!r}")


def decode_key(data: Any) -> Any:
    if data is None:
        return None
    kind, *args = data
    return getattr(dd, kind)(*args)


PeerError = ChildError


#: the next Mooncake port pair of this process's peer processes (their handshake and data
#: ports, from 20000 up, a random start): Mooncake keeps a connection to a gone peer's data
#: port, which a later peer on that port would be read through (docs/how-to/mooncake.md), so
#: no two peers of one test session share a port
_MOONCAKE_PORTS = itertools.count(secrets.randbelow(5000))


def _mooncake_env(options: Mapping[str, str]) -> dict[str, str]:
    """The port pair of a peer of ``llm.Transport=mooncake`` (none when the environment
    pins Mooncake's ports itself, or for another transport)."""
    if options.get("llm.Transport") != "mooncake" or "MC_MIN_PRC_PORT" in os.environ:
        return {}
    low = 20000 + 2 * (next(_MOONCAKE_PORTS) % 5000)
    return {"MC_MIN_PRC_PORT": str(low), "MC_MAX_PRC_PORT": str(low + 1)}


class PeerProcess(ChildProcess):
    """A child process running one endpoint, driven by JSON commands."""

    listen: tuple[str, int] | None = None
    cluster_id: int = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        role: dd.LLMRole,
        cluster_id: int,
        options: dict[str, str],
        loop: str = "asyncio",
        *,
        prefix: Sequence[str] = (),
        fork: bool = True,
    ) -> AsyncIterator[PeerProcess]:
        """Start the child (its event loop: ``asyncio``, ``uvloop`` or ``trio``), initialise
        its endpoint, and stop it on exit. ``prefix``: a command line the child runs under,
        which execs it in place (:attr:`NetnsHost.prefix`: in a host of a :class:`NetnsBed`).
        ``fork``: fork the child from this process's fork server, which has imported what a
        peer imports, where a fresh interpreter would behave the same (``_forkserver``): it
        starts in milliseconds instead of half a second; False: always a fresh interpreter.

        Raises:
            PeerError: the endpoint failed to start.
        """
        env = _mooncake_env(options)
        launch = fork_server().spawn if fork else None
        async with cls.spawn(
            "llmdd_async.testing._peer_main", loop, env=env, prefix=prefix, launch=launch
        ) as peer:
            listen = await peer.request(
                "start", role=int(role), cluster_id=cluster_id, options=options
            )
            peer.listen = None if listen is None else (listen[0], listen[1])
            peer.cluster_id = cluster_id
            yield peer

    def cluster_info(self, local_ip: str = "127.0.0.1") -> dd.LLMClusterInfo:
        """What ``link_clusters`` takes to link an endpoint (at ``local_ip``) to this peer.

        Raises:
            PeerError: the peer does not listen (started without ``llm.listenIpInfo``).
        """
        if self.listen is None:
            raise PeerError("the peer does not listen: start it with llm.listenIpInfo")
        info = dd.LLMClusterInfo()
        info.remote_cluster_id = self.cluster_id
        info.append_local_ip_info(local_ip, 0)
        info.append_remote_ip_info(*self.listen)
        return info

    async def call(self, method: str, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        """Call a CacheManager method in the child. Pass caches as ``{"cache": id}``, keys
        through :func:`encode_key` as ``{"key": ...}`` and ranges as ``{"range": [a, b]}``.
        Transfers are awaited there; their status code comes back (0 on success)."""
        return await self.request("call", method=method, args=list(args), kwargs=kwargs, wait=wait)


#: the type of the ``llmdd_peer`` fixture: ``llmdd_peer(role, cluster_id, options=None,
#: loop="asyncio")`` is an async context manager of a :class:`PeerProcess`
PeerFactory = Callable[..., AbstractAsyncContextManager[PeerProcess]]
#: the type of the ``llmdd_pair`` fixture: ``llmdd_pair(options=None, **kwargs)`` is an async
#: context manager of ``(prompt, decoder)``
PairFactory = Callable[..., AbstractAsyncContextManager[tuple[dd.LLMDataDist, dd.LLMDataDist]]]
