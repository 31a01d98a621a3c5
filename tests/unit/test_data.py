import json
from pathlib import Path

import pytest

from services.common.data import (
    ARITH_VALID_SIZE,
    DataError,
    Prompt,
    arith_split,
    epoch_order,
    final_answer,
    load_prompts,
)
from services.config.schema import DatasetConfig

REPO = Path(__file__).resolve().parents[2]
TINY_DATA = REPO / "examples" / "tiny" / "data"


def _write(tmp_path: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _eval_arith(text: str) -> int:
    lhs = text.removesuffix("=")
    op = "+" if "+" in lhs else "-"
    a, b = lhs.split(op)
    return int(a) + int(b) if op == "+" else int(a) - int(b)


# --- arith -------------------------------------------------------------------------------------


def test_arith_splits_are_disjoint_and_cover_every_problem():
    train, valid = arith_split("train"), arith_split("valid")
    assert len(valid) == ARITH_VALID_SIZE
    train_texts, valid_texts = {p.text for p in train}, {p.text for p in valid}
    assert not train_texts & valid_texts
    # 100*100 additions + 5050 subtractions with a >= b
    assert len(train_texts | valid_texts) == len(train) + len(valid) == 10_000 + 5_050
    assert len({p.prompt_id for p in train + valid}) == len(train) + len(valid)


def test_arith_answers_are_the_true_results_and_never_negative():
    for p in arith_split("valid") + arith_split("train")[:2000]:
        assert int(p.answer) == _eval_arith(p.text) >= 0
        assert p.text.endswith("=")


def test_arith_split_is_deterministic_and_mixes_operations():
    assert arith_split("valid") == arith_split("valid")
    ops = {("+" if "+" in p.text else "-") for p in arith_split("valid")}
    assert ops == {"+", "-"}


def test_builtin_paths():
    assert load_prompts(DatasetConfig(path="builtin:arith")) == arith_split("train")
    assert load_prompts(DatasetConfig(path="builtin:arith:train")) == arith_split("train")
    assert load_prompts(DatasetConfig(path="builtin:arith:valid")) == arith_split("valid")
    assert len(load_prompts(DatasetConfig(path="builtin:arith", max_prompts=7))) == 7


@pytest.mark.parametrize(
    "path, needle",
    [("builtin:gsm8k", "names no shipped task"), ("builtin:arith:test", "split 'test'")],
)
def test_builtin_errors(path, needle):
    with pytest.raises(DataError, match=needle):
        load_prompts(DatasetConfig(path=path))


def test_shipped_jsonl_files_equal_the_builtin_splits():
    for split in ("train", "valid"):
        loaded = load_prompts(DatasetConfig(path=str(TINY_DATA / f"{split}.jsonl")))
        assert loaded == arith_split(split)
    first = json.loads((TINY_DATA / "valid.jsonl").read_text().splitlines()[0])
    assert sorted(first) == ["answer", "prompt", "prompt_id"]


# --- JSONL -------------------------------------------------------------------------------------


def test_plain_jsonl_with_ids_and_numeric_answers(tmp_path):
    path = _write(
        tmp_path,
        [
            '{"prompt_id": "a", "prompt": "1+1=", "answer": "2"}',
            "",
            '{"id": 7, "prompt": "2+2=", "answer": 4}',
            '{"prompt": "3+3=", "answer": "6"}',
        ],
    )
    assert load_prompts(DatasetConfig(path=str(path))) == [
        Prompt(prompt_id="a", text="1+1=", answer="2"),
        Prompt(prompt_id="7", text="2+2=", answer="4"),
        Prompt(prompt_id="d-4", text="3+3=", answer="6"),
    ]


def test_gsm8k_fields_and_final_answer(tmp_path):
    record = {
        "question": "Tom has 1,200 apples and buys 34 more. How many?",
        "answer": "He has 1,200 + 34 = <<1200+34=1234>>1234 apples.\n#### 1,234",
    }
    path = _write(tmp_path, [json.dumps(record)], name="gsm8k.jsonl")
    cfg = DatasetConfig(path=str(path), prompt_field="question", answer_field="answer")
    (p,) = load_prompts(cfg)
    assert p.text == record["question"]
    assert p.answer == "1,234"
    assert p.prompt_id == "gsm8k-1"


def test_final_answer_without_marker_is_the_stripped_answer():
    assert final_answer(" 42 \n") == "42"
    assert final_answer("steps\n####   -3.5\n") == "-3.5"


def test_missing_field_names_file_line_and_option(tmp_path):
    path = _write(tmp_path, ['{"prompt": "1+1=", "answer": "2"}', '{"question": "x", "answer": "1"}'])
    with pytest.raises(DataError) as err:
        load_prompts(DatasetConfig(path=str(path)))
    msg = str(err.value)
    assert f"{path}:2" in msg and "'prompt'" in msg and "prompt_field" in msg
    assert "question" in msg  # the fields that are there, to help pick the right one


def test_missing_answer_field_points_at_answer_field(tmp_path):
    path = _write(tmp_path, ['{"prompt": "1+1=", "solution": "2"}'])
    with pytest.raises(DataError, match=r"d.jsonl:1.*'answer'.*answer_field"):
        load_prompts(DatasetConfig(path=str(path)))


@pytest.mark.parametrize(
    "lines, needle",
    [
        (
            [
                '{"prompt": "1+1=", "answer": "2"',
            ],
            r":1: not valid JSON",
        ),
        (['["1+1=", "2"]'], r":1: each line must be a JSON object"),
        (['{"prompt": ["x"], "answer": "2"}'], r":1: field 'prompt' must be a string or number"),
        (
            ['{"prompt_id": "x", "prompt": "a", "answer": "1"}', '{"prompt_id": "x", "prompt": "b", "answer": "2"}'],
            r":2: prompt_id 'x' repeats line 1",
        ),
        (["", "  "], r"holds no prompts"),
    ],
)
def test_bad_files(tmp_path, lines, needle):
    path = _write(tmp_path, lines)
    with pytest.raises(DataError, match=needle):
        load_prompts(DatasetConfig(path=str(path)))


def test_missing_file_and_empty_path(tmp_path):
    with pytest.raises(DataError, match=r"nope.jsonl.*is not a file"):
        load_prompts(DatasetConfig(path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match=r"path: empty"):
        load_prompts(DatasetConfig(path=""))
    with pytest.raises(DataError, match=r"max_prompts: 0"):
        load_prompts(DatasetConfig(path="builtin:arith", max_prompts=0))


def test_epoch_order_is_a_seeded_permutation_per_epoch():
    prompts = arith_split("valid")[:50]
    e0, e1 = epoch_order(prompts, 0, seed=1, shuffle=True), epoch_order(prompts, 1, seed=1, shuffle=True)
    assert sorted(e0, key=lambda p: p.prompt_id) == sorted(prompts, key=lambda p: p.prompt_id)
    assert e0 == epoch_order(prompts, 0, seed=1, shuffle=True)
    assert e0 != e1 and e0 != prompts
    assert epoch_order(prompts, 3, seed=1, shuffle=False) == prompts


def test_prompt_takes_positional_or_keyword_fields():
    assert Prompt("id", "1+1=", "2") == Prompt(prompt_id="id", text="1+1=", answer="2")
