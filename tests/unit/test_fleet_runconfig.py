"""A run file laid over a fleet config: what a run may set, what it inherits, what it must not
share with another run, and the stored form the run table keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.config import runconfig as rc
from services.config.loader import ConfigError, load_config

FLEET = "examples/tiny.yaml"
OVERRIDES = ["run_dir=/tmp/fleet-x"]


@pytest.fixture
def fleet():
    return load_config(FLEET, OVERRIDES), rc.fleet_tree(FLEET, OVERRIDES)


def write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_run_keys_override_and_the_rest_is_the_fleets(fleet, tmp_path):
    cfg0, raw = fleet
    path = write(
        tmp_path,
        {
            "run": "r4",
            "gconfig": {"lora_name": "r4lora", "n_samples": 4},
            "actor": {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "rollout": {"max_head_offpolicyness": 1, "consumer_batch_size": 4},
            "fleet": {"share": 2.5},
            "total_train_steps": 7,
        },
    )
    tree, cfg = rc.load_run(cfg0, raw, path)
    assert tree["run"] == "r4"
    assert (cfg.run, cfg.gconfig.lora_name, cfg.rollout.lora_name) == ("r4", "r4lora", "r4lora")
    assert (cfg.actor.lora_rank, cfg.actor.lora_alpha, cfg.actor.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    assert (cfg.rollout.max_head_offpolicyness, cfg.rollout.consumer_batch_size) == (1, 4)
    assert cfg.rollout.max_concurrent == 4 and cfg.rollout.keep_versions == 2  # derived from the run's values
    assert cfg.fleet.share == 2.5 and cfg.total_train_steps == 7
    # inherited from the fleet file as written
    assert cfg.gconfig.max_new_tokens == cfg0.gconfig.max_new_tokens
    assert cfg.actor.optimizer.lr == cfg0.actor.optimizer.lr
    assert cfg.valid_dataset.reward_fn == cfg0.train_dataset.reward_fn
    # the fleet's own, resolved with the fleet's run_dir
    assert cfg.actor.path == cfg0.actor.path and cfg.rollout.replicas == cfg0.rollout.replicas
    assert cfg.store.uri == cfg0.store.uri == "file:///tmp/fleet-x/store"
    # the run's own places, under the fleet's run_dir
    assert cfg.run_dir == "/tmp/fleet-x/runs/r4"
    assert cfg.actor.checkpoint_dir == "/tmp/fleet-x/runs/r4/checkpoints"
    assert cfg.exporter.uri == "file:///tmp/fleet-x/runs/r4/export"
    assert rc.conflicts(cfg, [cfg0]) == []


def test_fleet_keys_and_misspellings_are_reported_together(fleet, tmp_path):
    cfg0, raw = fleet
    path = write(
        tmp_path,
        {"run": "bad", "actor": {"path": "other", "lora_rnak": 3}, "rollout": {"replicas": 3}, "bus": {"url": "x"}},
    )
    with pytest.raises(ConfigError) as err:
        rc.load_run(cfg0, raw, path)
    problems = err.value.problems
    assert any(p.startswith("actor.path: 'other' is a fleet setting") and "actor.lora_rank" in p for p in problems)
    assert any(p.startswith("rollout.replicas: 3 is a fleet setting") for p in problems)
    assert any(p.startswith("bus: ") and "fleet setting" in p for p in problems)
    assert any(p.startswith("actor.lora_rnak") and "did you mean actor.lora_rank" in p for p in problems)
    assert str(path) in str(err.value)


def test_bad_run_values_get_the_loaders_messages(fleet):
    cfg0, raw = fleet
    with pytest.raises(ConfigError) as err:
        rc.run_config(cfg0, raw, {"run": "x", "actor": {"lora_rank": 0}, "rollout": {"max_head_offpolicyness": -1}})
    text = "\n".join(err.value.problems)
    assert "actor.lora_rank: 0 must be >= 1" in text
    assert "rollout.max_head_offpolicyness: -1 must be >= 0" in text
    with pytest.raises(ConfigError) as err:
        rc.run_config(cfg0, raw, {"run": "x", "fleet": {"share": 0}})
    assert err.value.problems == ["fleet.share: 0.0 must be > 0 (a run's weight in the fleet's fair share; 1 is even)"]
    with pytest.raises(ConfigError, match="run: 'a.b' is not a valid subject token"):
        rc.run_config(cfg0, raw, {"run": "a.b"})


def test_conflicts_name_the_shared_field(fleet, tmp_path):
    cfg0, raw = fleet
    same_name = rc.run_config(cfg0, raw, {"run": cfg0.run})
    assert rc.conflicts(same_name, [cfg0])[0].startswith(f"run: {cfg0.run!r} is already a run of this fleet")
    # a fleet file that pins its checkpoint directory gives every run the same one
    pinned_raw = {**raw, "actor": {**raw["actor"], "checkpoint_dir": "/tmp/ckpt"}}
    a = rc.run_config(cfg0, pinned_raw, {"run": "a"})
    b = rc.run_config(cfg0, pinned_raw, {"run": "b"})
    (problem,) = rc.conflicts(b, [a])
    assert problem.startswith("actor.checkpoint_dir: '/tmp/ckpt' is run 'a''s too") and "${run_dir}" in problem


def test_stored_form_has_no_connection_sections_and_restores(fleet):
    cfg0, raw = fleet
    cfg = rc.run_config(cfg0, raw, {"run": "s", "actor": {"lora_rank": 2}})
    kept = rc.stored(cfg)
    assert not {"bus", "store", "metrics"} & set(kept)
    assert rc.restore(kept, cfg0) == cfg


def test_a_fleet_config_is_itself_a_valid_run(fleet):
    """`lorabus up --config FILE` is a fleet with one run: its own file passes as a run."""
    cfg0, raw = fleet
    run_part = {k: v for k, v in raw.items() if k in ("experiment_name", "trial_name", "gconfig", "train_dataset")}
    cfg = rc.run_config(cfg0, raw, run_part)
    assert cfg.run == cfg0.run and cfg.gconfig == cfg0.gconfig
