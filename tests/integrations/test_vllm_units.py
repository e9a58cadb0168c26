"""llmdd_async.vllm without vLLM: config rules, KV layout derivation, the side channel."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest

from llmdd_async._errors import ControlError
from llmdd_async.vllm import SUPPORTED_VLLM, ConnectorConfig, check_vllm_version
from llmdd_async.vllm._control import MAX_FRAME, ControlClient, ControlServer

# ------------------------------------------------------------------------------------ config


def test_config_defaults() -> None:
    cfg, warnings = ConnectorConfig.parse({}, env={})
    assert cfg == ConnectorConfig()
    assert (cfg.mode, cfg.side_channel_port, cfg.transport, cfg.lease_s) == ("pull", 0, "auto", 30)
    assert cfg.auth_key is None and warnings == []


def test_config_values_and_env_key() -> None:
    extra = {
        "mode": "layerwise",
        "side_channel_host": "10.0.0.5",
        "side_channel_port": "5600",
        "transport": "tcp",
        "lease_s": 2.5,
        "transfer_timeout_s": 3,
    }
    cfg, warnings = ConnectorConfig.parse(extra, env={"LLMDD_AUTH_KEY": "s3cret"})
    assert cfg.mode == "layerwise" and cfg.side_channel_host == "10.0.0.5"
    assert cfg.side_channel_port == 5600 and cfg.transport == "tcp"
    assert cfg.lease_s == 2.5 and cfg.transfer_timeout_s == 3.0
    assert cfg.auth_key == "s3cret" and "s3cret" not in repr(cfg)
    # the config's own key wins over the environment
    assert ConnectorConfig.parse({"auth_key": "k"}, env={"LLMDD_AUTH_KEY": "e"})[0].auth_key == "k"
    assert warnings == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("mode", "push"),
        ("side_channel_port", 70000),
        ("side_channel_port", -1),
        ("side_channel_port", "x"),
        ("side_channel_port", True),
        ("side_channel_host", ""),
        ("side_channel_host", "a b"),
        ("transport", "rdma"),
        ("auth_key", ""),
        ("auth_key", 5),
        ("lease_s", 0),
        ("lease_s", "soon"),
        ("lease_s", float("nan")),
        ("transfer_timeout_s", -1),
    ],
)
def test_config_bad_value_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['{key}'\]"):
        ConnectorConfig.parse({key: value}, env={})


def test_config_unknown_key_warns_with_suggestion() -> None:
    cfg, warnings = ConnectorConfig.parse({"lease": 5, "backends": ["UCX"]}, env={})
    assert cfg.lease_s == 30
    assert len(warnings) == 2
    assert any("'lease'" in w and "did you mean 'lease_s'" in w for w in warnings)


def test_version_check() -> None:
    check_vllm_version(f"{SUPPORTED_VLLM[0]}.0")
    check_vllm_version(f"{SUPPORTED_VLLM[0]}.7+cpu")
    for bad in ("0.31.2", "0.33.0", "1.0.0", "unknown"):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x; this is vLLM"):
            check_vllm_version(bad)


# ------------------------------------------------------------------------------------ layout


def test_layout_cpu_and_flash() -> None:
    torch = pytest.importorskip("torch")
    from llmdd_async import DataType
    from llmdd_async.vllm._layout import derive_layout, incompatibility

    # CPU backend: [num_blocks, kv_heads, block_size, 2 * head_dim] per layer
    cpu = {f"model.layers.{i}.self_attn.attn": torch.zeros(10, 2, 32, 64) for i in (1, 0, 2)}
    lay, names, tensors = derive_layout(cpu, 32)
    assert names == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2)]
    assert (lay.layout, lay.tensors_per_layer, lay.num_layers) == ("cpu", 1, 3)
    assert (lay.num_blocks, lay.kv_heads, lay.head_dim, lay.block_size) == (10, 2, 32, 32)
    assert lay.block_elems == 2 * 32 * 64 and lay.data_type == DataType.DT_FLOAT
    assert tensors[0] is cpu[names[0]]
    assert lay.block_bytes == 3 * 2 * 32 * 64 * 4

    # CUDA FlashAttention: [2, num_blocks, block_size, kv_heads, head_dim]: K and V per layer
    fa = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(2, 10, 16, 2, 32, dtype=torch.bfloat16)
        for i in range(3)
    }
    lay2, _, tensors2 = derive_layout(fa, 16)
    assert (lay2.layout, lay2.tensors_per_layer, lay2.num_blocks) == ("flash", 2, 10)
    assert (lay2.kv_heads, lay2.head_dim, lay2.block_elems) == (2, 32, 16 * 2 * 32)
    assert lay2.data_type == DataType.DT_BF16 and len(tensors2) == 6
    first = fa["model.layers.0.self_attn.attn"]
    assert tensors2[0].data_ptr() == first[0].data_ptr()
    assert tensors2[1].data_ptr() == first[1].data_ptr()  # V: the second half
    assert tensors2[1].is_contiguous()

    # what two engines must agree on
    assert incompatibility(lay, lay.to_wire()) is None
    other = dict(lay.to_wire(), num_blocks=99)  # block counts may differ
    assert incompatibility(lay, other) is None
    bad = incompatibility(lay, dict(lay.to_wire(), block_size=64, dtype="float16"))
    assert bad is not None and "block_size" in bad and "dtype" in bad
    assert "layout" in (incompatibility(lay, lay2.to_wire()) or "")


def test_layout_refusals() -> None:
    torch = pytest.importorskip("torch")
    from llmdd_async.vllm._layout import derive_layout

    with pytest.raises(ValueError, match="neither the CPU layout"):
        derive_layout({"l.0.x": torch.zeros(10, 2, 16, 64)}, 32)  # block size mismatch
    with pytest.raises(ValueError, match="one layout for all layers"):
        derive_layout({"l.0.x": torch.zeros(10, 2, 32, 64), "l.1.x": torch.zeros(9, 2, 32, 64)}, 32)
    with pytest.raises(ValueError, match="not contiguous"):
        derive_layout({"l.0.x": torch.zeros(2, 32, 10, 64).permute(2, 0, 1, 3)}, 32)
    with pytest.raises(ValueError, match="no KV tensors"):
        derive_layout({}, 32)


# ------------------------------------------------------------------------------ side channel


async def _pair(server_key: str | None, client_key: str | None) -> tuple[Any, Any, list[Any]]:
    got: list[Any] = []

    async def handler(peer: Any, msg: dict[str, Any]) -> None:
        got.append(msg)
        await peer.send({"op": "pushed", "req": msg.get("req"), "ok": True})

    server = ControlServer(server_key, lambda: {"cluster_id": 7}, handler, timeout_s=2)
    await server.start("127.0.0.1", 0)
    client = ControlClient(client_key)
    return server, client, got


@pytest.mark.parametrize("key", [None, "k3y"])
def test_side_channel_roundtrip(key: str | None) -> None:
    async def main() -> None:
        server, client, got = await _pair(key, key)
        try:
            meta = await client.connect("127.0.0.1", server.port, 2)
            assert meta == {"cluster_id": 7}
            for i in range(3):
                await client.send({"op": "ids", "req": f"r{i}", "blocks": [1, 2]})
                assert (await client.recv())["req"] == f"r{i}"
            assert [m["req"] for m in got] == ["r0", "r1", "r2"]
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


@pytest.mark.parametrize(("server_key", "client_key"), [("a", "b"), ("a", None), (None, "b")])
def test_side_channel_refuses_wrong_key(server_key: str | None, client_key: str | None) -> None:
    async def main() -> None:
        server, client, got = await _pair(server_key, client_key)
        try:
            with pytest.raises(ControlError):
                await client.connect("127.0.0.1", server.port, 2)
            assert got == []
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_side_channel_drops_forged_and_oversized_frames() -> None:
    async def main() -> None:
        server, client, got = await _pair("k", "k")
        try:
            await client.connect("127.0.0.1", server.port, 2)
            conn = client._conn
            assert conn is not None
            body = b'{"op":"done","req":"x"}' + b"\0" * 32  # a wrong MAC
            conn.writer.write(struct.pack(">I", len(body)) + body)
            await conn.writer.drain()
            with pytest.raises(ControlError):
                await asyncio.wait_for(client.recv(), 2)
            assert got == []
            # a frame over the limit is refused before it is read
            c2 = ControlClient("k")
            await c2.connect("127.0.0.1", server.port, 2)
            assert c2._conn is not None
            c2._conn.writer.write(struct.pack(">I", MAX_FRAME + 1))
            await c2._conn.writer.drain()
            with pytest.raises(ControlError):
                await asyncio.wait_for(c2.recv(), 2)
            c2.close()
        finally:
            client.close()
            await server.close()

    asyncio.run(main())


def test_side_channel_unreachable() -> None:
    async def main() -> None:
        client = ControlClient(None)
        with pytest.raises(ControlError, match="cannot reach side channel"):
            await client.connect("127.0.0.1", 1, 1)

    asyncio.run(main())


# ------------------------------------- transfer_cache_async(tensor_num_per_layer=1) (core)


def test_layerwise_one_tensor_per_layer() -> None:
    """vLLM's CPU KV keeps K and V in one tensor per layer: layer-wise pushes of such a cache."""
    import anyio
    import numpy as np

    import llmdd_async as dd
    from llmdd_async.testing import linked_pair

    layers, blocks, size = 3, 6, 512
    desc = dd.CacheDesc(layers, [blocks, size], dd.DataType.DT_UINT8)
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 255, (blocks, size), dtype=np.uint8) for _ in range(layers)]
    dst = [np.zeros((blocks, size), np.uint8) for _ in range(layers)]

    async def main() -> None:
        async with linked_pair() as (prompt, decoder):
            key = dd.BlocksCacheKey(2, 0)
            decoder.cache_manager.register_blocks_cache(desc, dst, key, remote_accessible=True)
            cm = prompt.cache_manager
            cache = cm.register_blocks_cache(desc, src, dd.BlocksCacheKey(1, 0), True)
            cfg = dd.TransferWithCacheKeyConfig(key, range(layers), range(layers))
            with pytest.raises(dd.LLMException):  # 3 tensors are not layers of 2
                cm.transfer_cache_async(cache, dd.LayerEvents(), [cfg], [0], [0])
            with pytest.raises(dd.LLMException):
                cm.transfer_cache_async(
                    cache, dd.LayerEvents(), [cfg], [0], [0], tensor_num_per_layer=0
                )
            events = dd.LayerEvents()
            task = cm.transfer_cache_async(
                cache, events, [cfg], [1, 2, 4], [0, 3, 5], tensor_num_per_layer=1
            )
            for i in range(layers):
                events.layer_ready(i)
            await task
            assert len(task.statistics().layers) == layers
            assert task.statistics().bytes == layers * 3 * size

    anyio.run(main)
    for i in range(layers):
        assert (dst[i][[0, 3, 5]] == src[i][[1, 2, 4]]).all()
        assert not dst[i][[1, 2, 4]].any()
