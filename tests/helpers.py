"""Helpers shared by the tests (imported as a plain module)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
"""The repository's root (examples, benchmarks and docs the tests run)."""


def pool_json(size: int, page_shift: int = 16) -> str:
    return json.dumps({"memory_size": size, "page_shift": page_shift})


def cm_options(**extra: str) -> dict[str, str]:
    """Cache-manager mode options with a small device and host pool."""
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.MemPoolConfig": pool_json(64 << 20),
        "llm.HostMemPoolConfig": pool_json(16 << 20),
    }
    opts.update(extra)
    return opts


def nixl_params() -> list[Any]:
    """``nixl`` (UCX over loopback with ``cma,tcp,self``) and ``nixl-tcp`` (``UCX_TLS=tcp``):
    skipped with a reason where NIXL is not installed, except under ``CI=true``, where a
    missing NIXL must fail."""
    import os

    import pytest

    from llmdd_async._transports.nixl import INSTALL_HINT, available

    marks = []
    if not available() and os.environ.get("CI") != "true":
        marks = [pytest.mark.skip(reason=f"NIXL is not installed ({INSTALL_HINT})")]
    return [pytest.param(t, marks=marks, id=t) for t in ("nixl", "nixl-tcp")]


def mooncake_params() -> list[Any]:
    """``mooncake`` (Mooncake Transfer Engine, its TCP protocol): skipped with a reason where
    Mooncake is not installed, except under ``CI=true``, where a missing Mooncake must fail."""
    import os

    import pytest

    from llmdd_async._transports.mooncake import INSTALL_HINT, available

    marks = []
    if not available() and os.environ.get("CI") != "true":
        marks = [pytest.mark.skip(reason=f"Mooncake is not installed ({INSTALL_HINT})")]
    return [pytest.param("mooncake", marks=marks, id="mooncake")]


TRANSPORTS = ["tcp", "same-host", *nixl_params(), *mooncake_params()]


def use_transport(request: Any, monkeypatch: Any) -> str:
    """The ``llm.Transport`` of a ``TRANSPORTS`` parameter; ``nixl-tcp`` is NIXL with
    ``UCX_TLS=tcp`` (in this process and the peers it starts): there small requests complete
    through the poller thread's wake-up of the loop, which cma (done in the post) skips."""
    name = str(request.param)
    if name == "nixl-tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")
        return "nixl"
    return name


def endpoint_options(
    transport: str = "auto", *, listen: bool = False, ra: bool = False, **extra: str
) -> dict[str, str]:
    """Options of a test endpoint: cache-manager mode, pools, chosen transport."""
    opts = cm_options(**{"llm.Transport": transport})
    if listen:
        opts["llm.listenIpInfo"] = "127.0.0.1:0"
    if ra:
        opts["llm.EnableRemoteCacheAccessible"] = "1"
    opts.update(extra)
    return opts


def cluster(cluster_id: int, address: tuple[str, int] | None = None) -> Any:
    import llmdd_async as dd

    ci = dd.LLMClusterInfo()
    ci.remote_cluster_id = cluster_id
    ci.append_local_ip_info("127.0.0.1", 0)
    if address is not None:
        ci.append_remote_ip_info(address[0], address[1])
    return ci


async def link(local: Any, cluster_id: int, address: tuple[str, int], timeout: int = 3000) -> Any:
    """link_clusters to one peer; asserts success."""
    import llmdd_async as dd

    code, codes = await local.link_clusters([cluster(cluster_id, address)], timeout)
    assert code == dd.LLMStatusCode.LLM_SUCCESS, codes
    return codes


async def register_blocks_at(peer: Any, num_tensors: int, shape: Any, key: Any = None) -> Any:
    """Register a zeroed blocks cache of ``num_tensors`` x ``shape`` in a ``PeerProcess``
    under ``key`` (default ``BlocksCacheKey(2, 0)``); its cache id."""
    import llmdd_async as dd
    from llmdd_async.testing import encode_key

    key = dd.BlocksCacheKey(2, 0) if key is None else key
    return await peer.request(
        "register",
        kind="blocks",
        num_tensors=num_tensors,
        shape=list(shape),
        blocks_key=encode_key(key),
    )


def blocks_entry(
    addrs: Any,
    blocks: int,
    block_bytes: int,
    *,
    cache_id: int = 1,
    dtype: int = 0,
    remote_accessible: bool = True,
) -> Any:
    """A registry entry of a host blocks cache at ``addrs`` (one tensor each), for pure
    checks and planning without an engine."""
    import numpy as np

    import llmdd_async as dd
    from llmdd_async._registry import CacheEntry

    return CacheEntry(
        cache_id=cache_id,
        num_tensors=len(addrs),
        tensor_bytes=blocks * block_bytes,
        count=blocks,
        is_blocks=True,
        placement=dd.Placement.HOST,
        dtype=dtype,
        shape=(blocks, block_bytes),
        addrs=np.array(addrs, dtype=np.uint64),
        remote_accessible=remote_accessible,
        allocated=False,
    )  # fmt: skip


def blocks_request(
    op: str,
    req_id: int,
    cache_id: int,
    src: Any,
    dst: Any,
    tensors: int,
    block_bytes: int,
    blocks: int,
    **extra: Any,
) -> Any:
    """A hand-made XFER_REQ over the stream between blocks of the endpoint's cache
    ``cache_id`` and a made-up cache at 2**40 of ``tensors`` tensors of ``blocks`` blocks of
    ``block_bytes``: ``op`` "pull" moves its blocks ``src`` into ours ``dst``, "push" ours
    ``src`` into its ``dst``."""
    import numpy as np

    from llmdd_async._protocol import MT, Message

    tb = blocks * block_bytes
    fields = {
        "op": op,
        "target": {"by": "cache_id", "cache_id": cache_id, "index": 0},
        "shape": "blocks",
        "layout": [tb, blocks, True],
        "caps": {},
        "timeout_ms": 60_000,
        **extra,
    }
    local = (1 << 40) + np.arange(tensors, dtype=np.uint64) * np.uint64(tb)
    arrays: dict[str, bytes | memoryview] = {
        "local_addrs": np.ascontiguousarray(local, "<u8").data.cast("B"),
        "src_blocks": np.ascontiguousarray(src, "<u8").data.cast("B"),
        "dst_blocks": np.ascontiguousarray(dst, "<u8").data.cast("B"),
    }
    return Message(MT.XFER_REQ, req_id, fields, arrays)


def expected_tensor(seed: int, tensor: int, shape: tuple[int, ...]) -> Any:
    """What a test peer wrote into tensor ``tensor`` of a cache filled with ``seed``."""
    import math

    from llmdd_async.testing import pattern

    return pattern(seed + tensor, math.prod(shape)).reshape(shape)


class RawPeer:
    """A hostile peer speaking the wire protocol frame by frame over a real socket: the test
    decides what it sends and whether it ever reads."""

    def __init__(self, sock: Any) -> None:
        from llmdd_async._protocol import Decoder

        self.sock = sock
        self.decoder = Decoder()

    async def send(self, msg: Any) -> None:
        from llmdd_async._protocol import encode

        await self.send_bytes(encode(msg))

    async def send_bytes(self, data: bytes) -> None:
        import socket

        import anyio

        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view, socket.MSG_DONTWAIT)
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            view = view[n:]

    async def frame(self) -> Any:
        """The next frame; payload bytes (DATA) are read and dropped.

        Raises:
            EOFError / OSError: the endpoint closed the connection.
        """
        import socket

        import anyio

        from llmdd_async._protocol import NEED_DATA, Message

        buf = bytearray(1 << 16)
        while True:
            ev = self.decoder.next_event()
            if isinstance(ev, Message):
                return ev
            if ev is not NEED_DATA:  # buffered payload bytes: dropped
                continue
            try:
                n = self.sock.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            if not n:
                raise EOFError
            self.decoder.receive_data(memoryview(buf)[:n])

    async def recv(self, expect: Any) -> Any:
        """The next frame, which must be of type ``expect``."""
        msg = await self.frame()
        assert msg.type == expect, (msg.type, msg.fields)
        return msg

    async def closed_by_peer(self, timeout_s: float = 10) -> bool:
        """Read (and drop) frames until the endpoint hangs up; False if it did not in time."""
        import anyio

        with anyio.move_on_after(timeout_s):
            try:
                while True:
                    await self.frame()
            except (EOFError, OSError):
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def peer_identity(cluster_id: int, **fields: Any) -> dict[str, Any]:
    """What a hand-made peer says about itself in the handshake (a decoder, TCP only, no side
    channel: nothing about it can be proven), with ``fields`` overriding."""
    import llmdd_async as dd
    from llmdd_async._net.local_peer import host_identity

    return {
        "cluster_id": cluster_id,
        "role": int(dd.LLMRole.DECODER),
        "remote_accessible": False,
        "host": host_identity().fields(),
        "transport": "tcp",
        "uds": None,
        **fields,
    }


async def raw_link(
    address: tuple[str, int], cluster_id: int, rcvbuf: int = 0, **fields: Any
) -> RawPeer:
    """Connect and complete the (unkeyed) handshake as ``cluster_id``; asserts it is accepted."""
    import contextlib
    import os
    import socket

    import anyio

    from llmdd_async._net.handshake import new_nonce
    from llmdd_async._protocol import MT, PROTOCOL_VERSION, Message

    s = socket.socket()
    if rcvbuf:  # a small window: a peer that never reads stalls the sender sooner
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        s.connect(address)
    await anyio.wait_writable(s)
    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        s.close()
        raise OSError(err, os.strerror(err))
    peer = RawPeer(s)
    try:
        await peer.send(Message(MT.HELLO, 0, {"version": PROTOCOL_VERSION, "nonce": new_nonce()}))
        await peer.recv(MT.CHALLENGE)
        await peer.send(Message(MT.LINK_REQ, 0, peer_identity(cluster_id, **fields)))
        ack = await peer.recv(MT.LINK_ACK)
        assert ack.fields["status"] == 0, ack.fields
    except BaseException:
        s.close()
        raise
    return peer


def server_identity(cluster_id: int, **fields: Any) -> dict[str, Any]:
    """What a hand-made prompt endpoint (the server of a link) says about itself."""
    import llmdd_async as dd

    return peer_identity(cluster_id, role=int(dd.LLMRole.PROMPT), **fields)


@contextlib.asynccontextmanager
async def hostile_server(
    cluster_id: int, serve: Callable[[RawPeer, dict[str, Any]], Any]
) -> AsyncIterator[tuple[str, int]]:
    """A listener that answers one handshake as ``cluster_id`` (identity from ``serve``'s
    first call), then hands the connection to ``serve`` (``serve.after(peer)``, if set, then
    runs until the test ends or the endpoint hangs up)."""
    import socket

    import anyio

    from llmdd_async._net.handshake import new_nonce
    from llmdd_async._protocol import MT, Message

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    lsock.setblocking(False)

    async def run() -> None:
        await anyio.wait_readable(lsock)
        conn, _ = lsock.accept()
        conn.setblocking(False)
        h = RawPeer(conn)
        hello = await h.recv(MT.HELLO)
        await h.send(Message(MT.CHALLENGE, 0, {"nonce": new_nonce(), "auth": False}))
        req = await h.recv(MT.LINK_REQ)
        ident = serve(h, req.fields)
        assert hello.fields["version"]
        await h.send(Message(MT.LINK_ACK, 0, {"status": 0, **ident}))
        # The endpoint hanging up on us is what these attacks should get.
        with contextlib.suppress(EOFError, OSError):
            await serve.after(h)  # type: ignore[attr-defined]
        conn.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            yield lsock.getsockname()[:2]
        finally:
            tg.cancel_scope.cancel()
            lsock.close()


async def run_spec(engine: Any, lnk: Any, spec: Any) -> Any:
    """Run one hand-made request (a ``TransferRequest``) on ``lnk`` as a task: what a hostile
    initiator would send.

    Raises:
        LLMException: whatever the request fails with.
    """
    from llmdd_async._net.initiator import initiate
    from llmdd_async._task import CacheTask

    async def body(ctl: Any) -> None:
        await initiate(engine, lnk, spec, ctl.token, ctl.deadline)

    return await engine.start_task(CacheTask("hostile"), body, 5)


@contextlib.contextmanager
def blocking_peer(role: Any, cluster_id: int, options: dict[str, str]) -> Iterator[tuple[Any, Any]]:
    """A ``PeerProcess`` driven from a synchronous test through a portal thread: yields
    ``(peer, portal)``; call the peer's coroutines with ``portal.call``.

    Raises:
        PeerError: the endpoint failed to start.
    """
    import anyio.from_thread

    from llmdd_async.testing import PeerProcess

    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(PeerProcess.start(role, cluster_id, options)) as p,
    ):
        yield p, portal


def library_logs_enabled(monkeypatch: Any) -> None:
    """Let the library's engine events reach pytest's ``caplog`` for this test.

    Something earlier in a full run (a ``logging.config.dictConfig`` with its default
    ``disable_existing_loggers``) can leave our existing loggers disabled; tests about what
    the library logs are not about that. Every ``llmdd_async`` logger that exists is
    enabled, propagates, and takes the package's level."""
    import logging

    manager = logging.root.manager
    names = [n for n in list(manager.loggerDict) if n.split(".")[0] == "llmdd_async"]
    for name in {"llmdd_async", *names}:
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "disabled", False)
        monkeypatch.setattr(logger, "propagate", True)
        if name != "llmdd_async":  # (caplog.at_level sets the package's level)
            monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(manager, "disable", logging.NOTSET)
    manager._clear_cache()


def cyclic_garbage() -> list[Any]:
    """What the garbage collector finds in reference cycles now (unreachable objects only it
    frees), taken out of ``gc.garbage``: a test then counts what is its own."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    garbage, gc.garbage[:] = list(gc.garbage), []
    return garbage


def watch_floor_ends(monkeypatch: Any, module: Any) -> tuple[list[set[int]], list[str]]:
    """Watch a latency floor that ``module`` measures (its ``subprocess.Popen`` and
    ``time.perf_counter``, read on this thread around each request): the CPUs this thread may
    run on at each read, and those of the server it started, once it answered (it pinned
    itself before)."""
    ours: list[set[int]] = []
    theirs: list[str] = []
    children: list[Any] = []
    real_popen = subprocess.Popen

    def popen(args: list[str], *a: Any, **k: Any) -> Any:
        children.append(real_popen(args, *a, **k))
        return children[-1]

    def clock() -> float:
        ours.append(os.sched_getaffinity(0))
        if not theirs and len(ours) > 4:
            status = Path(f"/proc/{children[0].pid}/status").read_text()
            theirs.append(status.split("Cpus_allowed_list:")[1].split()[0])
        return time.perf_counter()

    monkeypatch.setattr(module.subprocess, "Popen", popen)
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock))
    return ours, theirs


def check_floor_ends(ours: list[set[int]], theirs: list[str], allowed: set[int]) -> None:
    """What :func:`watch_floor_ends` saw, this thread allowed ``allowed`` before the floor: on
    two CPUs or more, this thread on one of them throughout and the server on another; on
    one, nothing pinned (both where this thread may run). This thread's CPUs as they were
    after, either way."""
    if len(allowed) < 2:
        (cpu,) = allowed
        assert ours and all(s == allowed for s in ours)
        assert theirs == [str(cpu)]
    else:
        (mine,) = {frozenset(s) for s in ours}
        assert len(mine) == 1 and mine <= allowed
        assert theirs and theirs[0].isdigit()
        assert int(theirs[0]) in allowed and {int(theirs[0])} != set(mine)
    assert os.sched_getaffinity(0) == allowed
