"""Loading the base model and tokenizer, and the one way prompts are turned into token ids.

Trainer, rollouts, exporter and evaluators must agree token for token on what a prompt is
(the trainer recomputes logprobs over the ids a rollout generated), so they all encode with
`encode_prompt` and decode with `decode_completion`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from services.common.adapter_io import DTYPES


class ModelLoadError(RuntimeError):
    pass


def resolve_device(device: str) -> torch.device:
    """`auto`: this process's GPU when CUDA is present (torchrun's LOCAL_RANK, else the first),
    else cpu; anything else is passed to torch. The one reading of `actor.device`,
    `rollout.device` and `evaluator.device`."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"device: {device!r} is not a torch device ({exc}); use auto, cpu or cuda[:N]") from exc


def _source(path: str | Path) -> str:
    """A local directory, or a hub id (which transformers resolves from its cache/offline)."""
    path = str(path)
    if not path:
        raise ModelLoadError("actor.path: empty; give a local model directory or a HF model id")
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(_source(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"tokenizer {str(path)!r}: could not be loaded ({exc})") from exc


def load_base_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(_source(path), dtype=DTYPES[dtype])
    except (OSError, ValueError) as exc:
        if "Unrecognized configuration class" in str(exc):  # its message lists every causal LM there is
            config = str(exc).split("<class '", 1)[-1].split("'>", 1)[0].rsplit(".", 1)[-1]
            raise ModelLoadError(
                f"actor.path: {str(path)!r} has a {config}, for which transformers has no causal LM (a "
                "vision-language, encoder or speech model); lorabus trains decoder-only text models "
                "(AutoModelForCausalLM: Qwen, Llama, Mistral, ...); give one of those"
            ) from exc
        raise ModelLoadError(f"model {str(path)!r}: could not be loaded ({exc})") from exc
    # transformers wraps `to` with functools.wraps(nn.Module.to), which mypy reads as unbound
    return model.to(resolve_device(device))  # type: ignore[arg-type]


def encode_prompt(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a prompt: the text's own tokens, after the bos token if the tokenizer has
    one. Done by hand rather than by the tokenizer's post-processor, whose behaviour differs
    between tokenizers (Llama adds bos, Qwen has none)."""
    ids = tok.encode(text, add_special_tokens=False)
    if tok.bos_token_id is not None:
        ids = [tok.bos_token_id, *ids]
    return ids


def eos_token_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a completion."""
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer {tok.name_or_path!r} has no eos token; completions could never end")
    return [tok.eos_token_id]


def pad_token_id(tok: PreTrainedTokenizerBase) -> int:
    """Id for padding batches (masked out, so any id works; the tokenizer's own when it has one)."""
    return tok.pad_token_id if tok.pad_token_id is not None else eos_token_ids(tok)[0]


def decode_completion(tok: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Completion text as a reward function sees it: up to the first eos, special tokens
    dropped."""
    eos = set(eos_token_ids(tok))
    end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    # one list of ids decodes to one str; transformers types decode for batches too
    return tok.decode(list(ids[:end]), skip_special_tokens=True)  # type: ignore[return-value]
