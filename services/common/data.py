"""Prompt sets: JSONL or Parquet files (plain or GSM8K-style), `datasets` directories, Hugging
Face hub ids (a copy in the local HF cache first, with no network; else through the optional
`datasets` library, when online), and the shipped `arith` task.

`load_prompts(cfg)` is the only entry point services need. A prompt's text is what the rollout
encodes: the prompt field plus `instruction`, rendered through the tokenizer's chat template when
`chat_template` is set (AReaL's RLVR prompt), so `encode_prompt(tok, text)` gives the ids AReaL's
`apply_chat_template(..., tokenize=True)` gives. The `arith` task is generated, not read, so that
its train and held-out splits are identical on every machine: the universe of problems is
enumerated in a fixed order, shuffled with a fixed seed, and cut in two.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from msgspec import Struct

from services.config.schema import DatasetConfig

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
                problems.append(Prompt(prompt_id=f"sub-{a}-{b}", text=f"{a}-{b}=", answer=str(a - b)))
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


def _read_jsonl(path: Path) -> list[tuple[str, object]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                records.append((where, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    return records


def _read_parquet(path: Path) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"path: {str(path)!r} is Parquet, which needs pyarrow (pip install pyarrow, or "
            "datasets, which brings it); or convert the file to JSONL"
        ) from None
    rows = pq.read_table(path).to_pylist()
    return [(f"{path}:row {i}", r) for i, r in enumerate(rows, start=1)]


def _read_hf(cfg: DatasetConfig, local: Path | None) -> list[tuple[str, object]]:
    """A `datasets` directory (save_to_disk) or a Hugging Face hub id, through `datasets`."""
    name = str(local) if local is not None else cfg.path
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"path: {name!r} is a Hugging Face dataset, which needs the `datasets` library "
            "(pip install datasets); or give a local JSONL or Parquet file"
        ) from None
    try:
        if local is not None:
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(cfg.path, cfg.config_name, split=cfg.split)
    except Exception as exc:  # offline, unknown id, gated: all the user's to fix
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"path: {name!r} (split {cfg.split!r}) cannot be loaded: {first}; a hub id needs the "
            "machine to be online (or the dataset in the local HF cache); or give a local "
            "JSONL/Parquet file"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(f"path: {name!r} has splits {sorted(ds)}, not {cfg.split!r}; set split")
        ds = ds[cfg.split]
    return [(f"{name}[{cfg.split}]:row {i}", r) for i, r in enumerate(ds, start=1)]


def _read_dir(cfg: DatasetConfig, path: Path) -> list[tuple[str, object]]:
    """A directory: saved by `datasets` (dataset_dict.json/state.json), or holding one split's
    JSONL/Parquet files, named after the split (`train.jsonl`, `main/train-00000-of-00001.parquet`);
    where a folder is named after `config_name` (a hub snapshot: `main/`, `socratic/`), only it."""
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _read_hf(cfg, path)
    if cfg.config_name and (path / cfg.config_name).is_dir():
        path = path / cfg.config_name
    files = sorted(f for f in path.rglob(f"{cfg.split}*") if f.suffix in (".jsonl", ".parquet") and f.is_file())
    if not files:
        raise DataError(
            f"path: {str(path)!r} is a directory with no {cfg.split}*.jsonl or {cfg.split}*.parquet "
            "file and no saved `datasets` dataset; set split, or point path at a file"
        )
    return [r for f in files for r in (_read_jsonl(f) if f.suffix == ".jsonl" else _read_parquet(f))]


def _is_hub_id(spec: str) -> bool:
    local_suffix = Path(spec).suffix in (".jsonl", ".json", ".parquet")
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", spec)) and not local_suffix and not Path(spec).exists()


def hub_snapshot(repo_id: str) -> Path | None:
    """The local HF cache's copy of dataset `repo_id` (as `huggingface-cli download --repo-type
    dataset` or `datasets` leave it), found without the network; None if there is none."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _read_records(cfg: DatasetConfig) -> tuple[str, list[tuple[str, object]]]:
    path = Path(cfg.path)
    if path.is_dir():
        return path.name, _read_dir(cfg, path)
    if path.is_file():
        records = _read_parquet(path) if path.suffix == ".parquet" else _read_jsonl(path)
        return path.stem, records
    if _is_hub_id(cfg.path):
        # the cached copy first: `datasets` asks the hub before its cache, and offline that is
        # about 24 s of retries before it fails
        cached = hub_snapshot(cfg.path)
        if cached is not None and any(cached.rglob(f"{cfg.split}*.parquet")):
            return cfg.path.replace("/", "-"), _read_dir(cfg, cached)
        return cfg.path.replace("/", "-"), _read_hf(cfg, None)
    raise DataError(
        f"path: {cfg.path!r} is not a file or directory (relative paths are resolved against the "
        f"working directory {Path.cwd()}); point it at a JSONL or Parquet file, a `datasets` "
        "directory, a Hugging Face id such as openai/gsm8k, or a builtin: task"
    )


def _load_records(cfg: DatasetConfig, shape: Callable[[str], str | None]) -> list[Prompt]:
    stem, records = _read_records(cfg)
    prompts = []
    seen: dict[str, str] = {}
    for n, (where, record) in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise DataError(f"{where}: each line must be a JSON object, got {record!r:.80}")
        text = shape(_field(record, cfg.prompt_field, where, "prompt_field") + cfg.instruction)
        answer = final_answer(_field(record, cfg.answer_field, where, "answer_field"))
        if "prompt_id" in record:
            prompt_id = str(record["prompt_id"])
        elif "id" in record:
            prompt_id = str(record["id"])
        else:
            line = where.rpartition(":")[2]  # JSONL: the line number, as ids always were
            prompt_id = f"{stem}-{line if line.isdigit() else n}"
        if prompt_id in seen:
            raise DataError(
                f"{where}: prompt_id {prompt_id!r} repeats {seen[prompt_id]}; "
                f"prompt ids must be unique within a dataset"
            )
        tail = where.rpartition(":")[2]
        seen[prompt_id] = f"line {tail}" if tail.isdigit() else tail
        if text is not None:
            prompts.append(Prompt(prompt_id=prompt_id, text=text, answer=answer))
    if not prompts:
        longest = f" of at most max_length {cfg.max_length} tokens" if cfg.max_length is not None else ""
        raise DataError(f"path: {cfg.path!r} holds no prompts{longest}")
    return prompts


def _shaper(cfg: DatasetConfig) -> Callable[[str], str | None]:
    """text -> the prompt text the rollout encodes, or None for a prompt max_length drops."""
    if not cfg.chat_template and cfg.max_length is None:
        return lambda text: text
    if not cfg.tokenizer_path:
        needs = "chat_template" if cfg.chat_template else f"max_length {cfg.max_length}"
        raise DataError(f"tokenizer_path: unset, but {needs} needs a tokenizer; set it (or actor.path)")
    from services.common.models import ModelLoadError, load_tokenizer

    try:
        tok = load_tokenizer(cfg.tokenizer_path)
    except (ModelLoadError, OSError, ValueError) as e:
        raise DataError(f"tokenizer_path: {cfg.tokenizer_path!r} cannot be loaded: {e}") from None
    if cfg.chat_template and not tok.chat_template:
        raise DataError(
            f"chat_template: true, but the tokenizer {cfg.tokenizer_path!r} has no chat template; "
            "use an instruct model's tokenizer, or set chat_template: false"
        )

    def shape(text: str) -> str | None:
        # AReaL counts the user content's tokens, special tokens included, before the template
        if cfg.max_length is not None and len(tok.encode(text)) > cfg.max_length:
            return None
        if not cfg.chat_template:
            return text
        rendered = tok.apply_chat_template(  # tokenize=False: one str
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert isinstance(rendered, str)
        # encode_prompt puts the bos token back in front
        bos = tok.bos_token
        return rendered[len(bos) :] if bos and rendered.startswith(bos) else rendered

    return shape


def load_prompts(cfg: DatasetConfig) -> list[Prompt]:
    """All prompts of the dataset in file (or split) order, cut to `max_prompts` if set.
    Shuffling is the consumer's business (see `epoch_order`): it needs the service's seed."""
    if not cfg.path:
        raise DataError("path: empty; give a JSONL/Parquet file, a dataset directory or id, or builtin:arith")
    if cfg.path.startswith(BUILTIN_PREFIX):
        prompts = _load_builtin(cfg.path)
    else:
        prompts = _load_records(cfg, _shaper(cfg))
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
