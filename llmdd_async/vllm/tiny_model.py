"""A tiny Llama with random weights, saved locally: vLLM runs it offline, on CPU, in seconds.

::

    python -m llmdd_async.vllm.tiny_model DIR [--layers 4] [--hidden 128] [--seed 0]

writes ``DIR/config.json``, ``DIR/model.safetensors`` and (unless ``--no-tokenizer``) a
byte-level tokenizer (every UTF-8 byte one token, no merges), so ``vllm serve DIR`` takes text
prompts with nothing fetched from a hub. Weights are normal (std 0.2) from ``--seed``: greedy
tokens are distinct and decisive, and the same on every run. Nothing is rewritten when
``DIR/model.safetensors`` exists. Needs ``torch`` and ``transformers`` (vLLM's own
dependencies); importing this module imports neither.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["BOS", "EOS", "VOCAB", "main", "make_tiny_llama"]

VOCAB = 512  #: vocabulary size of the model (the tokenizer uses the first 258 ids)
BOS, EOS = "<s>", "</s>"  #: special tokens of the tokenizer (ids 256, 257)


def _save_tokenizer(path: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.save_pretrained(str(path))
    ids = tok.get_vocab(with_added_tokens=True)
    return ids[BOS], ids[EOS]


def make_tiny_llama(
    path: Path | str,
    layers: int = 4,
    hidden: int = 128,
    seed: int = 0,
    tokenizer: bool = False,
) -> Path:
    """Save a Llama with random (normal, std 0.2) weights under ``path`` (created if needed)
    and return ``path``; ``tokenizer``: also save a byte-level tokenizer (text prompts)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    special: dict[str, Any] = {"torch_dtype": "float32"}
    if tokenizer:
        bos, eos = _save_tokenizer(path)
        special.update(bos_token_id=bos, eos_token_id=eos)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **special,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m llmdd_async.vllm.tiny_model", description=__doc__.split("\n")[0]
    )
    p.add_argument("dir", type=Path, help="where to save the model (created if needed)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128, help="a multiple of 64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tokenizer", action="store_true", help="weights only (token-id prompts)")
    a = p.parse_args(argv)
    out = make_tiny_llama(a.dir, a.layers, a.hidden, a.seed, tokenizer=not a.no_tokenizer)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
