"""A tiny random Llama (2 layers, hidden 128, head size 32, vocabulary 512) written with
transformers into a directory, for the tests and demos that run a real vLLM engine without
downloading a model: ``python _tiny_llama.py DIR`` or ``make(DIR)``. The same seed gives the
same weights, so two processes that make it get the same model."""

from __future__ import annotations

import sys
from pathlib import Path

#: The model's shape; vLLM's CPU attention wants a head size and block size multiple of 32.
CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
SEED = 1234


def make(out: str | Path) -> Path:
    """Writes the model (config and safetensors weights) into ``out``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, dtype="float32"))
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: _tiny_llama.py DIR")
    print(make(sys.argv[1]))
