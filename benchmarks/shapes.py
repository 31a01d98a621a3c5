"""Model shapes the GPU benchmarks build from a config (random weights, nothing downloaded).

Llama architecture with Qwen2.5's dimensions: transformers 5 attaches Qwen2's own tokenizer class
to any qwen2 checkpoint, while a llama checkpoint keeps the byte-level tokenizer the tiny task
ships (`examples/tiny/model`), which every benchmark run uses. The difference from Qwen2 is the
bias of q/k/v (0.02 % of the parameters); the matmuls, the KV cache and the LoRA targets match.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SHAPES: dict[str, dict] = {
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "model"


def llama_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build(shape: str, device, dtype, seed: int = 0):
    """The model with random weights, made directly on `device` in `dtype`."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(shape))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def write_model_dir(shape: str, directory: Path, device="cuda") -> Path:
    """A loadable HF directory: random bf16 weights of `shape` plus the tiny task's tokenizer."""
    import torch

    if (directory / "config.json").exists():
        return directory
    model = build(shape, device, torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER_DIR / name, directory / name)
    return directory
