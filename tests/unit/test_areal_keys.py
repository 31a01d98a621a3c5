"""Every key of AReaL 1.0.4's experiment schema (its `GRPOConfig` dataclasses, read from its own
source) is honoured, refused or documented as having no effect when an AReaL file sets it —
never accepted and ignored.

Each key is set, in AReaL's own FSDP2 + SGLang LoRA example, to a value other than AReaL's
default; then exactly one of these holds:
- it became a lorabus value, and the translated tree differs from the example's (the value
  reaches lorabus's config: its effect there is the native field's own tests);
- it is a no-effect row with the reason written;
- it is a problem that names it (`field: value ...; fix`).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, cast

import pytest
from omegaconf import OmegaConf

from services.config import areal

try:
    from tests.fixtures.areal_schema import INSTALL, UNKNOWN, areal_keys

    KEYS = areal_keys()
except ImportError as e:  # only the package's absence skips; a parse failure is a failure
    pytest.skip(f"{e} (the AReaL schema is read from areal==1.0.4's source: {INSTALL})", allow_module_level=True)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "areal"
EXAMPLE = cast("dict[str, Any]", OmegaConf.to_container(OmegaConf.load(FIXTURES / "gsm8k_grpo_lora.yaml")))


def _other(default: Any) -> Any:
    """A value of the default's type that is not the default."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default + 0.37
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, list):
        return [*default, "other"]
    if isinstance(default, dict):
        return {**default, "other": 1}
    if default is None:
        return 7
    return "other"  # UNKNOWN: a value the default (a call or a name) cannot be


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[leaf] = value


def test_the_schema_walk_finds_areal_s_sections():
    # guards the walk itself: a parse that found nothing would make the test below vacuous
    for key in (
        "actor.lora_rank",
        "actor.reward_norm",
        "gconfig.n_samples",
        "rollout.max_head_offpolicyness",
        "sglang.max_loaded_loras",
        "vllm.max_lora_rank",
        "train_dataset.max_length",
        "saver.freq_steps",
    ):
        assert key in KEYS, key
    assert KEYS["actor.lora_rank"] == 32 and KEYS["gconfig.max_tokens"] == 32768
    assert len(KEYS) > 300


BASE = areal.translate(copy.deepcopy(EXAMPLE))


@pytest.mark.parametrize("key", sorted(KEYS))
def test_each_areal_key_is_honoured_refused_or_documented(key):
    tree = copy.deepcopy(EXAMPLE)
    written = areal.flatten(EXAMPLE).get(key, KEYS[key])
    value = _other(written if written is not UNKNOWN else KEYS[key])
    _set(tree, key, value)
    t = areal.translate(tree)
    # a mapping value lands as its own keys (scheduler.x.other)
    rows = [r for r in t.rows if r.areal == key or r.areal.startswith(key + ".")]
    refused = [p for p in t.problems if key in p]
    assert len(rows) + len(refused) >= 1, f"{key} = {value!r}: no row and no problem: accepted and ignored"
    if refused:
        # `field: value problem; fix`, the field first (two for a pair that must agree)
        assert all(re.match(r"^[\w.]+(?: / [\w.]+)?: ", p) for p in refused), refused
        return
    for row in rows:
        if row.became == "-":
            assert row.note, f"{key}: no effect, but no reason given"
        else:
            assert t.tree != BASE.tree, f"{key} = {value!r} became {row.became} but the translation did not change"
