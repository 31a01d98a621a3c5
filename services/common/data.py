"""Prompt sets: JSONL files (plain or GSM8K-style) and the shipped `arith` task.

`load_prompts(cfg)` is the only entry point services need. The `arith` task is generated, not
read, so that its train and held-out splits are identical on every machine: the universe of
problems is enumerated in a fixed order, shuffled with a fixed seed, and cut in two.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from msgspec import Struct

from services.common.config_schema import DatasetConfig

BUILTIN_PREFIX = "builtin:"
ARITH_SEED = 1234
ARITH_VALID_SIZE = 500
ARITH_MAX_OPERAND = 99
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


class DataError(ValueError):
    pass


class Prompt(Struct, frozen=True):
    prompt_id: str
    text: str
    answer: str


# --- the arith task --------------------------------------------------------------------------


def _arith_universe() -> list[Prompt]:
    """Every `a+b=` and every `a-b=` with a >= b (answers are never negative), operands 0-99."""
    problems = []
    for a in range(ARITH_MAX_OPERAND + 1):
        for b in range(ARITH_MAX_OPERAND + 1):
            problems.append(Prompt(prompt_id=f"add-{a}-{b}", text=f"{a}+{b}=", answer=str(a + b)))
            if a >= b:
                problems.append(
                    Prompt(prompt_id=f"sub-{a}-{b}", text=f"{a}-{b}=", answer=str(a - b))
                )
    return problems


def arith_split(split: str) -> list[Prompt]:
    """The `train` or `valid` split of the arith task; the two are disjoint and together cover
    the whole universe. Order is the seeded shuffle order (stable across Python versions:
    `random.Random(int).shuffle` is)."""
    if split not in ("train", "valid"):
        raise DataError(f"builtin:arith: split {split!r} is unknown; use train or valid")
    problems = _arith_universe()
    random.Random(ARITH_SEED).shuffle(problems)
    return problems[:ARITH_VALID_SIZE] if split == "valid" else problems[ARITH_VALID_SIZE:]


_BUILTINS = {"arith": arith_split}


def _load_builtin(spec: str) -> list[Prompt]:
    task, _, split = spec[len(BUILTIN_PREFIX) :].partition(":")
    if task not in _BUILTINS:
        raise DataError(
            f"path: {spec!r} names no shipped task; use one of "
            f"{[BUILTIN_PREFIX + name for name in _BUILTINS]} (optionally with :train or :valid)"
        )
    return _BUILTINS[task](split or "train")


# --- JSONL files -----------------------------------------------------------------------------


def final_answer(answer: str) -> str:
    """GSM8K answers are a worked solution ending in `#### <answer>`; keep only that answer."""
    m = _GSM8K_FINAL.search(answer)
    return m.group(1) if m else answer.strip()


def _field(record: dict, name: str, where: str, option: str) -> str:
    if name not in record:
        raise DataError(
            f"{where}: field {name!r} is missing (fields present: {sorted(record)}); "
            f"set train_dataset/valid_dataset.{option} to the field that holds it"
        )
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {name!r} must be a string or number, got {value!r}")
    return str(value)


def _load_jsonl(path: Path, prompt_field: str, answer_field: str) -> list[Prompt]:
    if not path.is_file():
        raise DataError(
            f"path: {str(path)!r} is not a file (relative paths are resolved against the "
            f"working directory {Path.cwd()}); point it at a JSONL file or a builtin: task"
        )
    prompts = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})")
            if not isinstance(record, dict):
                raise DataError(f"{where}: each line must be a JSON object, got {record!r:.80}")
            text = _field(record, prompt_field, where, "prompt_field")
            answer = final_answer(_field(record, answer_field, where, "answer_field"))
            if "prompt_id" in record:
                prompt_id = str(record["prompt_id"])
            elif "id" in record:
                prompt_id = str(record["id"])
            else:
                prompt_id = f"{path.stem}-{line_no}"
            if prompt_id in seen:
                raise DataError(
                    f"{where}: prompt_id {prompt_id!r} repeats line {seen[prompt_id]}; "
                    f"prompt ids must be unique within a file"
                )
            seen[prompt_id] = line_no
            prompts.append(Prompt(prompt_id=prompt_id, text=text, answer=answer))
    if not prompts:
        raise DataError(f"path: {str(path)!r} holds no prompts")
    return prompts


def load_prompts(cfg: DatasetConfig) -> list[Prompt]:
    """All prompts of the dataset in file (or split) order, cut to `max_prompts` if set.
    Shuffling is the consumer's business (see `epoch_order`): it needs the service's seed."""
    if not cfg.path:
        raise DataError("path: empty; give a JSONL file or builtin:arith")
    if cfg.path.startswith(BUILTIN_PREFIX):
        prompts = _load_builtin(cfg.path)
    else:
        prompts = _load_jsonl(Path(cfg.path), cfg.prompt_field, cfg.answer_field)
    if cfg.max_prompts is not None:
        if cfg.max_prompts < 1:
            raise DataError(f"max_prompts: {cfg.max_prompts} must be >= 1 (or null for all)")
        prompts = prompts[: cfg.max_prompts]
    return prompts


def epoch_order(prompts: list[Prompt], epoch: int, seed: int, shuffle: bool) -> list[Prompt]:
    """The order to visit prompts in during `epoch`: a fresh seeded permutation per epoch, so
    every service that shares the seed agrees on it."""
    if not shuffle:
        return list(prompts)
    order = list(prompts)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def write_jsonl(path: Path, prompts: list[Prompt]) -> None:
    """The shipped file layout: one `{"prompt_id","prompt","answer"}` object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_id": p.prompt_id, "prompt": p.text, "answer": p.answer}))
            f.write("\n")
