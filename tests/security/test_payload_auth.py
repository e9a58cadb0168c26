"""``llm.PayloadAuth``: a MAC over every DATA frame's payload on keyed links.

A real on-path relay (threads forwarding a TCP connection on 127.0.0.1 between two keyed
endpoints, parsing frames) flips every payload byte of DATA frames. Without the option (the
documented default) the transfers succeed with the relay's bytes; with it, pulls, pushes and
layer-wise transfers fail with LLM_LINK_FAILED ("payload failed authentication") and the link
breaks. An honest relay with the option moves every byte exactly.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import cluster, endpoint_options, link

import llmdd_async as dd
from llmdd_async._protocol import HEADER, MT, PAYLOAD_TAG
from llmdd_async.testing import LinkView, has_link, link_of, wait_until

S = dd.LLMStatusCode
KEY = "payload-auth-test-key"
BLOCK = 64 << 10
BLOCKS = 48  # 3 MiB of blocks: one block (fast path), 4 (inline), 32 (worker)


class Relay:
    """An on-path relay: accepts on 127.0.0.1, connects each connection to ``target`` and
    forwards both directions, parsing frames; with ``flip`` every payload byte of a DATA
    frame is inverted (headers and meta pass unchanged, so frame tags still verify)."""

    def __init__(self, target: tuple[str, int], flip: bool, rate: float = 0) -> None:
        self.target = target
        self.flip = flip
        self.rate = rate  # bytes/s in each direction, 0: as fast as it goes
        self.flipped = 0  # payload bytes changed so far
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                down, _ = self.listener.accept()
                up = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        hdr = bytearray()
        state, left, mtype, payload = "hdr", 0, 0, 0
        try:
            while True:
                data = src.recv(64 << 10 if self.rate else 1 << 20)
                if not data:
                    break
                if self.rate:
                    time.sleep(len(data) / self.rate)
                out = np.frombuffer(bytearray(data), np.uint8)
                i = 0
                while i < len(out):
                    if state == "hdr":
                        take = min(HEADER.size - len(hdr), len(out) - i)
                        hdr += out[i : i + take].tobytes()
                        i += take
                        if len(hdr) == HEADER.size:
                            _, _, mtype, _, meta_len, _, payload_len = HEADER.unpack(hdr)
                            hdr.clear()
                            state, left, payload = "meta", meta_len, payload_len
                    else:
                        take = min(left, len(out) - i)
                        if state == "payload" and self.flip and mtype == MT.DATA:
                            out[i : i + take] ^= 0xFF
                            self.flipped += take
                        i += take
                        left -= take
                    if state == "meta" and left == 0:
                        state, left = "payload", payload
                    if state == "payload" and left == 0:
                        state = "hdr"
                dst.sendall(out.tobytes())
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept() (close won't)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


def _options(payload_auth: str | None, listen: bool = False) -> dict[str, str]:
    # A deadline that a slowed relay cannot run past (a frame cut short still goes out whole).
    extra = {"llm.AuthKey": KEY, "llm.SyncKvCacheWaitTime": "20000"}
    opts = endpoint_options("tcp", listen=listen, ra=True, **extra)
    if payload_auth is not None:
        opts["llm.PayloadAuth"] = payload_auth
    return opts


@contextlib.asynccontextmanager
async def relayed(
    payload_auth: str | None, flip: bool, rate: float = 0, **decoder: str
) -> AsyncIterator[tuple[dd.LLMDataDist, dd.LLMDataDist, Relay]]:
    """A prompt (cluster 1) and a decoder (cluster 2) linked through a relay."""
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        _options(payload_auth, listen=True)
    ) as p:
        assert p.listen_address is not None
        relay = Relay(p.listen_address, flip, rate)
        try:
            dopts = {**_options(payload_auth), **decoder}
            async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(dopts) as d:
                await link(d, 1, relay.address)
                yield p, d, relay
        finally:
            relay.close()


def _caches(p: dd.LLMDataDist, d: dd.LLMDataDist) -> tuple[np.ndarray, np.ndarray, Any]:
    """The prompt's blocks (random, key (1, 0)) and the decoder's (zeros, key (2, 0))."""
    desc = dd.CacheDesc(1, [BLOCKS, BLOCK], dd.DataType.DT_UINT8)
    src = np.random.default_rng(5).integers(0, 255, (BLOCKS, BLOCK), dtype=np.uint8)
    p.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
    dst = np.zeros((BLOCKS, BLOCK), np.uint8)
    dcache = d.cache_manager.register_blocks_cache(desc, [dst], dd.BlocksCacheKey(2, 0))
    return src, dst, dcache


async def _wait_down(*links: LinkView) -> None:
    await wait_until(lambda: not any(lnk.alive for lnk in links), 10, 0.01)


def _auth_failure(err: pytest.ExceptionInfo[dd.LLMException]) -> None:
    assert err.value.status_code == S.LLM_LINK_FAILED, err.value
    assert "payload failed authentication" in str(err.value), err.value


# ---------------------------------------------------------------------------- the default
@pytest.mark.anyio
async def test_without_payload_auth_a_relay_changes_payload_bytes_undetected() -> None:
    """The documented default (keyed link, no llm.PayloadAuth): frames are authenticated,
    payload bytes are not. This is what the option exists for."""
    async with relayed(None, flip=True) as (p, d, relay):
        src, dst, dcache = _caches(p, d)
        blocks = list(range(32))  # 2 MiB, streamed from a worker thread
        await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dcache, blocks, blocks)
        assert np.array_equal(dst[:32], src[:32] ^ 0xFF)  # every byte changed, unnoticed
        pushed = np.random.default_rng(6).integers(0, 255, (4, BLOCK), dtype=np.uint8)
        dst[:4] = pushed
        await d.cache_manager.push_blocks(
            dd.BlocksCacheKey(1, 0), dcache, [0, 1, 2, 3], [40, 41, 42, 43]
        )
        assert np.array_equal(src[40:44], pushed ^ 0xFF)
        assert relay.flipped >= 36 * BLOCK
        assert link_of(d, 1).alive


# ---------------------------------------------------------------------------- detected
@pytest.mark.anyio
@pytest.mark.parametrize("nblocks", [1, 32], ids=["fast-path", "streamed"])
async def test_payload_auth_refuses_pulled_bytes_a_relay_changed(nblocks: int) -> None:
    async with relayed("1", flip=True) as (p, d, relay):
        _, _, dcache = _caches(p, d)
        blocks = list(range(nblocks))
        with pytest.raises(dd.LLMException) as err:
            await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dcache, blocks, blocks)
        _auth_failure(err)
        assert relay.flipped > 0
        await _wait_down(link_of(d, 1, alive=False), link_of(p, 2, alive=False))
        assert "payload failed authentication" in (d.link_failure(1) or "")
        with pytest.raises(dd.LLMException) as again:  # the link stays broken
            await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), dcache, [0], [0])
        assert again.value.status_code == S.LLM_LINK_FAILED


@pytest.mark.anyio
@pytest.mark.parametrize("nblocks", [4, 32], ids=["inline", "streamed"])
async def test_payload_auth_refuses_pushed_bytes_a_relay_changed(nblocks: int) -> None:
    async with relayed("1", flip=True) as (p, d, relay):
        src, dst, dcache = _caches(p, d)
        before = src.copy()
        dst[...] = 7
        blocks = list(range(nblocks))
        with pytest.raises(dd.LLMException) as err:
            await d.cache_manager.push_blocks(dd.BlocksCacheKey(1, 0), dcache, blocks, blocks)
        _auth_failure(err)  # the target told the initiator why before it broke the link
        assert relay.flipped > 0
        await _wait_down(link_of(d, 1, alive=False), link_of(p, 2, alive=False))
        # The relay's bytes may have landed (a failed transfer leaves undefined bytes), but
        # blocks outside the transfer are untouched.
        assert np.array_equal(src[nblocks:], before[nblocks:])


@pytest.mark.anyio
async def test_payload_auth_refuses_a_layerwise_transfer_a_relay_changed() -> None:
    async with relayed("1", flip=True) as (p, d, relay):
        desc = dd.CacheDesc(4, [8, 4096], dd.DataType.DT_UINT8)  # 2 layers of K and V
        dst = [np.zeros((8, 4096), np.uint8) for _ in range(4)]
        d.cache_manager.register_blocks_cache(desc, dst, dd.BlocksCacheKey(2, 0))
        src = p.cache_manager.allocate_blocks_cache(desc)
        for t in src.tensors:
            t[...] = 9
        cfg = dd.TransferWithCacheKeyConfig(dd.BlocksCacheKey(2, 0), range(0, 2), range(0, 2))
        events = dd.LayerEvents()
        events.layer_ready(0)
        events.layer_ready(1)
        task = p.cache_manager.transfer_cache_async(src, events, [cfg])
        with pytest.raises(dd.LLMException) as err:
            await task
        assert err.value.status_code == S.LLM_LINK_FAILED, err.value
        await _wait_down(link_of(d, 1, alive=False), link_of(p, 2, alive=False))
        assert "payload failed authentication" in (d.link_failure(1) or "")
        assert relay.flipped > 0


@pytest.mark.anyio
@pytest.mark.parametrize("flip", [False, True], ids=["honest", "flipping"])
async def test_payload_auth_of_device_memory_through_staging(flip: bool) -> None:
    """Device memory moves through a host staging buffer: the MAC is checked there, before
    the scatter, so a changed payload never reaches device memory."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    device = {"llm.DeviceAdapter": "torch", "llm.TorchDevice": "cpu"}
    async with relayed("1", flip=flip, **device) as (p, d, _):
        desc = dd.CacheDesc(1, [BLOCKS, BLOCK], dd.DataType.DT_UINT8)
        src = np.random.default_rng(5).integers(0, 255, (BLOCKS, BLOCK), dtype=np.uint8)
        p.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 0))
        kv = torch.zeros((BLOCKS, BLOCK), dtype=torch.uint8)
        cache = d.cache_manager.register_blocks_cache(desc, [kv])
        for blocks in ([5], list(range(32))):  # fast path, streamed
            pull = d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), cache, blocks, blocks)
            if not flip:
                await pull
                assert np.array_equal(kv.numpy()[blocks], src[blocks])
                continue
            with pytest.raises(dd.LLMException) as err:
                await pull
            _auth_failure(err)
            assert not kv.any()  # not one byte of the relay's reached device memory
            break
        if not flip:
            kv[40:44] = 3
            await d.cache_manager.push_blocks(dd.BlocksCacheKey(1, 0), cache, [40, 41], [0, 1])
            assert (src[:2] == 3).all()


# ---------------------------------------------------------------------------- honest relay
@pytest.mark.anyio
async def test_payload_auth_over_an_honest_relay_is_byte_exact() -> None:
    async with relayed("1", flip=False) as (p, d, relay):
        src, dst, dcache = _caches(p, d)
        cm = d.cache_manager
        rng = np.random.default_rng(8)
        for n in (1, 4, 16, 17, 32, BLOCKS):  # fast path, inline, 1 MiB edge, worker
            dst[...] = 0
            remote = rng.permutation(BLOCKS)[:n].tolist()
            local = rng.permutation(BLOCKS)[:n].tolist()
            await cm.pull_blocks(dd.BlocksCacheKey(1, 0), dcache, remote, local)
            assert np.array_equal(dst[local], src[remote])
        many = [cm.pull_blocks(dd.BlocksCacheKey(1, 0), dcache, [i], [i]) for i in range(BLOCKS)]
        for t in many:  # small pulls in flight at once: the writer's batches
            await t
        assert np.array_equal(dst, src)
        for n in (1, 4, 16, 17, BLOCKS):
            dst[...] = rng.integers(0, 255, dst.shape, dtype=np.uint8)
            local = rng.permutation(BLOCKS)[:n].tolist()
            remote = rng.permutation(BLOCKS)[:n].tolist()
            await cm.push_blocks(dd.BlocksCacheKey(1, 0), dcache, local, remote)
            assert np.array_equal(src[remote], dst[local])
        assert relay.flipped == 0 and link_of(d, 1).alive


@pytest.mark.anyio
async def test_payload_auth_of_a_pull_of_several_frames() -> None:
    """More than one 32 MiB DATA frame (each frame its own MAC, bound to its sequence)."""
    async with relayed("1", flip=False) as (p, d, _):
        desc = dd.CacheDesc(1, [40, 1 << 20], dd.DataType.DT_UINT8)
        src = np.random.default_rng(9).integers(0, 255, (40, 1 << 20), dtype=np.uint8)
        p.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 1))
        dst = np.zeros_like(src)
        dcache = d.cache_manager.register_blocks_cache(desc, [dst])
        order = np.random.default_rng(10).permutation(40).tolist()
        await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 1), dcache, order, list(range(40)))
        assert np.array_equal(dst, src[order])
        await d.cache_manager.push_blocks(dd.BlocksCacheKey(1, 1), dcache, list(range(40)), order)
        assert np.array_equal(src[order], dst)


@pytest.mark.anyio
async def test_a_push_cancelled_mid_frame_does_not_break_a_payload_auth_link() -> None:
    """The initiator cancels a push while its DATA frame is on the way: the rest of the frame
    goes out as zeros and its MAC covers those zeros, so the target sees a cancel, not
    tampering, and the link stays up."""
    async with relayed("1", flip=False, rate=32 << 20) as (p, d, _):
        # 24 MiB in one frame from a worker (more than the kernel's socket buffers hold):
        # about 0.75 s on the way through the relay
        desc = dd.CacheDesc(1, [24, 1 << 20], dd.DataType.DT_UINT8)
        src = np.full((24, 1 << 20), 5, np.uint8)
        p.cache_manager.register_blocks_cache(desc, [src], dd.BlocksCacheKey(1, 1))
        dst = np.full((24, 1 << 20), 7, np.uint8)
        dcache = d.cache_manager.register_blocks_cache(desc, [dst])
        blocks = list(range(24))
        with anyio.move_on_after(0.2) as scope:
            await d.cache_manager.push_blocks(dd.BlocksCacheKey(1, 1), dcache, blocks, blocks)
        assert scope.cancelled_caught
        # the padded frame landed (its zeros ended the frame)
        await wait_until(lambda: src[-1, -1] == 0, 10, 0.02)
        await anyio.sleep(0.2)
        assert link_of(d, 1).alive and link_of(p, 2).alive
        assert (src[0] == 7).all()  # the frame's head had the pushed bytes
        await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 1), dcache, [3], [0])
        assert (dst[0] == src[3]).all()


# ---------------------------------------------------------------------------- settings
def test_payload_auth_option_validation() -> None:
    from llmdd_async._options import parse_options

    base = {"llm.EnableCacheManager": "1"}
    with pytest.raises(dd.LLMException) as err:
        parse_options({**base, "llm.PayloadAuth": "1"})
    assert err.value.status_code == S.LLM_PARAM_INVALID
    assert "llm.PayloadAuth" in str(err.value) and "llm.AuthKey" in str(err.value)
    for bad in ("yes", "2", "", "true"):
        with pytest.raises(dd.LLMException) as err:
            parse_options({**base, "llm.AuthKey": "k", "llm.PayloadAuth": bad})
        assert err.value.status_code == S.LLM_PARAM_INVALID
        assert "llm.PayloadAuth" in str(err.value)
    assert parse_options({**base, "llm.AuthKey": "k", "llm.PayloadAuth": "1"}).payload_auth
    assert not parse_options({**base, "llm.AuthKey": "k", "llm.PayloadAuth": "0"}).payload_auth
    assert not parse_options({**base, "llm.AuthKey": "k"}).payload_auth
    assert not parse_options({**base, "llm.PayloadAuth": "0"}).payload_auth
    cfg = dd.LLMConfig()
    cfg.auth_key = "k"
    cfg.payload_auth = True
    assert cfg.generate_options()["llm.PayloadAuth"] == "1"


@pytest.mark.anyio
@pytest.mark.parametrize("server_side", ["1", "0"], ids=["server-on", "client-on"])
async def test_endpoints_that_differ_in_payload_auth_refuse_the_link(server_side: str) -> None:
    client_side = "0" if server_side == "1" else "1"
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(
        _options(server_side, listen=True)
    ) as p:
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(_options(client_side)) as d:
            assert p.listen_address is not None
            code, codes = await d.link_clusters([cluster(1, p.listen_address)], 3000)
            assert code != S.LLM_SUCCESS and codes != [S.LLM_SUCCESS]
            assert "llm.PayloadAuth differs" in (d.link_failure(1) or ""), d.link_failure(1)
            assert not has_link(p, 2)


def test_a_data_frame_tag_is_bound_to_its_sequence_number() -> None:
    """Two frames with the same payload have different tags: a relay cannot move one
    frame's payload and tag onto another."""
    from llmdd_async._protocol import FrameAuth

    a = FrameAuth(b"k" * 32)
    one, two = a.payload_mac(0), a.payload_mac(1)
    one.update(b"x" * 100)
    two.update(b"x" * 100)
    assert one.digest() != two.digest()
    assert len(one.digest()) == PAYLOAD_TAG


def test_the_payload_mac_covers_exactly_what_passed_however_the_syscalls_cut_it() -> None:
    """PayloadMac skips the header, hashes the payload in whatever pieces syscalls move, stops
    before the trailer and appends it once the payload is out."""
    import hashlib
    import hmac

    from llmdd_async._transports._bufs import batch
    from llmdd_async._transports.tcp import PayloadMac, _step

    rng = np.random.default_rng(11)
    for _ in range(200):
        header = bytes(rng.integers(0, 255, int(rng.integers(1, 80)), dtype=np.uint8))
        views = [
            memoryview(bytes(rng.integers(0, 255, int(rng.integers(0, 300)), dtype=np.uint8)))
            for _ in range(int(rng.integers(1, 6)))
        ]
        payload = b"".join(views)
        if not payload:
            continue
        mac = PayloadMac(hmac.new(b"k", b"s", hashlib.sha256), len(header), len(payload))
        bufs = [memoryview(header), *views]
        idx, out = 0, bytearray()
        while idx < len(bufs):
            chunk = batch(bufs, idx)
            room = sum(b.nbytes for b in bufs[idx:])
            n = int(rng.integers(1, room + 1))  # what one "syscall" took
            if rng.integers(0, 3) == 0:
                n = room  # (all of the batch: passed with no look at each view)
            took, left = bytearray(), n
            for b in bufs[idx:]:
                took += b[:left]
                left -= min(left, b.nbytes)
            out += took
            idx = _step(bufs, idx, n, mac, chunk)
        want = hmac.new(b"k", b"s", hashlib.sha256)
        want.update(payload)
        assert bytes(out) == header + payload + want.digest()
        assert mac.done
