"""The same-host path against hostile local processes (issue 19: 1, 2, 7).

Each attacker is a real child process: this very module run as ``python -m`` (a
:class:`Hostile` endpoint of the library, bent where an attacker would bend it), against a
real victim endpoint (this process, or a :class:`PeerProcess`). Only 127.0.0.1 and abstract
unix sockets are used.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import cluster, endpoint_options, library_logs_enabled

import llmdd_async as dd
from llmdd_async._childproc import ChildProcess
from llmdd_async._errors import ChildError
from llmdd_async.testing import PeerProcess, engine_of, wait_until
from llmdd_async.testing._peer_main import Peer

S = dd.LLMStatusCode
NOBODY = 65534
SIZE = 4096
#: This module's folder (the child imports it) and the tests' root (for ``helpers``).
HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
KEY = "issue-19-same-host"


# ============================================================================ the attacker
class Hostile(Peer):
    """A child endpoint with the attacker's extra commands."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[list[int]] = []  # [fd, base, size] claimed as extra pools
        self.buffers: list[Any] = []
        self.relays: list[dict[str, Any]] = []

    async def become(self, uid: int) -> int:
        """Drop to ``uid`` (every module the endpoint needs is imported first: the
        interpreter's files need not be readable by that user)."""
        import anyio._backends._asyncio
        import anyio._backends._trio  # noqa: F401
        import trio  # noqa: F401
        import uvloop  # noqa: F401

        import llmdd_async._devices._host
        import llmdd_async._transports.in_process
        import llmdd_async._transports.same_host
        import llmdd_async._transports.tcp  # noqa: F401

        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        return os.geteuid()

    async def start(self, role: int, cluster_id: int, options: dict[str, str]) -> Any:
        out = await super().start(role, cluster_id, options)
        assert self.dd is not None
        links = engine_of(self.dd).links
        real = links.side._proof

        def proof() -> dict[str, Any]:
            # The lie: our side channel lists files of our choosing as "pools".
            p = real()
            p["pools"] = list(p.get("pools", [])) + [list(o) for o in self.offered]
            return p

        links.side._proof = proof  # type: ignore[method-assign]
        return out

    async def bend(self) -> None:
        """Grant direct copies to whoever claims it can make them, and ignore any rule about
        who may be given our descriptors: the victim's own checks are what is tested."""
        from llmdd_async._net import peer_view, side_channel

        def trusted(self: Any, claimed: Any) -> dict[str, bool]:
            if not isinstance(claimed, dict):
                return {}
            return {k: True for k in ("pools", "pvr") if claimed.get(k) is True}

        peer_view.CapsPolicy.trusted = trusted  # type: ignore[method-assign]
        side_channel.same_user = lambda sock: True  # type: ignore[assignment]

    async def offer(self, kind: str, path: str = "") -> int:
        """Claim a descriptor as the pool behind a remote-accessible cache of ours (one tensor
        of ``SIZE`` bytes at the claimed base); returns the cache id.

        kind: ``opath`` / ``rdonly`` (of ``path``), ``memfd`` (unsealed), ``small`` (a sealed
        memfd shorter than claimed)."""
        assert self.dd is not None
        buf = np.zeros(SIZE, np.uint8)
        if kind == "opath":
            fd = os.open(path, os.O_PATH)
        elif kind == "rdonly":
            fd = os.open(path, os.O_RDONLY)
        else:
            fd = os.memfd_create(f"hostile-{kind}", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, SIZE if kind == "memfd" else SIZE // 2)
            if kind == "small":
                import fcntl

                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                os.write(fd, b"\x11" * (SIZE // 2))
            else:
                m = mmap.mmap(fd, SIZE)
                buf = np.frombuffer(m, np.uint8)
                buf[:] = 0x22
                self.buffers.append(m)
        self.buffers.append(buf)
        self.offered.append([fd, int(buf.ctypes.data), SIZE])
        desc = dd.CacheDesc(1, [1, SIZE], dd.DataType.DT_UINT8)
        cache = self.dd.cache_manager.register_cache(desc, [int(buf.ctypes.data)], [], True)
        self.caches[cache.cache_id] = cache
        return cache.cache_id

    async def truncate(self) -> list[str]:
        """ftruncate every memfd we published (our pools, our epoch, memfds we offered) to 0."""
        assert self.dd is not None
        fds = [p.fd for p in engine_of(self.dd).pools.values() if hasattr(p, "fd")]
        fds += [o[0] for o in self.offered]
        out = []
        for fd in fds:
            try:
                os.ftruncate(fd, 0)
                out.append("truncated")
            except OSError as exc:
                out.append(errno.errorcode.get(exc.errno or 0, str(exc)))
        return out

    async def memfds(self) -> list[str]:
        """What our descriptors point to (to see what a victim handed us)."""
        out = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sorted(t for t in out if t.startswith("/memfd:"))

    # ------------------------------------------------------------------ a relay
    async def relay(self, ip: str, port: int) -> list[Any]:
        """Forward TCP connections to ``ip:port``; on each link request seen, also try the
        side-channel proof toward the client ourselves, with the nonces and TCP binding we
        see (the server's LINK_ACK is held back until that attempt is over)."""
        lsock = socket.socket()
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(8)
        lsock.setblocking(False)

        async def accept() -> None:
            while True:
                await anyio.wait_readable(lsock)
                conn, _ = lsock.accept()
                conn.setblocking(False)
                self.tg.start_soon(self._relay_one, conn, ip, port)

        self.tg.start_soon(accept)
        return list(lsock.getsockname()[:2])

    async def _relay_one(self, client: socket.socket, ip: str, port: int) -> None:
        from llmdd_async._net.handshake import connect_socket
        from llmdd_async._protocol import MT, NEED_DATA, Decoder, Message

        server = await connect_socket(ip, port)
        record: dict[str, Any] = {}
        self.relays.append(record)
        proved = anyio.Event()
        seen: dict[str, Any] = {}

        async def pump(src: socket.socket, dst: socket.socket) -> None:
            dec: Decoder | None = Decoder(1 << 20)
            while True:
                await anyio.wait_readable(src)
                try:
                    data = src.recv(1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                hold = False
                if dec is not None:
                    dec.receive_data(data)
                    while (ev := dec.next_event()) is not NEED_DATA:
                        if not isinstance(ev, Message):
                            continue
                        if ev.type == MT.HELLO:
                            seen["nonce_c"] = ev.fields.get("nonce")
                        elif ev.type == MT.CHALLENGE:
                            seen["nonce_s"] = ev.fields.get("nonce")
                        elif ev.type == MT.LINK_REQ:
                            seen["uds"] = ev.fields.get("uds")
                            await self._prove_to_client(client, seen, record)
                            proved.set()
                            dec = None
                            break
                        elif ev.type == MT.LINK_ACK:
                            hold = True
                            dec = None
                            break
                if hold:
                    with anyio.move_on_after(5):
                        await proved.wait()
                view = memoryview(data)
                while view:
                    try:
                        view = view[dst.send(view) :]
                    except BlockingIOError:
                        await anyio.wait_writable(dst)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump, client, server)
                tg.start_soon(pump, server, client)
        except OSError:
            pass
        finally:
            client.close()
            server.close()

    async def _prove_to_client(
        self, client: socket.socket, seen: dict[str, Any], record: dict[str, Any]
    ) -> None:
        """What a relay on this host can try: be the "server" on the client's side channel."""
        from llmdd_async._net.handshake import send_message
        from llmdd_async._net.local_peer import tcp_binding
        from llmdd_async._protocol import MT, Decoder, Message

        record["tried"] = True
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.setblocking(False)
        fds: list[int] = []
        try:
            u.connect("\0" + str(seen.get("uds")))
            fields = {
                "nonces": [seen.get("nonce_c"), seen.get("nonce_s")],
                "tcp": tcp_binding(client),  # the client's connection, as its other end sees it
                "mac": "00" * 32,
            }
            await send_message(u, Message(MT.PROVE, 0, fields))
            dec = Decoder(16 << 20)
            with anyio.fail_after(5):
                while True:
                    ev = dec.next_event()
                    if isinstance(ev, Message):
                        record["status"] = ev.fields.get("status")
                        record["fields"] = sorted(ev.fields)
                        break
                    await anyio.wait_readable(u)
                    data, anc, _, _ = u.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
                    for level, kind, raw in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            got = np.frombuffer(raw[: len(raw) - len(raw) % 4], np.int32)
                            fds.extend(int(f) for f in got)
                    if not data:
                        record["eof"] = True
                        break
                    dec.receive_data(data)
            if record.get("status") == 0:  # it believed us: finish as a server would
                await send_message(u, Message(MT.PROVE_FIN, 0, {}))
                await anyio.sleep(0.2)
        except (OSError, EOFError, TimeoutError) as exc:
            record["error"] = repr(exc)
        finally:
            record["fds"] = len(fds)
            for fd in fds:
                os.close(fd)
            u.close()

    async def relay_report(self) -> list[dict[str, Any]]:
        return self.relays

    async def stall_side_channels(self, pid: int, count: int) -> list[str]:
        """Open ``count`` connections to each side channel of process ``pid``, send most of a
        16 MiB PROVE frame's header (its meta claimed huge) and stall; return what each
        connection saw within 3 s: ``eof`` (closed on us) or ``open``."""
        from llmdd_async._protocol import HEADER, MAGIC, MT, PROTOCOL_VERSION

        names = []
        for line in (await anyio.Path("/proc/net/unix").read_text()).splitlines()[1:]:
            path = line.split()[-1]
            if path.startswith(f"@llmdd-async/{pid}/"):
                names.append(path[1:])
        socks = []
        for name in names:
            for _ in range(count):
                u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                u.connect("\0" + name)
                u.setblocking(False)
                # a PROVE header claiming 15 MiB of meta, and 64 KiB of it
                head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MT.PROVE), 0, 15 << 20, 0, 0)
                with contextlib.suppress(OSError):
                    u.send(head + b"\0" * (64 << 10))
                socks.append(u)
        out = []
        with anyio.move_on_after(3):
            for u in socks:
                while True:
                    await anyio.wait_readable(u)
                    try:
                        if u.recv(1 << 16) == b"":
                            out.append("eof")
                            break
                    except ConnectionError:
                        out.append("eof")
                        break
                    except BlockingIOError:
                        continue
        out += ["open"] * (len(socks) - len(out))
        for u in socks:
            u.close()
        return out


@pytest.fixture
def loop(anyio_backend: Any) -> str:
    """The children's event loop: the test's own (asyncio, uvloop or trio)."""
    name, options = anyio_backend
    return "uvloop" if options.get("use_uvloop") else str(name)


@contextlib.asynccontextmanager
async def hostile(loop: str, uid: int | None = None) -> AsyncIterator[ChildProcess]:
    """A :class:`Hostile` child on ``loop`` (as ``uid`` if given)."""
    path = os.pathsep.join([HERE, TESTS, os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path}
    async with ChildProcess.spawn("test_security_same_host", loop, env=env) as c:
        if uid is not None:
            assert await c.request("become", uid=uid) == uid
        yield c


def _need_root() -> None:
    if os.geteuid() != 0 and os.environ.get("CI") != "true":
        pytest.skip("needs root (a victim that runs as root, an attacker that drops to 65534)")


@pytest.fixture
def root_files() -> Iterator[tuple[str, str, bytes]]:
    """A root-only 0600 secret and a 0644 root file, in a directory anyone may traverse."""
    d = tempfile.mkdtemp(prefix="llmdd-deputy-")
    os.chmod(d, 0o755)
    secret_path, public_path = os.path.join(d, "secret"), os.path.join(d, "public")
    secret = np.random.default_rng(19).integers(1, 256, SIZE, dtype=np.uint8).tobytes()
    for p, data, mode in ((secret_path, secret, 0o600), (public_path, b"A" * SIZE, 0o644)):
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
    try:
        yield secret_path, public_path, secret
    finally:
        for p in (secret_path, public_path):
            with contextlib.suppress(OSError):
                os.unlink(p)
        os.rmdir(d)


def _mapped(*needles: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if any(n in line for n in needles)]


def _fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def _u8(cache: dd.Cache) -> bytes:
    return bytes(np.asarray(cache.tensors[0]).reshape(-1).view(np.uint8))


# ============================================================================ 1: no deputy
@pytest.mark.parametrize("victim_listens", [True, False], ids=["victim-listens", "victim-links"])
async def test_an_unprivileged_peer_cannot_make_a_root_victim_map_its_files(
    root_files: tuple[str, str, bytes],
    victim_listens: bool,
    caplog: pytest.LogCaptureFixture,
    loop: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A uid-65534 process lists O_PATH descriptors of a 0600 and a 0644 root file as its
    pools. The root victim must never map them: the secret never comes back from a pull, the
    public file is never overwritten by a push, and it never hands its own pools over."""
    _need_root()
    library_logs_enabled(monkeypatch)
    caplog.set_level(logging.INFO, logger="llmdd_async")
    secret_path, public_path, secret = root_files
    opts = endpoint_options(listen=True, ra=True)
    async with hostile(loop, NOBODY) as a:
        await a.request("bend")
        addr = await a.request("start", role=int(dd.LLMRole.PROMPT), cluster_id=1, options=opts)
        read_id = await a.request("offer", kind="opath", path=secret_path)
        write_id = await a.request("offer", kind="opath", path=public_path)
        own_before = await a.request("memfds")
        vopts = endpoint_options(listen=victim_listens, ra=True)
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(vopts) as d:
            if victim_listens:
                ip, port = d.listen_address
                code, _ = await a.request("link", cluster_id=2, ip=ip, port=port)
                assert code == 0
                await d.wait_for_link(1, 5000)
            else:
                code, _ = await d.link_clusters([cluster(1, tuple(addr))], 5000)
                assert code == S.LLM_SUCCESS
            assert not _mapped(secret_path, public_path), "the victim mapped a root file"
            assert d.link_statistics(1).transport == "tcp"
            why = [r.getMessage() for r in caplog.records if "transport.fallback" in r.getMessage()]
            assert any(f"uid {NOBODY}" in m for m in why), why  # the log says why
            cm = d.cache_manager
            mine = cm.allocate_cache(dd.CacheDesc(1, [1, SIZE], dd.DataType.DT_UINT8))
            with contextlib.suppress(dd.LLMException):
                await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, read_id, 0), mine)
            assert _u8(mine) != secret, "the 0600 root file was read over the link"
            mine.tensors[0][...] = ord("Z")
            with contextlib.suppress(dd.LLMException):
                await cm.push_cache(dd.CacheKeyByIdAndIndex(1, write_id, 0), mine)
            public = anyio.Path(public_path)
            assert await public.read_bytes() == b"A" * SIZE, "the 0644 root file was overwritten"
            # Nothing of the victim's memory reached the attacker as a descriptor either.
            assert await a.request("memfds") == own_before


async def test_a_same_user_peer_gets_only_sealed_memfds_mapped(
    root_files: tuple[str, str, bytes], loop: str
) -> None:
    """A peer of our own uid may offer what it likes: a plain file (O_PATH, O_RDONLY), an
    unsealed memfd, a sealed memfd shorter than it says. None of it is mapped, every
    descriptor received and not kept is closed, and its real (sealed) pools still are."""
    secret_path, _, secret = root_files
    opts = endpoint_options(listen=True, ra=True)
    async with hostile(loop) as a:
        await a.request("bend")
        addr = await a.request("start", role=int(dd.LLMRole.PROMPT), cluster_id=1, options=opts)
        kinds = ("opath", "rdonly", "memfd", "small")
        ids = {k: await a.request("offer", kind=k, path=secret_path) for k in kinds}
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options(ra=True)) as d:
            fds_before = len(os.listdir("/proc/self/fd"))
            maps_before = len(_mapped("/memfd:llmdd-"))
            code, _ = await d.link_clusters([cluster(1, tuple(addr))], 5000)
            assert code == S.LLM_SUCCESS
            assert d.link_statistics(1).transport == "same-host"
            assert not _mapped(secret_path, "hostile-"), "an unsealed or foreign file was mapped"
            # The peer's own pools and epoch page (sealed memfds) are mapped; no fd is kept.
            assert len(_mapped("/memfd:llmdd-")) > maps_before
            leaked = [t for t in _fd_targets() if t.startswith("/memfd:") or secret_path in t]
            mine = {f"/memfd:llmdd-{n} (deleted)" for n in ("host", "device", "epoch")}
            assert set(leaked) <= mine, leaked
            cm = d.cache_manager
            dst = cm.allocate_cache(dd.CacheDesc(1, [1, SIZE], dd.DataType.DT_UINT8))
            with contextlib.suppress(dd.LLMException):
                await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, ids["opath"], 0), dst)
            assert _u8(dst) != secret
            # The unsealed memfd's bytes may still come (over process_vm_readv: the peer's
            # own memory), just never through a mapping the peer could shrink.
            await cm.pull_cache(dd.CacheKeyByIdAndIndex(1, ids["memfd"], 0), dst)
            assert _u8(dst) == b"\x22" * SIZE
            code, _ = await d.unlink_clusters([cluster(1)], 3000)
            assert code == S.LLM_SUCCESS
            with anyio.fail_after(5):
                while (
                    len(os.listdir("/proc/self/fd")) > fds_before
                    or len(_mapped("/memfd:llmdd-")) > maps_before
                ):
                    await anyio.sleep(0.02)


# ============================================================================ 2: no SIGBUS
@pytest.mark.parametrize("what", ["pool", "unsealed"])
async def test_a_peer_truncating_its_pool_cannot_kill_the_victim(what: str, loop: str) -> None:
    """The victim (a child process) maps a same-uid peer's pool and pulls from it; the peer
    then truncates the memfd behind it. Our own pools are sealed (the truncation fails with
    EPERM); an unsealed memfd was never mapped. The victim survives, serves its other links,
    and its transfers with that peer work or fail with a status code."""
    opts = endpoint_options(listen=True, ra=True)
    async with hostile(loop) as a:
        await a.request("bend")
        addr = await a.request("start", role=int(dd.LLMRole.PROMPT), cluster_id=1, options=opts)
        if what == "pool":
            target = await a.request("alloc", kind="cache", num_tensors=1, shape=[1, SIZE], seed=5)
        else:
            target = await a.request("offer", kind="memfd")
        async with PeerProcess.start(dd.LLMRole.DECODER, 2, opts, loop) as v:
            mine = await v.request("alloc", kind="cache", num_tensors=1, shape=[1, SIZE])
            linked = await v.request("link", cluster_id=1, ip=addr[0], port=addr[1])
            assert linked == [0, [0]]
            key = {"key": ["CacheKeyByIdAndIndex", 1, target, 0]}
            assert await v.call("pull_cache", key, {"cache": mine}) == 0
            results = await a.request("truncate")
            if what == "pool":
                assert "truncated" not in results, results  # sealed against shrinking
                assert set(results) == {"EPERM"}
            try:
                status = await v.call("pull_cache", key, {"cache": mine})
            except ChildError:
                await v.process.wait()
                pytest.fail(f"the victim died (returncode {v.process.returncode})")
            assert isinstance(status, int)
            assert v.process.returncode is None
            if what == "pool":
                assert status == 0
            # The victim still serves its other links.
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 3).running(
                endpoint_options(ra=True)
            ) as d:
                code, _ = await d.link_clusters([cluster(2, v.listen)], 5000)
                assert code == S.LLM_SUCCESS
                dst = d.cache_manager.allocate_cache(
                    dd.CacheDesc(1, [1, SIZE], dd.DataType.DT_UINT8)
                )
                await d.cache_manager.pull_cache(dd.CacheKeyByIdAndIndex(2, mine, 0), dst)
            assert v.process.returncode is None


# ============================================================================ 7: keyed proof
async def test_a_relay_between_keyed_endpoints_cannot_win_the_side_channel_proof(
    loop: str,
) -> None:
    """A same-host process relays a keyed link and, seeing the nonces and its TCP connection
    to the client, tries the side-channel proof toward the client itself. Without the key it
    cannot complete it: the client sends it no pools, no probe, no descriptor."""
    sopts = endpoint_options(listen=True, **{"llm.AuthKey": KEY})
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, sopts, loop) as p, hostile(loop) as r:
        ip, port = await r.request("relay", ip=p.listen[0], port=p.listen[1])
        copts = endpoint_options(**{"llm.AuthKey": KEY})
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(copts) as d:
            code, _ = await d.link_clusters([cluster(1, (ip, port))], 5000)
            assert code == S.LLM_SUCCESS  # the relay only forwards: the handshake holds
            report = await r.request("relay_report")
            assert report and report[0].get("tried"), report
            got = report[0]
            assert got.get("status") != 0, got
            assert not {"pools", "probe", "caches"} & set(got.get("fields", [])), got
            assert got["fds"] == 0, got
            assert d.link_statistics(1).transport == "tcp"


async def test_another_users_process_is_not_read_on_the_side_channel(loop: str) -> None:
    """A process of another uid that connects to our side channel is closed on at once,
    before any of its bytes are read: it can neither make us buffer its frames nor fill the
    exchanges in progress (legit same-user links keep their same-host path)."""
    _need_root()
    async with (
        dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(endpoint_options(listen=True, ra=True)) as d,
        hostile(loop, NOBODY) as a,
    ):
        seen = await a.request("stall_side_channels", pid=os.getpid(), count=8)
        assert seen and set(seen) == {"eof"}, seen
        popts = endpoint_options(listen=True, ra=True)
        async with PeerProcess.start(dd.LLMRole.DECODER, 2, popts, loop) as p:
            assert p.listen is not None
            # We link, so the peer proves itself on our side channel, where they stall.
            code, _ = await d.link_clusters([cluster(2, p.listen)], 5000)
            assert code == S.LLM_SUCCESS
            assert d.link_statistics(2).transport == "same-host"


# ============================================================================ fds not kept
async def test_descriptors_of_failed_links_are_closed(loop: str) -> None:
    """Links that fail after the side-channel exchange (the endpoint there is another
    cluster) leave no descriptor and no mapping behind."""
    popts = endpoint_options(listen=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, popts, loop) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(endpoint_options()) as d:
            fds = len(os.listdir("/proc/self/fd"))
            maps = len(_mapped("/memfd:"))
            for _ in range(3):
                code, _ = await d.link_clusters([cluster(9, p.listen)], 3000)
                assert code == S.LLM_LINK_FAILED
            await wait_until(
                lambda: len(os.listdir("/proc/self/fd")) <= fds and len(_mapped("/memfd:")) <= maps,
                5,
                0.02,
            )


def test_our_pools_and_epoch_page_are_sealed_against_shrinking() -> None:
    import fcntl

    from llmdd_async._memory import EpochPage, MemoryPool, PoolConfig

    pool = MemoryPool(PoolConfig(1 << 20, 16), "test")
    epoch = EpochPage()
    try:
        for fd in (pool.fd, epoch.fd):
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            assert stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        pool.close()
        epoch.close()


@pytest.mark.parametrize(
    ("refusal", "named"),
    [(errno.ENOPROTOOPT, True), (errno.EINVAL, False), (errno.ESRCH, False)],
    ids=["kernel-before-6.5", "exited-on-6.5-to-6.15", "other"],
)
def test_a_peer_pidfd_the_kernel_refuses_names_no_process(refusal: int, named: bool) -> None:
    """Only a kernel that does not know SO_PEERPIDFD leaves the pid to be opened by number.
    Kernels 6.5 to 6.15 refuse the pidfd of a process that has exited (its listening socket
    handed on): its pid, maybe another process's by now, was then opened by number."""
    from llmdd_async._net import local_peer

    a, b = socket.socketpair(socket.AF_UNIX)

    class Refusing:
        def getsockopt(self, level: int, option: int, size: int) -> bytes:
            if option == local_peer._SO_PEERPIDFD:
                raise OSError(refusal, os.strerror(refusal))
            return a.getsockopt(level, option, size)

    with a, b:
        pid, pidfd = local_peer.peer_process(Refusing())  # type: ignore[arg-type]
    assert pidfd is None
    assert pid == (os.getpid() if named else 0)


pytestmark = pytest.mark.anyio


if __name__ == "__main__":
    from llmdd_async._childproc import run_server

    run_server(Hostile())
