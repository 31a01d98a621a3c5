"""An AReaL experiment file submitted as a run (services/config/areal_run.py): translated as
`lorabus up` translates it, it becomes native run keys that the registry's check accepts as it
accepts any run file; a base model other than the fleet's is refused, and the fleet settings it
gives otherwise are named, not taken."""

from __future__ import annotations

import pytest
import yaml

from services.config import runconfig
from services.config.loader import ConfigError, load_config

FLEET = "examples/tiny.yaml"


@pytest.fixture
def fleet():
    return load_config(FLEET, ["run_dir=/tmp/fleet-x"]), runconfig.fleet_tree(FLEET, ["run_dir=/tmp/fleet-x"])


def areal_file(tmp_path, **changes) -> str:
    tree = yaml.safe_load(open("examples/areal_tiny.yaml"))
    tree["trial_name"] = "trial7"
    tree["actor"]["lora_rank"] = 4
    tree["actor"]["optimizer"]["lr"] = 5e-4
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "areal_run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_an_areal_file_becomes_its_run_keys(fleet, tmp_path, capsys):
    cfg_fleet, raw = fleet
    tree, cfg = runconfig.load_run(cfg_fleet, raw, areal_file(tmp_path, rollout__backend="sglang:d4"))
    # native run keys only: the registry's check (the same call) takes them as any run file
    assert not runconfig.outside_keys(tree) and "cluster" not in tree and "run_dir" not in tree
    assert runconfig.run_config(cfg_fleet, raw, tree) == cfg
    assert (cfg.run, cfg.actor.lora_rank, cfg.actor.optimizer.lr) == ("tiny-trial7", 4, 5e-4)
    assert cfg.run_dir == "/tmp/fleet-x/runs/tiny-trial7" and cfg.total_train_steps == 40
    # the fleet's processes, not the file's allocation
    assert (cfg.rollout.engine, cfg.rollout.replicas) == (cfg_fleet.rollout.engine, cfg_fleet.rollout.replicas)
    err = capsys.readouterr().err
    assert "is an AReaL experiment file; as a run of fleet" in err and "actor.lora_rank" in err
    assert "fleet settings of" in err and "rollout.replicas: 4 (the fleet's: 2)" in err


def test_another_base_model_is_refused(fleet, tmp_path):
    cfg_fleet, raw = fleet
    with pytest.raises(ConfigError) as e:
        runconfig.load_run(cfg_fleet, raw, areal_file(tmp_path, actor__path="examples/other/model"))
    assert e.value.problems == [
        "actor.path: 'examples/other/model' is not the fleet's base model 'examples/tiny/model'; every run of a "
        "fleet trains one adapter on the fleet's base model (submit it to a fleet of 'examples/other/model', or "
        "set actor.path to the fleet's)"
    ]


def test_translation_problems_are_the_areal_loaders(fleet, tmp_path):
    cfg_fleet, raw = fleet
    with pytest.raises(ConfigError) as e:
        runconfig.load_run(cfg_fleet, raw, areal_file(tmp_path, actor__lora_rank=0))
    assert any(p.startswith("actor.lora_rank: 0") for p in e.value.problems), e.value.problems
