"""GSM8K as AReaL loads and scores it: the hub id from a local HF cache (offline), the prompt
through the chat template with AReaL's instruction, max_length filtering, and math-verify."""

from __future__ import annotations

import pytest

from services.common.data import DataError, load_prompts
from services.common.models import encode_prompt, load_tokenizer
from services.common.rewards import math_answer
from services.config import areal
from services.config.schema import DatasetConfig
from tests.fixtures import gsm8k


@pytest.fixture
def cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    gsm8k.hf_cache(tmp_path / "hf")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _cfg(tok, **kw) -> DatasetConfig:
    base = dict(
        path="openai/gsm8k",
        prompt_field="question",
        config_name="main",
        instruction=areal.GSM8K_INSTRUCTION,
        chat_template=True,
        tokenizer_path=str(tok),
    )
    return DatasetConfig(**{**base, **kw})


@pytest.mark.parametrize("template,bos", [(gsm8k.QWEN_TEMPLATE, False), (gsm8k.LLAMA_TEMPLATE, True)])
def test_hub_id_from_cache_with_areal_prompt(cache, tmp_path, template, bos):
    tok_dir = gsm8k.chat_tokenizer(tmp_path / "tok", template, bos)
    prompts = load_prompts(_cfg(tok_dir, split="test"))
    rows = gsm8k.rows("test")
    assert [p.answer for p in prompts] == [r["answer"].rsplit("####", 1)[1].strip() for r in rows]
    tok = load_tokenizer(tok_dir)
    for p, r in zip(prompts, rows):
        content = r["question"] + "\nPlease put your final answer within \\boxed{}."
        want = tok.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True, enable_thinking=False
        )
        want = list(want["input_ids"]) if hasattr(want, "keys") else list(want)
        assert encode_prompt(tok, p.text) == want  # the ids AReaL's workflow sends


def test_max_length_drops_long_prompts_as_areal(cache, tmp_path):
    tok_dir = gsm8k.chat_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tok_dir)
    lengths = [len(tok.encode(r["question"] + areal.GSM8K_INSTRUCTION)) for r in gsm8k.rows("train")]
    cut = sorted(lengths)[len(lengths) // 2]
    kept = load_prompts(_cfg(tok_dir, max_length=cut))
    assert len(kept) == sum(n <= cut for n in lengths) < len(lengths)
    with pytest.raises(DataError, match="holds no prompts of at most max_length 1 tokens"):
        load_prompts(_cfg(tok_dir, max_length=1))


def test_unknown_schema_names_fields_and_the_key(cache, tmp_path):
    with pytest.raises(DataError) as info:
        load_prompts(DatasetConfig(path="openai/gsm8k", config_name="main", split="test"))
    assert "field 'prompt' is missing (fields present: ['answer', 'question'])" in str(info.value)
    assert "prompt_field" in str(info.value)


@pytest.mark.parametrize(
    "completion,answer,reward",
    [
        ("so the answer is \\boxed{72}.", "72", 1.0),
        ("\\boxed{72}, and then 3 more apples", "72", 1.0),
        ("#### 72", "72", 1.0),
        ("####72", "72", 1.0),  # AReaL's reward gives 0
        ("#### 72\nthen 5 more", "72", 1.0),  # AReaL's reward gives 0
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The total is 3,600 plants.", "3,600", 1.0),
        ("She makes \\$18 every day.", "18", 1.0),  # AReaL's reward gives 0
        ("It was \\boxed{-7} degrees", "-7", 1.0),
        ("It was \\boxed{7} degrees", "-7", 0.0),
        ("72 clips, and 5 more", "72", 0.0),
        ("no idea", "72", 0.0),
    ],
)
def test_math_answer(completion, answer, reward):
    assert math_answer("", completion, answer) == reward
