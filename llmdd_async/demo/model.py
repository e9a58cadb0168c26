"""A tiny decoder-only transformer in pure numpy (float32) with a paged KV cache.

Used by the demo that moves a paged KV cache between two processes, so it is deterministic and
bit-reproducible: only numpy, float32 throughout, no randomness after construction, no
threads of its own, and every matmul operand is either made C-contiguous or is a fixed view
(slice/transpose) of an array allocated C-contiguous here, so its strides depend only on the
shapes and the same BLAS call runs in every process and for every block table.

Architecture: token embedding, ``layers`` pre-norm blocks (RMSNorm, multi-head causal attention
with rotary position embedding, RMSNorm, SiLU MLP), final RMSNorm, untied unembedding.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["LayerWeights", "ModelConfig", "TinyTransformer", "make_prompt"]

F32 = np.float32
KVCache = Sequence[tuple[np.ndarray, np.ndarray]]

_EPS = F32(1e-6)
_ROPE_BASE = 10000.0
_Q_CHUNK = 256  # query rows per attention chunk


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the model and of its paged KV cache."""

    layers: int = 8
    heads: int = 8
    head_dim: int = 64
    vocab: int = 4096
    ffn_mult: int = 4
    block_size: int = 16  # tokens per KV block
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "vocab", "ffn_mult", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding), got {self.head_dim}")

    @property
    def d_model(self) -> int:
        """Hidden size: ``heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def kv_block_shape(self) -> tuple[int, int, int]:
        """Shape of one KV block of one layer (K or V): ``(block_size, heads, head_dim)``."""
        return (self.block_size, self.heads, self.head_dim)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V, over all layers, for one token."""
        return 2 * self.layers * self.heads * self.head_dim * 4

    def blocks_for(self, tokens: int) -> int:
        """Number of KV blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerWeights:
    """Weights of one transformer block (all float32, C-contiguous)."""

    attn_norm: np.ndarray  # [d]
    w_qkv: np.ndarray  # [d, 3d]: columns are q | k | v, each head-major ([heads, head_dim])
    w_o: np.ndarray  # [d, d]
    mlp_norm: np.ndarray  # [d]
    w_up: np.ndarray  # [d, ffn_mult * d]
    w_down: np.ndarray  # [ffn_mult * d, d]


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` on C-contiguous float32 operands, so the BLAS call is layout-independent."""
    return np.matmul(np.ascontiguousarray(a, dtype=F32), np.ascontiguousarray(b, dtype=F32))


def _rms_norm(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """RMSNorm over the last axis of a 2-D float32 array."""
    x = np.ascontiguousarray(x, dtype=F32)
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=F32)
    return x * (F32(1.0) / np.sqrt(ms + _EPS)) * gain


def _silu(x: np.ndarray) -> np.ndarray:
    """SiLU ``x * sigmoid(x)``, in place on a float32 array (returned)."""
    e = np.negative(x)
    with np.errstate(over="ignore"):  # exp(-x) -> inf gives x / inf = -0.0, as it should
        np.exp(e, out=e)
    e += F32(1.0)
    x /= e
    return x


def _causal_attention(
    q_h: np.ndarray, keys: np.ndarray, vals: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """Softmax attention of queries at ``positions`` over keys ``0..p``; returns ``[T, h, hd]``.

    ``q_h`` is C-contiguous ``[h, T, hd]`` (already scaled); ``keys`` and ``vals`` are
    ``[L, h, hd]`` prefixes of C-contiguous gathers. Queries go in chunks of ``_Q_CHUNK`` rows,
    each over only the keys it can see, which halves the work of a long prefill and keeps the
    score matrix small (no per-token or per-block Python loop).
    """
    h, t, hd = q_h.shape
    k_t = keys.transpose(1, 2, 0)  # [h, hd, L] view
    v_h = vals.transpose(1, 0, 2)  # [h, L, hd] view
    out = np.empty((t, h, hd), dtype=F32)
    for c0 in range(0, t, _Q_CHUNK):
        c1 = min(c0 + _Q_CHUNK, t)
        pos = positions[c0:c1]
        seen = int(pos.max()) + 1
        scores = np.matmul(q_h[:, c0:c1], k_t[:, :, :seen])  # [h, C, seen]
        future = np.arange(seen, dtype=np.int64)[None, :] > pos[:, None]  # [C, seen]
        if future.any():
            np.copyto(scores, F32(-np.inf), where=future[None])
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        denom = scores.sum(axis=-1, keepdims=True, dtype=F32)  # [h, C, 1]
        chunk = np.matmul(scores, v_h[:, :seen])  # [h, C, hd]
        chunk /= denom
        out[c0:c1] = chunk.transpose(1, 0, 2)
    return out


def _weights(
    rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, scale: float = 1.0
) -> np.ndarray:
    w = rng.standard_normal(shape, dtype=F32)
    w *= F32(scale / np.sqrt(fan_in))
    return np.ascontiguousarray(w)


class TinyTransformer:
    """Decoder-only transformer whose attention reads K/V back through a paged cache.

    The paged cache of one layer is a pair ``(k_cache, v_cache)``, each shaped
    ``[num_blocks, block_size, heads, head_dim]`` float32; a sequence's ``block_table`` (int64)
    maps its logical block ``j`` to physical block ``block_table[j]``. Scratch buffers are
    reused between calls (one set per calling thread); the model starts no threads itself.
    """

    config: ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        c = config
        d, ffn = c.d_model, c.ffn_mult * c.d_model
        rng = np.random.default_rng(c.seed)
        self.tok_emb = _weights(rng, (c.vocab, d), 1)
        self.blocks: list[LayerWeights] = []
        for _ in range(c.layers):
            self.blocks.append(
                LayerWeights(
                    attn_norm=F32(1.0) + _weights(rng, (d,), 1, 0.1),
                    w_qkv=_weights(rng, (d, 3 * d), d),
                    # Residual branches scaled down so the stream stays O(1) over depth.
                    w_o=_weights(rng, (d, d), d, 0.5),
                    mlp_norm=F32(1.0) + _weights(rng, (d,), 1, 0.1),
                    w_up=_weights(rng, (d, ffn), d),
                    w_down=_weights(rng, (ffn, d), ffn, 0.5),
                )
            )
        self.final_norm = F32(1.0) + _weights(rng, (d,), 1, 0.1)
        self.unembed = _weights(rng, (d, c.vocab), d)
        half = c.head_dim // 2
        self.inv_freq = (_ROPE_BASE ** (-np.arange(half, dtype=np.float64) / half)).astype(F32)
        self._local = threading.local()  # per-thread K and V gather buffers

    # -- pieces ---------------------------------------------------------------------------------

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Token ids ``[T]`` -> hidden ``[T, d_model]`` float32."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got {tokens.dtype}{tokens.shape}"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab})")
        return np.ascontiguousarray(self.tok_emb[tokens])

    def rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``cos`` and ``sin`` of the rotary angles, each ``[T, head_dim // 2]`` float32."""
        angles = np.asarray(positions).astype(F32)[:, None] * self.inv_freq[None, :]
        return np.cos(angles), np.sin(angles)

    @staticmethod
    def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate ``x`` ``[T, heads, head_dim]`` (rotate-half convention)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty(x.shape, dtype=F32)
        out[..., :half] = x1 * c - x2 * s
        out[..., half:] = x2 * c + x1 * s
        return out

    def _gather(self, cache: np.ndarray, table: np.ndarray, which: int) -> np.ndarray:
        """Copy blocks ``cache[table]`` into a reused C-contiguous scratch buffer.

        Reusing the buffer keeps a decode step from faulting in fresh pages for every layer; the
        result (values and strides) equals ``cache[table]``; ``table`` must be range-checked.
        """
        scratch: list[np.ndarray | None] | None = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = [None, None]
        n = table.shape[0]
        buf = scratch[which]
        if buf is None or buf.shape[0] < n:
            size = n if buf is None else max(n, 2 * buf.shape[0])
            buf = scratch[which] = np.empty((size, *self.config.kv_block_shape), F32)
        out = buf[:n]
        np.take(cache, table, axis=0, out=out, mode="clip")
        return out

    def _check_cache(self, k_cache: np.ndarray, v_cache: np.ndarray) -> None:
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (
                cache.dtype != F32
                or cache.ndim != 4
                or cache.shape[1:] != self.config.kv_block_shape
            ):
                raise ValueError(
                    f"{name} must be float32 [num_blocks, *{self.config.kv_block_shape}], "
                    f"got {cache.dtype}{cache.shape}"
                )

    def layer_forward(
        self,
        layer: int,
        x: np.ndarray,
        positions: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        block_table: np.ndarray,
    ) -> np.ndarray:
        """Run block ``layer`` on ``x`` ``[T, d]`` at ``positions``; writes then reads its KV.

        K and V of the tokens are written in place at ``(block_table[p // block_size],
        p % block_size)``; attention of each token covers positions ``0..p``, read back from the
        paged cache through ``block_table``.
        """
        c = self.config
        w = self.blocks[layer]
        positions = np.asarray(positions, dtype=np.int64)
        block_table = np.asarray(block_table, dtype=np.int64)
        t = x.shape[0]
        if x.shape != (t, c.d_model) or positions.shape != (t,) or t == 0:
            raise ValueError(f"x {x.shape} and positions {positions.shape} do not match")
        self._check_cache(k_cache, v_cache)
        length = int(positions.max()) + 1
        nblocks = c.blocks_for(length)
        if positions.min() < 0 or block_table.ndim != 1 or block_table.shape[0] < nblocks:
            raise ValueError(
                f"block_table of {block_table.shape} cannot hold positions up to {length - 1}"
            )
        table = block_table[:nblocks]
        if table.min() < 0 or table.max() >= k_cache.shape[0]:
            raise ValueError(f"block_table entries must lie in [0, {k_cache.shape[0]})")
        h, hd = c.heads, c.head_dim

        # Projections and rotary embedding.
        qkv = _matmul(_rms_norm(x, w.attn_norm), w.w_qkv).reshape(t, 3, h, hd)
        cos, sin = self.rope_tables(positions)
        q = self._rope(qkv[:, 0], cos, sin)
        k = self._rope(qkv[:, 1], cos, sin)

        # Write this chunk's K/V into the paged cache.
        phys = block_table[positions // c.block_size]
        slot = positions % c.block_size
        k_cache[phys, slot] = k
        v_cache[phys, slot] = qkv[:, 2]

        # Gather K/V of positions 0..length-1 back from the cache (C-contiguous copies).
        keys = self._gather(k_cache, table, 0).reshape(nblocks * c.block_size, h, hd)[:length]
        vals = self._gather(v_cache, table, 1).reshape(nblocks * c.block_size, h, hd)[:length]
        q_h = np.ascontiguousarray(q.transpose(1, 0, 2))  # [h, T, hd]
        q_h *= F32(1.0 / np.sqrt(hd))
        attn = _causal_attention(q_h, keys, vals, positions).reshape(t, c.d_model)
        x = x + _matmul(attn, w.w_o)

        # MLP.
        up = _silu(_matmul(_rms_norm(x, w.mlp_norm), w.w_up))
        return x + _matmul(up, w.w_down)

    def logits(self, x_last: np.ndarray) -> np.ndarray:
        """Final norm and unembedding: ``[d_model]`` -> ``[vocab]`` float32."""
        x2 = np.asarray(x_last, dtype=F32).reshape(1, self.config.d_model)
        return _matmul(_rms_norm(x2, self.final_norm), self.unembed)[0]

    # -- whole passes ---------------------------------------------------------------------------

    def _check_kv(self, kv: KVCache) -> None:
        if len(kv) != self.config.layers:
            raise ValueError(f"kv has {len(kv)} layers, the model {self.config.layers}")

    def prefill(
        self,
        tokens: np.ndarray,
        kv: KVCache,
        block_table: np.ndarray,
        on_layer: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Run the prompt (positions ``0..T-1``); return the logits of its last position.

        ``on_layer(i)`` is called right after layer ``i`` wrote its KV, before layer ``i + 1``.
        """
        self._check_kv(kv)
        x = self.embed(tokens)
        if x.shape[0] == 0:
            raise ValueError("prefill needs at least one token")
        positions = np.arange(x.shape[0], dtype=np.int64)
        for i, (k_cache, v_cache) in enumerate(kv):
            x = self.layer_forward(i, x, positions, k_cache, v_cache, block_table)
            if on_layer is not None:
                on_layer(i)
        return self.logits(x[-1])

    def decode_step(self, token: int, pos: int, kv: KVCache, block_table: np.ndarray) -> np.ndarray:
        """Run one token at ``pos`` (KV of positions ``< pos`` already cached); return logits."""
        self._check_kv(kv)
        x = self.embed(np.array([token], dtype=np.int64))
        positions = np.array([pos], dtype=np.int64)
        for i, (k_cache, v_cache) in enumerate(kv):
            x = self.layer_forward(i, x, positions, k_cache, v_cache, block_table)
        return self.logits(x[0])

    def generate(
        self, first_token: int, start_pos: int, steps: int, kv: KVCache, block_table: np.ndarray
    ) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decoding: feed ``first_token`` at ``start_pos``, then each argmax.

        Returns the ``steps`` new token ids and the logits each was taken from.
        """
        tokens: list[int] = []
        all_logits: list[np.ndarray] = []
        token = int(first_token)
        for step in range(steps):
            out = self.decode_step(token, start_pos + step, kv, block_table)
            token = int(np.argmax(out))
            tokens.append(token)
            all_logits.append(out)
        return tokens, all_logits


def make_prompt(length: int, vocab: int, seed: int = 1) -> np.ndarray:
    """Deterministic prompt of ``length`` int64 token ids in ``[0, vocab)``."""
    return np.random.default_rng(seed).integers(0, vocab, size=length, dtype=np.int64)
