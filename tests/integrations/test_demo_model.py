"""The demo's numpy transformer: paged attention is right, placement-free and bit-reproducible."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from llmdd_async.demo.model import ModelConfig, TinyTransformer, make_prompt

SMALL = ModelConfig(layers=2, heads=2, head_dim=16, vocab=97, block_size=4)

KV = list[tuple[np.ndarray, np.ndarray]]


def make_kv(config: ModelConfig, num_blocks: int, fill: float = 0.0) -> KV:
    """A paged cache of ``num_blocks`` blocks per layer, filled with ``fill``."""
    shape = (num_blocks, *config.kv_block_shape)
    return [
        (np.full(shape, fill, np.float32), np.full(shape, fill, np.float32))
        for _ in range(config.layers)
    ]


def dense_reference_forward(model: TinyTransformer, tokens: np.ndarray) -> np.ndarray:
    """Last-position logits with plain contiguous K/V (no paging), computed in float64.

    Written independently of the model's code; it shares only the weights and the definition
    of the rotary angles (float32 ``position * inv_freq``).
    """
    c = model.config
    h, hd, t = c.heads, c.head_dim, len(tokens)

    def rms(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain

    angles = np.arange(t).astype(np.float32)[:, None] * model.inv_freq[None, :]
    cos = np.cos(angles.astype(np.float64))[:, None, :]
    sin = np.sin(angles.astype(np.float64))[:, None, :]

    def rope(v: np.ndarray) -> np.ndarray:
        a, b = v[..., : hd // 2], v[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    x = model.tok_emb[np.asarray(tokens)].astype(np.float64)
    for w in model.blocks:
        qkv = rms(x, w.attn_norm) @ w.w_qkv.astype(np.float64)
        q, k, v = (part.reshape(t, h, hd) for part in np.split(qkv, 3, axis=1))
        q, k = rope(q), rope(k)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        scores[:, future] = -np.inf
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(t, h * hd) @ w.w_o
        u = rms(x, w.mlp_norm) @ w.w_up
        x = x + (u / (1.0 + np.exp(-u))) @ w.w_down
    return rms(x[-1], model.final_norm) @ model.unembed


def all_weights(model: TinyTransformer) -> list[np.ndarray]:
    """Every weight array of the model, in a fixed order."""
    per_layer = [getattr(b, f.name) for b in model.blocks for f in dataclasses.fields(b)]
    return [model.tok_emb, *per_layer, model.final_norm, model.unembed]


@pytest.fixture(scope="module")
def small() -> TinyTransformer:
    return TinyTransformer(SMALL)


def test_config_sizes() -> None:
    c = ModelConfig()
    assert c.d_model == 512
    assert c.kv_block_shape == (16, 8, 64)
    assert c.kv_bytes_per_token() * 1024 == 32 << 20
    assert [c.blocks_for(n) for n in (0, 1, 16, 17, 1024)] == [0, 1, 1, 2, 64]


@pytest.mark.parametrize("length", [1, 4, 7, 13, 300])
def test_paged_prefill_matches_dense_reference(small: TinyTransformer, length: int) -> None:
    tokens = make_prompt(length, SMALL.vocab)
    nb = SMALL.blocks_for(length)
    logits = small.prefill(tokens, make_kv(SMALL, nb), np.arange(nb, dtype=np.int64))
    assert logits.dtype == np.float32
    assert logits.shape == (SMALL.vocab,)
    np.testing.assert_allclose(logits, dense_reference_forward(small, tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length", [9, 16, 300])
def test_result_does_not_depend_on_physical_blocks(small: TinyTransformer, length: int) -> None:
    tokens = make_prompt(length, SMALL.vocab, seed=3)
    nb = SMALL.blocks_for(length)
    pool = 3 * nb + 1
    ident = np.arange(nb, dtype=np.int64)
    shuffled = np.random.default_rng(7).permutation(pool)[:nb].astype(np.int64)
    kv_a, kv_b = make_kv(SMALL, nb), make_kv(SMALL, pool)
    logits_a = small.prefill(tokens, kv_a, ident)
    logits_b = small.prefill(tokens, kv_b, shuffled)
    assert np.array_equal(logits_a, logits_b)

    unlisted = np.setdiff1d(np.arange(pool), shuffled)
    tail = slice(length - (nb - 1) * SMALL.block_size, None)  # unused slots of the last block
    for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True):
        assert np.array_equal(ka, kb[shuffled])
        assert np.array_equal(va, vb[shuffled])
        assert not kb[unlisted].any()
        assert not vb[unlisted].any()
        assert not kb[shuffled[-1], tail].any()
        assert np.abs(kb[shuffled]).reshape(-1, SMALL.d_model)[:length].max(axis=1).min() > 0

    # Garbage outside the sequence's positions is never read.
    kv_c = make_kv(SMALL, pool, fill=np.nan)
    assert np.array_equal(small.prefill(tokens, kv_c, shuffled), logits_a)


@pytest.mark.parametrize("length", [1, 7, 8, 300])
def test_decode_step_continues_prefill(small: TinyTransformer, length: int) -> None:
    tokens = make_prompt(length + 1, SMALL.vocab, seed=5)
    nb = SMALL.blocks_for(length + 1)
    table = np.arange(nb, dtype=np.int64)[::-1].copy()
    kv = make_kv(SMALL, nb)
    small.prefill(tokens[:length], kv, table)
    stepped = small.decode_step(int(tokens[length]), length, kv, table)
    whole = small.prefill(tokens, make_kv(SMALL, nb), table)
    np.testing.assert_allclose(stepped, whole, rtol=1e-4, atol=1e-5)


def test_generate_is_greedy_decode(small: TinyTransformer) -> None:
    tokens = make_prompt(10, SMALL.vocab)
    nb = SMALL.blocks_for(10 + 5)
    table = np.arange(nb, dtype=np.int64)
    kv = make_kv(SMALL, nb)
    first = int(np.argmax(small.prefill(tokens, kv, table)))
    snapshot = [(k.copy(), v.copy()) for k, v in kv]
    ids, outs = small.generate(first, 10, 5, kv, table)
    assert len(ids) == len(outs) == 5
    assert ids == [int(np.argmax(o)) for o in outs]
    assert np.array_equal(outs[0], small.decode_step(first, 10, snapshot, table))


def test_on_layer_sees_each_layer_done_and_the_next_untouched() -> None:
    config = dataclasses.replace(SMALL, layers=4)
    model = TinyTransformer(config)
    length = 11
    nb = config.blocks_for(length)
    table = np.array([5, 0, 3], dtype=np.int64)
    kv = make_kv(config, 6)
    calls: list[int] = []
    snapshots: list[KV] = []

    def on_layer(i: int) -> None:
        calls.append(i)
        snapshots.append([(k.copy(), v.copy()) for k, v in kv])

    model.prefill(make_prompt(length, config.vocab), kv, table, on_layer=on_layer)
    assert calls == list(range(config.layers))
    assert nb == len(table)
    for i, snap in enumerate(snapshots):
        for j, ((k_then, v_then), (k_now, v_now)) in enumerate(zip(snap, kv, strict=True)):
            if j <= i:  # written by the time layer i reported, and final
                assert np.array_equal(k_then, k_now)
                assert np.array_equal(v_then, v_now)
            else:
                assert not k_then.any()
                assert not v_then.any()
    for k, v in kv:  # every prompt position of every layer was written
        for cache in (k, v):
            rows = cache[table].reshape(-1, config.d_model)[:length]
            assert (np.abs(rows).max(axis=1) > 0).all()


CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from llmdd_async.demo.model import ModelConfig, TinyTransformer, make_prompt

    cfg = ModelConfig(**eval(sys.argv[1]))
    length, steps, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    model = TinyTransformer(cfg)
    nb = cfg.blocks_for(length + steps)
    table = np.arange(nb, dtype=np.int64)[::-1].copy()
    kv = [tuple(np.zeros((nb, *cfg.kv_block_shape), np.float32) for _ in "kv")
          for _ in range(cfg.layers)]
    first = model.prefill(make_prompt(length, cfg.vocab), kv, table)
    ids, outs = model.generate(int(np.argmax(first)), length, steps, kv, table)
    np.savez(out, first=first, ids=np.array(ids), logits=np.stack(outs))
    """
)


def run_in_process(config: ModelConfig, length: int, steps: int) -> dict[str, np.ndarray]:
    """What CHILD computes, here, but with another block table (placement must not matter)."""
    model = TinyTransformer(config)
    nb = config.blocks_for(length + steps)
    pool = 2 * nb
    table = np.random.default_rng(11).permutation(pool)[:nb].astype(np.int64)
    kv = make_kv(config, pool)
    first = model.prefill(make_prompt(length, config.vocab), kv, table)
    ids, outs = model.generate(int(np.argmax(first)), length, steps, kv, table)
    return {"first": first, "ids": np.array(ids), "logits": np.stack(outs)}


@pytest.mark.parametrize(
    ("config", "length", "steps"),
    [
        (SMALL, 23, 6),
        (ModelConfig(layers=2, heads=4, head_dim=32, vocab=300, block_size=16, seed=4), 290, 4),
    ],
    ids=["small", "medium"],
)
def test_bit_identical_across_processes(
    tmp_path: Path, config: ModelConfig, length: int, steps: int
) -> None:
    out = tmp_path / "child.npz"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    fields = repr(dataclasses.asdict(config))
    subprocess.run(
        [sys.executable, "-c", CHILD, fields, str(length), str(steps), str(out)],
        check=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    theirs = dict(np.load(out))
    ours = run_in_process(config, length, steps)
    assert theirs["ids"].tolist() == ours["ids"].tolist()
    for name in ("first", "logits"):
        assert theirs[name].dtype == ours[name].dtype == np.float32
        assert np.array_equal(theirs[name], ours[name])
        assert theirs[name].tobytes() == ours[name].tobytes()


def test_weights_are_determined_by_the_seed() -> None:
    a, b = TinyTransformer(SMALL), TinyTransformer(SMALL)
    other = TinyTransformer(dataclasses.replace(SMALL, seed=1))
    wa, wb, wo = all_weights(a), all_weights(b), all_weights(other)
    assert len(wa) == len(wb) == len(wo) == 3 + 6 * SMALL.layers
    for x, y, z in zip(wa, wb, wo, strict=True):
        assert x.dtype == np.float32
        assert x.flags.c_contiguous
        assert np.array_equal(x, y)
        assert not np.array_equal(x, z)
    assert np.array_equal(make_prompt(50, 97), make_prompt(50, 97))
    assert not np.array_equal(make_prompt(50, 97), make_prompt(50, 97, seed=2))


def test_bad_block_tables_are_rejected(small: TinyTransformer) -> None:
    tokens = make_prompt(9, SMALL.vocab)
    with pytest.raises(ValueError, match="cannot hold"):
        small.prefill(tokens, make_kv(SMALL, 3), np.arange(2, dtype=np.int64))
    with pytest.raises(ValueError, match="must lie in"):
        small.prefill(tokens, make_kv(SMALL, 3), np.array([0, 1, 3], dtype=np.int64))
