"""AReaL's dataset sections and run length: `train_dataset` / `valid_dataset` as AReaL loads them
(GSM8K recognised by its path, as AReaL's loader does), and epochs that stay epochs until a
service loads the config with its data, so translating reads no data and needs no network.
"""

from __future__ import annotations

from functools import partial

from services.config.areal.translator import Entry, Keep, NoEffect, Only, Row, Translator, apply, set_at

GSM8K_INSTRUCTION = "\nPlease put your final answer within \\boxed{}."
"""what AReaL's GSM8K RL loader appends to each question (areal/dataset/gsm8k.py)"""

_GSM8K = {
    "prompt_field": "question",
    "answer_field": "answer",
    "config_name": "main",
    "instruction": GSM8K_INSTRUCTION,
    "chat_template": True,
    "reward_fn": "services.common.rewards:math_answer",
}
"""AReaL's GSM8K RL dataset and reward (`"gsm8k" in path` with type rl): the question plus its
instruction as one user message through the chat template, scored by math-verify"""

_OWN_DATA_KEYS = ("prompt_field", "answer_field", "config_name", "reward_fn", "instruction", "chat_template")
"""lorabus's dataset keys, accepted in an AReaL file's dataset sections too (AReaL has no word for
a schema it does not recognise; these are the keys a loading error names)"""


_PER_SERVICE = "data loading is per service"


def _kind(name: str, x: Translator) -> None:
    kind = x.get(f"{name}.type")
    if kind is None:
        x.t.problems.append(f"{name}.type: missing; AReaL requires it (type: rl)")
    elif kind != "rl":
        x.refuse(f"{name}.type", "is not supported: lorabus trains RL on prompts (type: rl)")
    else:
        x.to(f"{name}.type", f"{name}.type")


def _gsm8k(name: str, x: Translator) -> None:
    """AReaL recognises GSM8K by its path (with type rl); so does lorabus, with AReaL's prompt."""
    path = str(x.get(f"{name}.path", ""))
    if "gsm8k" in path and x.get(f"{name}.type") == "rl":
        for key, value in _GSM8K.items():
            set_at(x.t.tree, f"{name}.{key}", value)
        x.t.rows.append(
            Row(
                f"{name}.path",
                path,
                f"{name}: " + ", ".join(f"{k} = {v!r}" for k, v in _GSM8K.items()),
                "AReaL's GSM8K loader and reward: the question and its instruction through the "
                "chat template, the answer after '####', scored by math-verify",
            )
        )


def _table(name: str, split: str) -> tuple[Entry, ...]:
    """One dataset section, in order (AReaL's default split is train for train_dataset, test for
    valid_dataset; only the training set is shuffled by default)."""
    train = name == "train_dataset"
    return (
        Keep(f"{name}.path", f"{name}.path"),
        partial(_kind, name),
        Keep(f"{name}.split", f"{name}.split", split),
        Keep(f"{name}.shuffle", f"{name}.shuffle", train),
        partial(_gsm8k, name),
        *(Keep(f"{name}.{key}", f"{name}.{key}", note="lorabus's own dataset key") for key in _OWN_DATA_KEYS),
        Keep(
            f"{name}.max_length",
            f"{name}.max_length",
            note="prompts longer than this many tokens are dropped, as AReaL does",
        ),
        NoEffect(f"{name}.pin_memory", "data loading is per service; nothing to pin"),
        NoEffect(f"{name}.num_workers", _PER_SERVICE),
        NoEffect(f"{name}.num_dataset_workers", _PER_SERVICE),
        NoEffect(f"{name}.scheduling_spec", _PER_SERVICE),
        NoEffect(f"{name}.setup_timeout", _PER_SERVICE),
        Only(
            f"{name}.dataset_kwargs",
            ({}, None),
            "is not supported: lorabus's loader takes path, split and the prompt/answer fields "
            f"({', '.join(_OWN_DATA_KEYS)})",
        ),
        NoEffect(
            f"{name}.batch_size",
            "the trainer's step is rollout.consumer_batch_size groups (made equal to it)"
            if train
            else "`lorabus evaluate` batches by itself (evaluator.batch_size)",
        ),
        Only(
            f"{name}.drop_last",
            True,
            "is not supported: a lorabus epoch is prompts // consumer_batch_size steps, the "
            "last partial batch dropped (set true)",
            note="AReaL's default: an epoch is prompts // batch_size steps",
        )
        if train
        else NoEffect(f"{name}.drop_last", "`lorabus evaluate` scores every held-out prompt"),
    )


_TABLES = {name: _table(name, split) for name, split in (("train_dataset", "train"), ("valid_dataset", "test"))}


def datasets(x: Translator) -> None:
    for name, table in _TABLES.items():
        if not any(k.startswith(name + ".") for k in x.flat):
            if x.has(name):
                x.noop(name, "no validation set")
            continue
        apply(x, table)
    if (
        x.has("train_dataset.batch_size")
        and x.has("rollout.consumer_batch_size")
        and x.get("train_dataset.batch_size") != x.get("rollout.consumer_batch_size")
    ):
        x.t.problems.append(
            f"train_dataset.batch_size: {x.get('train_dataset.batch_size')} differs from "
            f"rollout.consumer_batch_size {x.get('rollout.consumer_batch_size')}; a lorabus step "
            "trains on consumer_batch_size groups, one per prompt (make them equal)"
        )
    steps(x)


def steps(x: Translator) -> None:
    """Epochs stay epochs: they become steps when a service loads the config and its data
    (`services.config.loader`), so translating a file reads no data and needs no network."""
    epochs, steps = x.get("total_train_epochs"), x.get("total_train_steps")
    if epochs is None and steps is None:
        x.t.problems.append("total_train_epochs: missing; AReaL requires it (or total_train_steps)")
        return
    if epochs is not None:
        batch = x.get("train_dataset.batch_size", x.get("rollout.consumer_batch_size", 1))
        x.to(
            "total_train_epochs",
            "total_train_epochs",
            note=f"steps = {epochs} x (train prompts // batch {batch}), counted when the run starts and "
            "loads the data" + (", or total_train_steps where smaller" if steps is not None else ""),
        )
    if steps is not None:
        x.to("total_train_steps", "total_train_steps", note="AReaL stops at whichever ends first")
    elif x.has("total_train_steps"):  # written as null: AReaL's default
        x.noop("total_train_steps", "null: no step limit (AReaL's default); total_train_epochs ends the run")
