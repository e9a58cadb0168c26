"""Hostile clients against the vLLM connector's side channel and data endpoint (issue 19.3).

Every attacker is a real client over sockets on 127.0.0.1: raw framed JSON on the side channel
(written here, as an attacker would, on anyio) and a real llmdd_async endpoint on the data
plane. The code under test runs as in vLLM: a :class:`WorkerEngine` (or a bare
:class:`ControlServer`) on its own asyncio loop in a thread. That control code is asyncio-only
by design (asyncio streams on the connector's private loop inside vLLM's process): it runs on
asyncio, or on uvloop in the uvloop case; the attackers run on asyncio, uvloop and trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import REPO

import llmdd_async as dd

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from llmdd_async.testing import wait_until  # noqa: E402
from llmdd_async.vllm import ConnectorConfig  # noqa: E402
from llmdd_async.vllm._control import HANDSHAKE_S, ControlClient, ControlServer  # noqa: E402
from llmdd_async.vllm._meta import LlmddMetadata  # noqa: E402
from llmdd_async.vllm._worker import WorkerEngine  # noqa: E402

KEY = "the-deployment-key"
LAYERS, BLOCKS, HEADS, BLOCK_SIZE, LAST = 2, 8, 1, 32, 16
BLOCK_ELEMS = HEADS * BLOCK_SIZE * LAST
VICTIM = "cmpl-victim-0-0123abcd"  # vLLM's internal id: external id + random suffix
VICTIM_BASE = "cmpl-victim-0"
VICTIM_BLOCKS = [1, 2, 3]

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _private_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test has its own per-user host key directory (and never reads the real one)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("LLMDD_AUTH_KEY", raising=False)
    (tmp_path / "home").mkdir()


# ------------------------------------------------------------------------- the prefill


def _kv(fill: bool) -> dict[str, Any]:
    out = {}
    for i in range(LAYERS):
        t = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, LAST)
        if fill:  # the victim's prompt KV: every block distinct and non-zero
            t += torch.arange(1, BLOCKS + 1).view(BLOCKS, 1, 1, 1) + 100 * (i + 1)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


class Prefill:
    """A prefill worker as vLLM runs it, holding one finished request's blocks."""

    def __init__(self, extra: dict[str, Any]) -> None:
        cfg, _ = ConnectorConfig.parse(
            {"lease_s": 30, "transfer_timeout_s": 5, **extra}, env=dict(os.environ)
        )
        self.engine = WorkerEngine(cfg, "prefill", 0, 1)
        self.kv = _kv(fill=True)
        self.engine.register(self.kv, BLOCK_SIZE)
        self.before = {k: v.clone() for k, v in self.kv.items()}
        self.cap = secrets.token_urlsafe(32)
        meta = LlmddMetadata(send={VICTIM: (30.0, list(VICTIM_BLOCKS))})
        meta.caps = {VICTIM: self.cap}  # a field since the fix (ignored before it)
        self.engine.on_step(meta)
        self.sync()

    @property
    def port(self) -> int:
        return self.engine.side_channel_port

    @property
    def data(self) -> tuple[str, int]:
        async def get() -> tuple[str, int] | None:
            assert self.engine.endpoint is not None
            return self.engine.endpoint.dd.listen_address

        addr = self.engine.loop.submit(get()).result(10)
        assert addr is not None
        return addr

    def sync(self) -> None:
        """Wait until the worker's loop has handled everything handed to it so far."""

        async def nop() -> None:
            await asyncio.sleep(0)

        self.engine.loop.submit(nop()).result(10)

    def freed(self) -> set[str]:
        self.sync()
        return self.engine.get_finished(set())[0]

    def untouched(self) -> bool:
        return all(torch.equal(self.kv[k], self.before[k]) for k in self.kv)

    def close(self) -> None:
        self.engine.shutdown()


@contextlib.contextmanager
def prefill(**extra: Any) -> Iterator[Prefill]:
    p = Prefill(extra)
    try:
        yield p
    finally:
        p.close()


# ------------------------------------------------------------------------- the attacker


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class RawControl:
    """The side-channel protocol from the outside: framing and the (optional) HMAC handshake."""

    def __init__(self, stream: Any, key: str | None) -> None:
        self.s = stream
        self.key = key.encode() if key else None
        self.session: bytes | None = None
        self.out_seq = self.in_seq = 0
        self.buf = b""

    @classmethod
    async def open(cls, port: int, key: str | None = None) -> RawControl:
        return cls(await anyio.connect_tcp("127.0.0.1", port), key)

    async def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.s.receive()
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def send_raw(self, body: bytes) -> None:
        await self.s.send(struct.pack(">I", len(body)) + body)

    async def send(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        if self.session is not None:
            body += _mac(self.session, b"c", struct.pack(">Q", self.out_seq), body)
            self.out_seq += 1
        await self.send_raw(body)

    async def recv(self) -> dict[str, Any]:
        (n,) = struct.unpack(">I", await self._read(4))
        body = await self._read(n)
        if self.session is not None:
            body = body[:-32]
            self.in_seq += 1
        out: dict[str, Any] = json.loads(body)
        return out

    async def handshake(self) -> dict[str, Any]:
        """hello -> auth -> welcome; the welcome (or whatever the server said instead)."""
        hello = await self.recv()
        sn = bytes.fromhex(hello["nonce"])
        cn = os.urandom(16)
        auth: dict[str, Any] = {"op": "auth", "nonce": cn.hex()}
        if self.key is not None:
            auth["mac"] = _mac(self.key, b"C", sn, cn).hex()
        await self.send(auth)
        welcome = await self.recv()
        if self.key is not None:
            self.session = _mac(self.key, b"K", sn, cn)
        return welcome

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.s.aclose()


async def closed_by_server(c: RawControl, within: float = 5.0) -> bool:
    """True once the server closed this connection (EOF) within ``within`` seconds."""
    with anyio.move_on_after(within):
        try:
            while True:
                await c.recv()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError, OSError):
            return True
        except ValueError:
            return False
    return False


@contextlib.asynccontextmanager
async def data_endpoint(key: str | None) -> AsyncIterator[tuple[dd.LLMDataDist, Any, int]]:
    """The attacker's own llmdd_async endpoint with a cache shaped like the victim's."""
    cid = secrets.randbits(60) + 1
    opts = {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.listenIpInfo": "127.0.0.1:0",
        "llm.SyncKvCacheWaitTime": "3000",
    }
    if key is not None:
        opts["llm.AuthKey"] = key
    async with dd.LLMDataDist(dd.LLMRole.MIX, cid).running(opts) as ep:
        mem = [np.zeros((BLOCKS, BLOCK_ELEMS), np.float32) for _ in range(LAYERS)]
        desc = dd.CacheDesc(LAYERS, [BLOCKS, BLOCK_ELEMS], dd.DataType.DT_FLOAT)
        cache = ep.cache_manager.register_blocks_cache(
            desc, [m.ctypes.data for m in mem], dd.BlocksCacheKey(cid, 0), remote_accessible=True
        )
        yield ep, (cache, mem), cid


async def link(ep: dd.LLMDataDist, host: str, port: int, cid: int) -> dd.LLMStatusCode:
    info = dd.LLMClusterInfo()
    info.remote_cluster_id = cid
    info.append_local_ip_info(host, 0)
    info.append_remote_ip_info(host, port)
    code, _ = await ep.link_clusters([info], timeout=3000)
    return code


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------- no key, no KV


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
async def test_a_client_without_a_key_reads_and_writes_nothing(mode: str) -> None:
    """Default config (no auth_key): a keyless client learns nothing on the side channel and
    cannot link to the data endpoint, even knowing its address and the victim's block ids."""
    with prefill(mode=mode) as p:
        c = await RawControl.open(p.port)
        try:
            with anyio.fail_after(5):
                with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    welcome = await c.handshake()
                    assert "meta" not in welcome, f"a keyless client got the welcome: {welcome}"
        finally:
            await c.aclose()
        host, port = p.data  # an attacker who found the port anyway
        async with data_endpoint(None) as (ep, (cache, mem), _):
            code = await link(ep, host, port, p.engine.cluster_id)
            src = dd.BlocksCacheKey(p.engine.cluster_id, 0)
            pulled = pushed = False
            if code == dd.LLMStatusCode.LLM_SUCCESS:
                with contextlib.suppress(dd.LLMException):
                    await ep.cache_manager.pull_blocks(
                        src, cache, VICTIM_BLOCKS, [0, 1, 2], tensor_num_per_layer=1
                    )
                    pulled = bool(mem[0].any())
                mem[0][:] = -1.0
                mem[1][:] = -1.0
                with contextlib.suppress(dd.LLMException):
                    await ep.cache_manager.push_blocks(
                        src, cache, [0, 1, 2], VICTIM_BLOCKS, tensor_num_per_layer=1
                    )
                    pushed = True
            assert not pulled, "a keyless client pulled the victim's KV"
            assert not pushed and p.untouched(), "a keyless client wrote into the prefill's KV"
            assert code != dd.LLMStatusCode.LLM_SUCCESS, "a keyless client linked to the data port"


# ------------------------------------------------------- knowing a request id gives nothing


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
async def test_a_forged_ids_message_gets_nothing_pushed(mode: str) -> None:
    """An insider (it holds the deployment key) that knows the victim's request id sends the
    prefill its own block ids for it: nothing is pushed; the capability holder gets the KV."""
    with prefill(mode=mode, auth_key=KEY) as p:
        async with data_endpoint(KEY) as (ep, (_, mem), cid):
            host, port = p.data
            assert await link(ep, host, port, p.engine.cluster_id) == dd.LLMStatusCode.LLM_SUCCESS
            c = await RawControl.open(p.port, KEY)
            try:
                welcome = await c.handshake()
                assert "meta" in welcome
                layout = welcome["meta"]["layout"]
                for req in (VICTIM_BASE, VICTIM):
                    await c.send(
                        {
                            "op": "ids",
                            "req": req,
                            "cap": secrets.token_urlsafe(32),  # a guess
                            "cluster": cid,
                            "blocks": [0, 1, 2],
                            "skip": 0,
                            "layout": layout,
                        }
                    )
                got: list[dict[str, Any]] = []
                with anyio.move_on_after(2.0):
                    while True:
                        msg = await c.recv()
                        got.append(msg)
                assert not any(m.get("ok") for m in got), f"pushed to the attacker: {got}"
                assert not mem[0].any() and not mem[1].any(), "victim KV landed in the attacker"
                if mode == "layerwise":  # the decode that holds the capability gets it
                    await c.send(
                        {
                            "op": "ids",
                            "req": VICTIM_BASE,
                            "cap": p.cap,
                            "cluster": cid,
                            "blocks": [4, 5, 6],
                            "skip": 0,
                            "layout": layout,
                        }
                    )
                    with anyio.fail_after(10):
                        msg = await c.recv()
                    assert msg["op"] == "pushed" and msg["ok"] is True, msg
                    want = p.kv["model.layers.0.self_attn.attn"][VICTIM_BLOCKS].reshape(3, -1)
                    assert np.array_equal(mem[0][4:7], want.numpy())
            finally:
                await c.aclose()


async def test_a_forged_done_frees_nothing() -> None:
    """``done`` naming the victim's request (with a wrong or no capability) frees nothing; the
    capability's holder frees it."""
    with prefill(auth_key=KEY) as p:
        c = await RawControl.open(p.port, KEY)
        try:
            await c.handshake()
            for msg in (
                {"op": "done", "req": VICTIM},
                {"op": "done", "req": VICTIM_BASE},
                {"op": "done", "req": VICTIM_BASE, "cap": secrets.token_urlsafe(32)},
                {"op": "cancel", "req": VICTIM_BASE, "cap": secrets.token_urlsafe(32)},
            ):
                await c.send(msg)
            with anyio.fail_after(5):
                assert (await c.recv())["op"] == "pushed"  # the cancel's answer: all handled
            assert VICTIM not in p.freed(), "a forged done freed the victim's blocks"
            await c.send({"op": "done", "req": VICTIM_BASE, "cap": p.cap})
            await wait_until(lambda: VICTIM in p.freed(), 5, 0.01)
        finally:
            await c.aclose()


# ------------------------------------------------------------ silent connections, no lockout


class ServerThread:
    """A bare ControlServer on its own loop in a thread (as the connector runs it): asyncio,
    or uvloop in the uvloop case."""

    def __init__(self, key: str | None, uvloop: bool) -> None:
        if uvloop:
            import uvloop as uv

            self.loop: asyncio.AbstractEventLoop = uv.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.errors.append(ctx))
        self.got: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def handler(peer: Any, msg: dict[str, Any]) -> None:
            self.got.append(msg)
            with contextlib.suppress(AttributeError):  # absent before the fix
                if msg.get("cap") == "proof":
                    peer.proved()
            await peer.send({"op": "pushed", "req": msg.get("req"), "ok": True})

        self.server = ControlServer(key, lambda: {"cluster_id": 7}, handler, timeout_s=10)
        self.run(self.server.start("127.0.0.1", 0))
        self.port = self.server.port

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def legit(self, key: str | None) -> float:
        """A decode's connect + one round trip, on the server's side of the client: seconds."""

        async def go() -> float:
            t0 = time.monotonic()
            c = ControlClient(key)
            try:
                await c.connect("127.0.0.1", self.port, 5)
                await c.send({"op": "ids", "req": "legit", "cap": "proof", "blocks": []})
                assert (await asyncio.wait_for(c.recv(), 5))["req"] == "legit"
            finally:
                c.close()
            return time.monotonic() - t0

        fut = asyncio.run_coroutine_threadsafe(go(), self.loop)
        return float(await anyio.to_thread.run_sync(fut.result, 30))

    def close(self) -> None:
        self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()  # (an unclosed uvloop loop is never freed)


@pytest.fixture
def server_loop(anyio_backend: Any) -> bool:
    """uvloop under the server when the attackers run on uvloop."""
    return bool(anyio_backend[1].get("use_uvloop"))


def _silent(n: int, port: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        out.append(s)
    return out


@pytest.mark.parametrize("key", [None, KEY], ids=["keyless", "keyed"])
@pytest.mark.parametrize("silent", [256, 500])
async def test_silent_connections_never_lock_out_a_decode(
    key: str | None, silent: int, server_loop: bool
) -> None:
    """Hundreds of connections that stay open and say nothing (or, keyless, complete the
    handshake and then say nothing): a legit decode still gets in and is served well before a
    silent connection's handshake deadline."""
    srv = ServerThread(key, server_loop)
    socks: list[socket.socket] = []
    talkers: list[RawControl] = []
    try:
        socks = _silent(silent, srv.port)
        if key is None:  # keyless: some complete the handshake, then stay silent
            for _ in range(16):
                c = await RawControl.open(srv.port)
                with anyio.fail_after(5):
                    await c.handshake()
                talkers.append(c)
        seconds = await srv.legit(key)
        # Locked out, it would wait for a silent connection's handshake deadline (HANDSHAKE_S);
        # the margin keeps a busy machine from counting as a lockout.
        assert seconds < 0.8 * HANDSHAKE_S, f"legit decode took {seconds:.2f} s"
        assert srv.errors == []
    finally:
        for s in socks:
            s.close()
        for c in talkers:
            await c.aclose()
        srv.close()


async def test_an_unauthenticated_connection_has_a_short_deadline(server_loop: bool) -> None:
    """A connection that does not finish the handshake is closed within ~2 s (not 10)."""
    srv = ServerThread(KEY, server_loop)
    try:
        c = await RawControl.open(srv.port, KEY)
        try:
            await c.recv()  # hello, then nothing
            t0 = time.monotonic()
            assert await closed_by_server(c, 6.0)
            assert time.monotonic() - t0 < 4.0
        finally:
            await c.aclose()
    finally:
        srv.close()


# ------------------------------------------------------------------- bounded pending ids


async def test_oversized_and_many_pending_ids_are_refused_memory_bounded() -> None:
    """An insider floods ``ids`` for requests the prefill does not know (yet): a message with
    more blocks than the cache holds is refused, and what is kept pending stays bounded."""
    with prefill(mode="layerwise", auth_key=KEY) as p:
        c = await RawControl.open(p.port, KEY)
        try:
            await c.handshake()
            big = list(range(200_000, 200_000 + 120_000))  # ~0.9 MB of JSON, all > 255
            await c.send({"op": "ids", "req": "x", "cap": "c" * 43, "cluster": 5, "blocks": big})
            with anyio.fail_after(5):
                first = await c.recv()
            assert first["op"] == "pushed" and first["ok"] is False, first
            base = rss()
            flood = 1100  # more than the prefill keeps pending
            for i in range(flood):
                await c.send(
                    {
                        "op": "ids",
                        "req": f"r{i}",
                        "cap": secrets.token_urlsafe(32),
                        "cluster": 5,
                        "blocks": [BLOCKS - 1] * 4,
                        "skip": 0,
                        "pad": "x" * 4000,  # never kept
                    }
                )
            for i in range(40):  # as large as a frame allows, each for another request
                await c.send(
                    {
                        "op": "ids",
                        "req": f"b{i}",
                        "cap": secrets.token_urlsafe(32),
                        "cluster": 5,
                        "blocks": big,
                    }
                )
            await c.send({"op": "cancel", "req": "sync", "cap": secrets.token_urlsafe(32)})
            evicted = refused = 0
            with anyio.fail_after(30):
                while (msg := await c.recv()).get("req") != "sync":
                    evicted += msg.get("why") == "evicted"
                    refused += msg.get("why") == "bad ids"
            p.sync()
            grown = rss() - base
            assert grown < 40 << 20, f"pending ids grew RSS by {grown >> 20} MiB"
            assert refused == 40  # more blocks than the prefill's cache holds
            assert p.engine.prefill is not None
            kept = len(p.engine.prefill.pending_ids)
            assert kept <= 1024 and evicted == flood - kept, (kept, evicted)
        finally:
            await c.aclose()


# ------------------------------------------------------------------- malformed frames


@pytest.mark.parametrize("key", [None, KEY], ids=["keyless", "keyed"])
async def test_deep_json_closes_only_that_connection(key: str | None, server_loop: bool) -> None:
    """A 200k-deep JSON frame (before or after the handshake) closes that connection quietly:
    no exception escapes to the loop, and the server keeps serving others."""
    srv = ServerThread(key, server_loop)
    try:
        deep = b"[" * 200_000 + b"]" * 200_000
        c = await RawControl.open(srv.port, key)
        try:
            await c.recv()
            await c.send_raw(deep)  # as the auth frame
            assert await closed_by_server(c)
        finally:
            await c.aclose()
        if key is None:  # after the handshake (a keyed peer's frames carry a MAC first)
            c = await RawControl.open(srv.port, key)
            try:
                await c.handshake()
                await c.send_raw(b'{"op":"ids","x":' + deep + b"}")
                assert await closed_by_server(c)
            finally:
                await c.aclose()
        assert await srv.legit(key) < 5
        await anyio.sleep(0.05)  # the loop reports unhandled errors after the close
        assert srv.errors == [], srv.errors
    finally:
        srv.close()


# ------------------------------------------------------------------- configuration


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "prefill.example"])
def test_keyless_non_loopback_side_channel_refused_at_start(host: str) -> None:
    with pytest.raises(ValueError, match=r"auth_key.*LLMDD_AUTH_KEY"):
        ConnectorConfig.parse({"side_channel_host": host}, env={})
    cfg, _ = ConnectorConfig.parse({"side_channel_host": host, "auth_key": "k"}, env={})
    assert cfg.side_channel_host == host
    for lo in ("127.0.0.1", "127.0.0.9", "localhost", "::1"):
        assert ConnectorConfig.parse({"side_channel_host": lo}, env={})[0].auth_key is None


def test_the_host_key_is_this_users_alone(tmp_path: Path) -> None:
    """Keyless engines of one user share a random key in a 0600 file; a file others could
    read (or write) is refused with a message naming auth_key."""
    import stat

    from llmdd_async.vllm._config import host_key

    env = {"HOME": str(tmp_path)}
    k1, path = host_key(env)
    assert host_key(env)[0] == k1 and len(k1) >= 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(RuntimeError, match="auth_key"):
        host_key(env)
    os.chmod(path, 0o600)
    os.chmod(path.parent, 0o755)
    with pytest.raises(RuntimeError, match="auth_key"):
        host_key(env)


# ------------------------------------------------------------------- the example proxy


def _proxy_module() -> Any:
    import importlib.util

    path = REPO / "examples" / "vllm_disagg" / "proxy.py"
    spec = importlib.util.spec_from_file_location("vllm_disagg_proxy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # aiohttp is asyncio-only
@pytest.mark.parametrize("flow", ["sequential", "concurrent"])
async def test_the_proxy_ignores_the_client_request_id(flow: str) -> None:
    """The client's X-Request-Id never reaches the engines as the matching id: the proxy makes
    its own per request (and, concurrent flow, one fresh capability for both legs)."""
    from aiohttp import ClientSession, web

    proxy_mod = _proxy_module()
    seen: list[tuple[str, str, dict[str, Any]]] = []

    async def engine(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.host, request.headers.get("X-Request-Id", ""), body))
        params = None
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            params = {"do_remote_prefill": True, "llmdd_capability": secrets.token_urlsafe(32)}
        return web.json_response({"choices": [], "kv_transfer_params": params})

    runners = []
    urls = []
    for _ in range(2):
        app = web.Application()
        app.router.add_post("/v1/completions", engine)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
    args = proxy_mod.parse_args(
        ["--prefill", urls[0], "--decode", urls[1], "--flow", flow, "--port", "0"]
    )
    proxy = proxy_mod.Proxy(args)
    app = web.Application()
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    runners.append(runner)
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with ClientSession() as s:
            for _ in range(2):
                async with s.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "m", "prompt": "hi", "max_tokens": 2},
                    headers={"X-Request-Id": "victim"},
                ) as r:
                    assert r.status == 200
        assert len(seen) == 4
        ids = [h for _, h, _ in seen]
        assert all("victim" not in i for i in ids), ids
        assert ids[0] == ids[1] != ids[2] == ids[3]  # one fresh id per request, both legs
        bodies = [json.dumps(b) for _, _, b in seen]
        assert all("victim" not in b for b in bodies), bodies
        if flow == "concurrent":
            for a, b in ((0, 1), (2, 3)):
                caps = {
                    (seen[i][2].get("kv_transfer_params") or {}).get("llmdd_capability")
                    for i in (a, b)
                }
                assert len(caps) == 1 and None not in caps and len(str(caps.pop())) >= 22
    finally:
        for runner in runners:
            await runner.cleanup()
