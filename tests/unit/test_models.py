"""The shipped tiny model: loads offline in HF format, tokenizes losslessly, generates, and is
partly (not fully) competent at its task."""

import json
from pathlib import Path

import pytest
import torch

from services.common.data import arith_split
from services.common.models import (
    ModelLoadError,
    decode_completion,
    encode_prompt,
    eos_token_ids,
    load_base_model,
    load_tokenizer,
    pad_token_id,
    resolve_device,
)
from services.common.rewards import arith_reward

MODEL_DIR = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_base_model(MODEL_DIR, dtype="float32", device="cpu").eval()


def test_model_dir_is_a_small_standard_checkpoint():
    files = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 5 * 1024 * 1024
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    # a class both transformers 4 and 5 know (vLLM builds may pin either)
    assert json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )


def test_tokenizer_round_trips_any_text(tok):
    for text in ["12+7=", "99-99=0", "Tom has 1,234 apples. Héllo ✓\n\ttabs"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # one token per byte, offset by the three specials
    assert tok.encode("0", add_special_tokens=False) == [ord("0") + 3]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_encode_prompt_prepends_bos_once(tok):
    ids = encode_prompt(tok, "12+7=")
    assert ids == [tok.bos_token_id, *[ord(c) + 3 for c in "12+7="]]
    # the tokenizer's own post-processor agrees, so a server given text sees the same ids
    assert tok("12+7=")["input_ids"] == ids


def test_decode_completion_stops_at_eos(tok):
    ids = tok.encode("19", add_special_tokens=False) + [tok.eos_token_id] + tok.encode("77", add_special_tokens=False)
    assert decode_completion(tok, ids) == "19"
    assert decode_completion(tok, tok.encode("5", add_special_tokens=False)) == "5"
    assert eos_token_ids(tok) == [2] and pad_token_id(tok) == 0


def test_model_matches_tokenizer_and_generates(model, tok):
    assert model.config.vocab_size == len(tok)
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([encode_prompt(tok, "12+7=")])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    assert out.shape[1] > ids.shape[1]
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="dtype: 'float8'"):
        load_base_model(MODEL_DIR, dtype="float8")
    with pytest.raises(ModelLoadError, match="could not be loaded"):
        load_base_model(tmp_path)
    with pytest.raises(ModelLoadError, match="actor.path: empty"):
        load_tokenizer("")
    with pytest.raises(ModelLoadError, match="device: 'gpu0'"):
        resolve_device("gpu0")
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_vision_language_model_is_refused_by_name_not_with_transformers_list(tmp_path):
    from transformers import Qwen2_5_VLConfig

    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 100}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32}
    Qwen2_5_VLConfig(text_config=text, vision_config=vision).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_base_model(tmp_path)
    message = str(info.value)
    assert message.startswith(
        f"actor.path: {str(tmp_path)!r} has a Qwen2_5_VLConfig, for which transformers has no causal LM"
    )
    assert "GPT2Config" not in message and len(message) < 400


def test_shipped_model_is_partly_competent_on_held_out_prompts(model, tok):
    """Greedy completions nearly always have the format (digits then eos), and are right often
    enough to give RL a signal but wrong often enough to leave it room."""
    prompts = arith_split("valid")[:200]
    by_len: dict[int, list] = {}
    for p in prompts:
        by_len.setdefault(len(p.text), []).append(p)
    formatted = correct = 0
    with torch.no_grad():
        for group in by_len.values():
            ids = torch.tensor([encode_prompt(tok, p.text) for p in group])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            for p, row in zip(group, out[:, ids.shape[1] :].tolist()):
                text = decode_completion(tok, row)
                formatted += tok.eos_token_id in row and text.isdigit()
                correct += arith_reward(p.text, text, p.answer)
    assert formatted / len(prompts) > 0.9
    assert 0.05 < correct / len(prompts) < 0.9


def test_left_padded_batch_generates_what_each_prompt_generates_alone(model, tok):
    """Rollouts and evaluators batch prompts of different lengths with left padding; the tiny
    model must give each row the completion it gets unbatched."""
    texts = ["7+5=", "63-28=", "99+99="]
    encoded = [encode_prompt(tok, t) for t in texts]
    width = max(map(len, encoded))
    ids = torch.full((len(texts), width), pad_token_id(tok))
    mask = torch.zeros_like(ids)
    for i, e in enumerate(encoded):
        ids[i, width - len(e) :] = torch.tensor(e)
        mask[i, width - len(e) :] = 1
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        batched = model.generate(input_ids=ids, attention_mask=mask, **kw)[:, width:].tolist()
        for e, row in zip(encoded, batched):
            alone = model.generate(
                input_ids=torch.tensor([e]), attention_mask=torch.ones(1, len(e), dtype=torch.long), **kw
            )
            assert decode_completion(tok, alone[0, len(e) :].tolist()) == decode_completion(tok, row)
