"""`actor.nproc_per_node`: validated, and turned into the trainer's torchrun command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.config.loader import ConfigError, config_from_dict
from services.local.launcher import child_commands, trainer_launcher

BASE = {
    "actor": {"path": "examples/tiny/model", "lora_rank": 8},
    "train_dataset": {"path": "builtin:arith"},
}


def test_default_is_one_process():
    cfg = config_from_dict(BASE, [])
    assert cfg.actor.nproc_per_node == 1
    assert trainer_launcher(cfg) == [sys.executable, "-m"]


@pytest.mark.parametrize("n", [0, -2])
def test_below_one_is_rejected_naming_the_field(n):
    with pytest.raises(ConfigError) as info:
        config_from_dict(BASE, [f"actor.nproc_per_node={n}"])
    [problem] = [p for p in info.value.problems if "nproc_per_node" in p]
    assert problem.startswith(f"actor.nproc_per_node: {n} must be >= 1")


def test_several_ranks_run_under_torchrun(tmp_path: Path):
    overrides = ["actor.nproc_per_node=2"]
    cfg = config_from_dict(BASE, overrides)
    children = child_commands(cfg, "cfg.yaml", overrides, tmp_path, evaluate=False)
    trainer = next(c for c in children if c.name == "trainer")
    assert trainer.argv == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "services.trainer",
        "--config",
        "cfg.yaml",
        *overrides,
    ]
    # only the trainer is multi-process
    others = [c for c in children if c is not trainer]
    assert all("torch.distributed.run" not in c.argv for c in others)
