"""How vLLM's paged KV tensors map onto one llmdd_async blocks cache.

Derived from the tensors ``register_kv_caches`` receives; nothing is hard-coded:

- CPU backend: one tensor per attention layer, ``[num_blocks, kv_heads, block_size,
  2 * head_dim]`` (K and V share the last dim): one llmdd tensor per layer, so one block of one
  layer is one contiguous span (``tensors_per_layer = 1``);
- CUDA FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_dim]``: K (``t[0]``) and V
  (``t[1]``) are two llmdd tensors per layer (``tensors_per_layer = 2``), registered through the
  torch device adapter.

Block ``b`` of vLLM is block ``b`` of every llmdd tensor. Two engines may transfer only when
:meth:`KVLayout.compat` of both is equal (dtype, block size, layout, heads, head size, layers);
the block count may differ.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from .._enums import DataType

__all__ = ["KVLayout", "derive_layout", "incompatibility"]

_DTYPES = {
    "float32": DataType.DT_FLOAT,
    "float16": DataType.DT_FLOAT16,
    "bfloat16": DataType.DT_BF16,
    "int8": DataType.DT_INT8,
    "uint8": DataType.DT_UINT8,
    "float8_e4m3fn": DataType.DT_UINT8,
    "float8_e5m2": DataType.DT_UINT8,
}


@dataclass(frozen=True)
class KVLayout:
    """The KV cache of one worker, as llmdd_async sees it."""

    layout: str  # "cpu" ([N, H, B, 2D] per layer) or "flash" ([2, N, B, H, D] per layer)
    dtype: str  # torch dtype name, e.g. "float32"
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    tensors_per_layer: int
    block_elems: int  # elements of one block of one llmdd tensor
    device: str  # "cpu", "cuda:0", ...

    @property
    def data_type(self) -> DataType:
        return _DTYPES[self.dtype]

    @property
    def num_tensors(self) -> int:
        return self.num_layers * self.tensors_per_layer

    @property
    def block_bytes(self) -> int:
        """Bytes of one vLLM block over all layers (what a transfer moves per block)."""
        return self.num_tensors * self.block_elems * self.data_type.itemsize

    def compat(self) -> dict[str, Any]:
        """What two engines must agree on to exchange blocks (not the block count)."""
        d = asdict(self)
        d.pop("num_blocks")
        d.pop("device")
        return d

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


def incompatibility(mine: KVLayout, theirs: dict[str, Any]) -> str | None:
    """Why a peer's layout (its :meth:`KVLayout.to_wire`) cannot exchange blocks, or None."""
    want = mine.compat()
    diffs = [
        f"{k}: here {want[k]!r}, peer {theirs.get(k)!r}" for k in want if theirs.get(k) != want[k]
    ]
    return "; ".join(diffs) if diffs else None


def _layer_order(name: str, pos: int) -> tuple[int, int]:
    nums = re.findall(r"\.(\d+)\.", f".{name}.")
    return (int(nums[0]) if nums else pos, pos)


def derive_layout(
    kv_caches: dict[str, Any], block_size: int
) -> tuple[KVLayout, list[str], list[Any]]:
    """Layout, layer names in layer order, and the llmdd tensors (``tensors_per_layer`` per
    layer, in layer order) of vLLM's ``kv_caches``.

    Raises:
        ValueError: an unknown, inconsistent or non-contiguous layout, naming the tensor.
    """
    if not kv_caches:
        raise ValueError("register_kv_caches got no KV tensors")
    names = [n for _, n in sorted((_layer_order(n, i), n) for i, n in enumerate(kv_caches))]
    first = kv_caches[names[0]]
    shape = tuple(int(d) for d in first.shape)
    dtype = str(first.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"KV dtype {dtype} of {names[0]} is not supported")
    if len(shape) == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        layout, tpl = "cpu", 1
        num_blocks, kv_heads, head_dim = shape[0], shape[1], shape[3] // 2
        block_elems = shape[1] * shape[2] * shape[3]
    elif len(shape) == 5 and shape[0] == 2 and shape[2] == block_size:
        layout, tpl = "flash", 2
        num_blocks, kv_heads, head_dim = shape[1], shape[3], shape[4]
        block_elems = shape[2] * shape[3] * shape[4]
    else:
        raise ValueError(
            f"KV tensor {names[0]} has shape {list(shape)}, which is neither the CPU layout "
            f"[num_blocks, kv_heads, {block_size}, 2*head_dim] nor FlashAttention's "
            f"[2, num_blocks, {block_size}, kv_heads, head_dim]"
        )
    tensors: list[Any] = []
    for name in names:
        t = kv_caches[name]
        if tuple(int(d) for d in t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
            raise ValueError(
                f"KV tensor {name} is {list(t.shape)} {t.dtype}, unlike {names[0]} "
                f"({list(shape)} {first.dtype}): one layout for all layers is needed"
            )
        if not t.is_contiguous():
            raise ValueError(f"KV tensor {name} is not contiguous")
        if layout == "cpu":
            tensors.append(t)
        else:
            tensors.extend((t[0], t[1]))
    kv = KVLayout(
        layout=layout,
        dtype=dtype,
        num_layers=len(names),
        num_blocks=num_blocks,
        block_size=block_size,
        kv_heads=kv_heads,
        head_dim=head_dim,
        tensors_per_layer=tpl,
        block_elems=block_elems,
        device=str(first.device),
    )
    return kv, names, tensors
