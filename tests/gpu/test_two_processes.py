"""Two OS processes, each with its own torch context, moving torch tensors byte-exactly.

This process runs one endpoint (``llm.DeviceAdapter=torch`` on the test's device); a torch
peer process (``_torch_peer.py``) runs the other, on 127.0.0.1. Every transfer is checked
byte for byte against a host reference (``llmdd_async.testing.pattern``), every block of the
destination, moved blocks shuffled and untouched blocks still zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import link

import llmdd_async as dd

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

from gpu_kit import (  # noqa: E402 - after the importorskip
    LOCAL,
    PEER,
    TorchPeer,
    as_rows,
    endpoint_options,
    reference,
    shuffled,
    sync,
    write_bytes,
)

pytestmark = pytest.mark.anyio

TRANSPORTS = ["tcp", "same-host"]
U8 = dd.DataType.DT_UINT8


def _zeros(device: str, count: int, shape: list[int], dtype: Any = None) -> list[Any]:
    return [torch.zeros(shape, dtype=dtype or torch.uint8, device=device) for _ in range(count)]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_pull_push_and_layerwise_between_two_torch_processes(
    device: str, peer: TorchPeer, transport: str
) -> None:
    layers, nb, blk = 3, 64, 8192  # 6 tensors of 64 blocks of 8 KiB
    nt = 2 * layers
    async with peer.endpoint(transport) as ep:
        await ep.register("plain", nb, [blk], nt, model_id=0, seed=100)
        dst_id = await ep.register("plain", nb, [blk], nt, model_id=1)
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, transport)
        ) as d:
            await link(d, PEER, ep.listen)
            cm = d.cache_manager
            kv = _zeros(device, nt, [nb, blk])
            cache = cm.register_blocks_cache(
                dd.CacheDesc(nt, [nb, blk], U8), kv, dd.BlocksCacheKey(LOCAL, 0)
            )

            # pull_blocks: peer device -> staging -> socket -> staging -> our device
            src, dst = shuffled(nb, 48, seed=1)
            await cm.pull_blocks(dd.BlocksCacheKey(PEER, 0), cache, src, dst)
            untouched = sorted(set(range(nb)) - set(dst))
            for t in range(nt):
                got = as_rows(kv[t])
                assert np.array_equal(got[dst], reference(100, t, nb, blk)[src]), t
                assert not got[untouched].any(), t

            # push_blocks: our device -> the peer's device
            for t in range(nt):
                write_bytes(kv[t], reference(200, t, nb, blk))
            sync(device)
            psrc, pdst = shuffled(nb, 40, seed=2)
            await cm.push_blocks(dd.BlocksCacheKey(PEER, 1), cache, psrc, pdst)
            untouched = sorted(set(range(nb)) - set(pdst))
            for t in range(nt):
                got = await ep.rows(dst_id, t, nb)
                assert np.array_equal(got[pdst], reference(200, t, nb, blk)[psrc]), t
                assert not got[untouched].any(), t

            # layer-wise: each layer is written, then its readiness recorded on the device
            from llmdd_async.torch import TorchLayerEvents

            await ep.fill(dst_id, 0)
            events = TorchLayerEvents()
            lsrc, ldst = shuffled(nb, 32, seed=3)
            cfg = dd.TransferWithCacheKeyConfig(
                dd.BlocksCacheKey(PEER, 1), range(0, layers), range(0, layers)
            )
            task = cm.transfer_cache_async(cache, events, [cfg], lsrc, ldst)
            for layer in range(layers):
                for t in (2 * layer, 2 * layer + 1):
                    write_bytes(kv[t], reference(300, t, nb, blk))
                events.record(layer)
            with anyio.fail_after(60):
                await task
            assert await task.get_results() == [dd.LLMStatusCode.LLM_SUCCESS]
            assert task.layers_done == layers
            untouched = sorted(set(range(nb)) - set(ldst))
            for t in range(nt):
                got = await ep.rows(dst_id, t, nb)
                assert np.array_equal(got[ldst], reference(300, t, nb, blk)[lsrc]), t
                assert not got[untouched].any(), t

            # our device memory moved through staging and the stream, same-host or not
            assert {r.mode for r in d.link_statistics(PEER).recent} == {"stream"}


def _vllm_flash_kv_caches(
    device: str, layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """KV tensors as vLLM 0.32's GPU model runner allocates them for FlashAttention: one
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` tensor per attention layer, K in
    ``[0]`` and V in ``[1]``, keyed by layer name (deliberately not in layer order)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    shape = (2, num_blocks, block_size, heads, head_dim)
    return {n: torch.zeros(shape, dtype=torch.bfloat16, device=device) for n in reversed(names)}


def _flash_tensors(kv_caches: dict[str, Any]) -> list[Any]:
    """The llmdd tensors of vLLM FlashAttention KV tensors, as README "Layout" states: layers
    in layer order (by the number in the name), K and V of each as two tensors. Block ``b`` of
    vLLM is block ``b`` (dim 0) of each, one contiguous span."""
    names = sorted(kv_caches, key=lambda n: int(n.split(".")[2]))
    out = []
    for n in names:
        t = kv_caches[n]
        assert t.is_contiguous()
        out.extend((t[0], t[1]))
    return out


async def test_vllm_flash_attention_layout(device: str, peer: TorchPeer) -> None:
    layers, nb, bs, heads, hd = 4, 32, 16, 2, 64
    block_bytes = bs * heads * hd * 2  # bf16
    kv_caches = _vllm_flash_kv_caches(device, layers, nb, bs, heads, hd)
    tensors = _flash_tensors(kv_caches)
    # The layout really is what the mapping assumes: block b of K of a layer is one span.
    k0 = tensors[0]
    assert k0.is_contiguous() and k0.shape == (nb, bs, heads, hd)
    assert k0[5].data_ptr() == k0.data_ptr() + 5 * block_bytes
    assert tensors[1].data_ptr() == k0.data_ptr() + nb * block_bytes  # V follows K
    async with peer.endpoint("tcp") as ep:
        src_id = await ep.register(
            "flash", nb, [bs, heads, hd], layers, dtype="bfloat16", model_id=0, seed=400
        )
        dst_id = await ep.register(
            "flash", nb, [bs, heads, hd], layers, dtype="bfloat16", model_id=1
        )
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, "tcp")
        ) as d:
            await link(d, PEER, ep.listen)
            cm = d.cache_manager
            desc = dd.CacheDesc(2 * layers, [nb, bs * heads * hd], dd.DataType.DT_BF16)
            cache = cm.register_blocks_cache(desc, tensors, dd.BlocksCacheKey(LOCAL, 0))

            # pull: checked through vLLM's own indexing, kv_caches[name][k_or_v, block]
            src, dst = shuffled(nb, 24, seed=4)
            await cm.pull_blocks(dd.BlocksCacheKey(PEER, 0), cache, src, dst)
            for i in range(layers):
                t = kv_caches[f"model.layers.{i}.self_attn.attn"]
                for kv_index in (0, 1):
                    want = reference(400, 2 * i + kv_index, nb, block_bytes)[src]
                    assert np.array_equal(as_rows(t[kv_index])[dst], want), (i, kv_index)

            # layer-wise, as save_kv_layer does: the layer's whole [2, ...] tensor written,
            # then its readiness recorded on the device
            from llmdd_async.torch import TorchLayerEvents

            events = TorchLayerEvents()
            lsrc, ldst = shuffled(nb, 20, seed=5)
            cfg = dd.TransferWithCacheKeyConfig(
                dd.BlocksCacheKey(PEER, 1), range(0, layers), range(0, layers)
            )
            task = cm.transfer_cache_async(cache, events, [cfg], lsrc, ldst)
            for i in range(layers):
                t = kv_caches[f"model.layers.{i}.self_attn.attn"]
                both = np.concatenate([reference(500, 2 * i + k, nb, block_bytes) for k in (0, 1)])
                write_bytes(t, both)
                events.record(i)
            with anyio.fail_after(60):
                await task
            untouched = sorted(set(range(nb)) - set(ldst))
            for tensor in range(2 * layers):
                got = await ep.rows(dst_id, tensor, nb)
                assert np.array_equal(got[ldst], reference(500, tensor, nb, block_bytes)[lsrc])
                assert not got[untouched].any()
            assert src_id != dst_id


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cancel_fences_torch_transfers(
    device: str, peer: TorchPeer, transport: str, figures: Callable[..., None]
) -> None:
    """Cancelled mid-transfer, then the buffers overwritten: no late byte lands in them (pull)
    and none of the overwritten bytes reaches the peer (layer-wise push)."""
    big_nb, big_blk = 16, 1 << 20  # 16 MiB: long enough to catch it moving
    layers, nb, blk = 3, 16, 4096
    sentinel = 0xEE
    async with peer.endpoint(transport) as ep:
        await ep.register("plain", big_nb, [big_blk], 1, model_id=0, seed=600)
        lw_dst = await ep.register("plain", nb, [blk], 2 * layers, model_id=1)
        await ep.register("plain", nb, [blk], 2 * layers, model_id=2, seed=610)
        async with dd.LLMDataDist(dd.LLMRole.MIX, LOCAL).running(
            endpoint_options(device, transport)
        ) as d:
            await link(d, PEER, ep.listen)
            cm = d.cache_manager
            (big,) = _zeros(device, 1, [big_nb, big_blk])
            big_cache = cm.register_blocks_cache(dd.CacheDesc(1, [big_nb, big_blk], U8), [big])
            kv = _zeros(device, 2 * layers, [nb, blk])
            small = cm.register_blocks_cache(dd.CacheDesc(2 * layers, [nb, blk], U8), kv)
            probe = big.view(-1)[:: 1 << 16]  # one byte per 64 KiB: cheap to look at

            # ---- a pull, cancelled once its first bytes landed
            task = cm.pull_blocks(
                dd.BlocksCacheKey(PEER, 0), big_cache, list(range(big_nb)), list(range(big_nb))
            )
            with anyio.fail_after(60):
                while not task.done() and not bool(probe.any()):
                    await anyio.sleep(0.001)
            mid = not task.done()
            figures("pull_cancelled_mid_transfer", float(mid), "bool")
            task.cancel()
            if mid:
                with pytest.raises(dd.TransferCancelled):
                    await task
            else:  # it won the race: the fence is still checked below
                await task
            big.fill_(sentinel)
            sync(device)
            # The link still works, and serves the next request after the cancelled one.
            src, dst = shuffled(nb, 12, seed=6)
            await cm.pull_blocks(dd.BlocksCacheKey(PEER, 2), small, src, dst)
            for t in range(2 * layers):
                assert np.array_equal(as_rows(kv[t])[dst], reference(610, t, nb, blk)[src])
            assert bool((big == sentinel).all()), "a cancelled pull wrote after its fence"

            # ---- a layer-wise push, cancelled after layer 0 landed
            from llmdd_async.torch import TorchLayerEvents

            for t in range(2 * layers):
                write_bytes(kv[t], reference(620, t, nb, blk))
            sync(device)
            events = TorchLayerEvents()
            lsrc, ldst = shuffled(nb, 10, seed=7)
            cfg = dd.TransferWithCacheKeyConfig(
                dd.BlocksCacheKey(PEER, 1), range(0, layers), range(0, layers)
            )
            task = cm.transfer_cache_async(small, events, [cfg], lsrc, ldst)
            events.record(0)
            with anyio.fail_after(60):
                while task.layers_done < 1:
                    await anyio.sleep(0.001)
            task.cancel()
            with pytest.raises(dd.TransferCancelled):
                await task
            for t in kv:
                t.fill_(sentinel)
            sync(device)
            events.record(1)  # too late: nothing more may go out
            events.record(2)
            # A push on the same link after the fence: it lands, and so would any stray byte.
            await cm.push_blocks(dd.BlocksCacheKey(PEER, 1), small, [0], [ldst[0]])
            got = [await ep.rows(lw_dst, t, nb) for t in range(2 * layers)]
            for t in (0, 1):  # layer 0 went out before the cancel, with the bytes of then
                rows = [i for i, b in enumerate(ldst) if b != ldst[0]]
                want = reference(620, t, nb, blk)[[lsrc[i] for i in rows]]
                assert np.array_equal(got[t][[ldst[i] for i in rows]], want)
            for t in range(2, 2 * layers):  # later layers: nothing but the fenced push
                others = sorted(set(range(nb)) - {ldst[0]})
                assert not got[t][others].any(), t
                assert set(got[t][ldst[0]].tolist()) == {sentinel}
            assert await task.get_results() == [dd.LLMStatusCode.LLM_FAILED]
