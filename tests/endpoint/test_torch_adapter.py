"""The torch device adapter, on CPU tensors treated as device memory (and on CUDA if lent).

With ``llm.TorchDevice=cpu`` the adapter runs exactly the code an accelerator uses: tensor
registration, a device pool, copies through ``Tensor.copy_``, socket transfers staged through
host buffers, and no direct (same-host) access to device memory.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from helpers import cm_options, endpoint_options, expected_tensor, link, register_blocks_at

import llmdd_async as dd
from llmdd_async.testing import PeerProcess, encode_key, engine_of

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

pytestmark = pytest.mark.anyio

S = dd.LLMStatusCode


def torch_options(device: str = "cpu", **extra: str) -> dict[str, str]:
    return cm_options(**{"llm.DeviceAdapter": "torch", "llm.TorchDevice": device, **extra})


async def test_registration_pool_and_local_copies() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(torch_options()) as d:
        cm = d.cache_manager
        kv = [torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64) + i for i in range(2)]
        reg = cm.register_blocks_cache(dd.CacheDesc(2, [8, 64], dd.DataType.DT_FLOAT), kv)
        pooled = cm.allocate_blocks_cache(dd.CacheDesc(2, [8, 64], dd.DataType.DT_FLOAT))
        with pytest.raises(dd.LLMException, match="not host-addressable"):
            _ = reg.tensors
        # device -> host (swap out) and host -> device (swap in)
        host = [np.zeros((8, 64), np.float32) for _ in range(2)]
        cpu = dd.Cache.create_cpu_cache(
            dd.CacheDesc(2, [8, 64], dd.DataType.DT_FLOAT, dd.Placement.HOST),
            [h.ctypes.data for h in host],
        )
        await cm.swap_blocks(reg, cpu, {1: 3, 2: 0})
        for i in range(2):
            assert np.array_equal(host[i][3], kv[i][1].numpy())
            assert np.array_equal(host[i][0], kv[i][2].numpy())
        await cm.swap_blocks(cpu, pooled, {3: 5})
        await cm.copy_blocks(pooled, {5: [6]})
        pool = cm.engine.pools[dd.Placement.DEVICE]
        alloc_base = pooled.tensor_addrs[0] - pool.base
        dev = pool.tensor.narrow(0, alloc_base, 8 * 64 * 4).view(torch.float32).reshape(8, 64)
        assert torch.equal(dev[6], kv[0][1]) and torch.equal(dev[5], kv[0][1])


async def test_registration_rules() -> None:
    async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(torch_options()) as d:
        cm = d.cache_manager
        desc = dd.CacheDesc(1, [4, 16], dd.DataType.DT_FLOAT)
        with pytest.raises(dd.LLMException):
            cm.register_cache(desc, [np.zeros((4, 16), np.float32)])  # not a torch tensor
        with pytest.raises(dd.LLMException):
            cm.register_cache(desc, [torch.zeros(16, 8).t()])  # not contiguous
        with pytest.raises(dd.LLMException):
            cm.register_cache(desc, [torch.zeros(4, 8)])  # too small


async def test_default_device_is_the_accelerator_or_a_clear_error() -> None:
    opts = cm_options(**{"llm.DeviceAdapter": "torch"})
    if torch.cuda.is_available():
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as d:
            assert engine_of(d).adapter.device.type == "cuda"
        return
    with pytest.raises(dd.LLMException, match=r"llm\.TorchDevice=cpu"):
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts):
            pass


@pytest.mark.parametrize("transport", ["tcp", "same-host"])
async def test_pull_and_push_device_memory_through_staging(transport) -> None:
    shape = (16, 4096)
    popts = endpoint_options(transport, listen=True, ra=True)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, popts) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=70,
        )
        opts = torch_options(**{"llm.Transport": transport, "llm.EnableRemoteCacheAccessible": "1"})
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
            cache = cm.register_blocks_cache(
                dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8),
                kv,
                dd.BlocksCacheKey(2, 0),
            )
            src_blocks = [3, 4, 5, 15]
            await cm.pull_blocks(dd.BlocksCacheKey(1, 0), cache, src_blocks, [0, 1, 2, 9])
            for t in range(2):
                want = expected_tensor(70, t, shape)[src_blocks]
                assert np.array_equal(kv[t].numpy()[[0, 1, 2, 9]], want)
            for t in range(2):
                kv[t][7] = 200 + t
            await cm.push_blocks(dd.BlocksCacheKey(1, 0), cache, [7], [11])
            for t in range(2):
                got = base64.b64decode(await p.request("read", cache_id=1, tensor=t))
                assert set(np.frombuffer(got, np.uint8).reshape(shape)[11]) == {200 + t}
            # device memory is never reached directly by the peer: both went over the stream
            assert {r.mode for r in d.link_statistics(1).recent} == {"stream"}


async def test_staging_buffers_are_allocated_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pinned host memory takes milliseconds to allocate: a staging buffer the adapter has
    none of is allocated in a worker thread, receiving as sending (before: a pull's receive
    allocated it on the loop)."""
    import threading

    from llmdd_async._devices._torch import TorchAdapter

    loop_thread = threading.current_thread()
    allocated: list[bool] = []  # for each buffer allocated: on the loop's thread?
    staging = TorchAdapter.staging

    def recorded(self: TorchAdapter, nbytes: int, allocate: bool = True) -> object:
        kept = len(self._staging)
        buf = staging(self, nbytes, allocate)
        if buf is not None and len(self._staging) == kept:  # (not one it kept: allocated)
            allocated.append(threading.current_thread() is loop_thread)
        return buf

    monkeypatch.setattr(TorchAdapter, "staging", recorded)
    shape = (16, 4096)
    async with PeerProcess.start(
        dd.LLMRole.PROMPT, 1, endpoint_options("tcp", listen=True, ra=True)
    ) as p:
        await p.request(
            "alloc", kind="blocks", num_tensors=2, shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)), seed=71,
        )  # fmt: skip
        opts = torch_options(**{"llm.Transport": "tcp", "llm.EnableRemoteCacheAccessible": "1"})
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(opts) as d:
            await link(d, 1, p.listen)
            cm = d.cache_manager
            kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
            cache = cm.register_blocks_cache(dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8), kv)
            await cm.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [3, 4], [0, 1])
            await cm.push_blocks(dd.BlocksCacheKey(1, 0), cache, [5], [6])
            assert np.array_equal(kv[1].numpy()[[0, 1]], expected_tensor(71, 1, shape)[[3, 4]])
    assert allocated and not any(allocated)


async def test_layerwise_from_device_memory_with_device_events() -> None:
    from llmdd_async.torch import TorchLayerEvents

    layers, shape = 3, (4, 2048)
    async with PeerProcess.start(
        dd.LLMRole.DECODER, 2, endpoint_options("tcp", listen=True, ra=True)
    ) as dec:
        dst = await register_blocks_at(dec, 2 * layers, shape)
        opts = torch_options(**{"llm.Transport": "tcp", "llm.EnableRemoteCacheAccessible": "1"})
        async with dd.LLMDataDist(dd.LLMRole.PROMPT, 1).running(opts) as prompt:
            await link(prompt, 2, dec.listen)
            cm = prompt.cache_manager
            kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2 * layers)]
            src = cm.register_blocks_cache(
                dd.CacheDesc(2 * layers, list(shape), dd.DataType.DT_UINT8), kv
            )
            events = TorchLayerEvents()
            cfg = dd.TransferWithCacheKeyConfig(
                dd.BlocksCacheKey(2, 0), range(0, layers), range(0, layers)
            )
            task = cm.transfer_cache_async(src, events, [cfg], [0, 1], [2, 3])
            for layer in range(layers):
                for t in (2 * layer, 2 * layer + 1):
                    kv[t].copy_(torch.from_numpy(expected_tensor(71, t, shape)))
                events.record(layer)
            await task
            for t in range(2 * layers):
                got = base64.b64decode(await dec.request("read", cache_id=dst, tensor=t))
                got = np.frombuffer(got, np.uint8).reshape(shape)
                assert np.array_equal(got[[2, 3]], expected_tensor(71, t, shape)[[0, 1]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_pull_into_gpu_memory() -> None:
    shape = (8, 1 << 16)
    async with PeerProcess.start(dd.LLMRole.PROMPT, 1, endpoint_options("tcp", listen=True)) as p:
        await p.request(
            "alloc",
            kind="blocks",
            num_tensors=2,
            shape=list(shape),
            blocks_key=encode_key(dd.BlocksCacheKey(1, 0)),
            seed=72,
        )
        async with dd.LLMDataDist(dd.LLMRole.DECODER, 2).running(
            torch_options("cuda", **{"llm.Transport": "tcp"})
        ) as d:
            await link(d, 1, p.listen)
            kv = [torch.zeros(shape, dtype=torch.uint8, device="cuda") for _ in range(2)]
            cache = d.cache_manager.register_blocks_cache(
                dd.CacheDesc(2, list(shape), dd.DataType.DT_UINT8), kv
            )
            await d.cache_manager.pull_blocks(dd.BlocksCacheKey(1, 0), cache, [1, 2], [5, 6])
            for t in range(2):
                got = kv[t].cpu().numpy()[[5, 6]]
                assert np.array_equal(got, expected_tensor(72, t, shape)[[1, 2]])
