"""Several runs' adapters on one base model in one trainer (`FSDP2Engine.sibling`): different
ranks and targets, each step moves only its own run's adapter and optimizer, exports load in
peft alone, checkpoints restore per run, and the base exists once."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
from peft import PeftModel

from proto.messages import Completion, Trajectory
from services.common import adapter_io
from services.config.schema import LorabusConfig
from services.trainer.engines.fsdp2 import FSDP2Engine
from tests.fixtures.tiny import tiny_qwen2


def config(
    run: str, rank: int, targets: list[str], lr: float = 0.05, temperature: float = 1.0, **actor
) -> LorabusConfig:
    """A run on the tiny model: its rank (alpha twice it), targets, learning rate and sampling
    temperature; `actor`: more actor keys (they win over these)."""
    return msgspec.convert(
        {
            "run": run,
            "total_train_steps": 10,
            "gconfig": {"n_samples": 3, "temperature": temperature, "lora_name": run},
            "actor": {
                "path": "tiny",
                "device": "cpu",
                "lora_rank": rank,
                "lora_alpha": 2.0 * rank,
                "target_modules": targets,
                "optimizer": {"lr": lr},
                **actor,
            },
        },
        LorabusConfig,
    )


def batch(run: str, seed: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(2):
        completions = [
            Completion(
                token_ids=[int(t) for t in torch.randint(2, 90, (4,), generator=g)],
                logprobs=[-4.5] * 4,
                versions=[0] * 4,
                reward=float(k),
            )
            for k in range(3)
        ]
        groups.append(
            Trajectory(
                run=run,
                trajectory_id=f"{run}-{seed}-{i}",
                grant_id="g",
                replica="r",
                prompt_id="p",
                prompt_token_ids=[3, 4, 5 + i],
                completions=completions,
                started_at=time.time(),
                finished_at=time.time(),
            )  # fmt: skip
        )
    return groups


@pytest.fixture
def engines():
    first = FSDP2Engine(config("a", 8, ["all-linear"]), base=tiny_qwen2())
    b = first.sibling(config("b", 4, ["q_proj", "v_proj"]), "b")
    c = first.sibling(config("c", 2, ["down_proj"]), "c")
    return first, b, c


def test_each_run_has_its_own_shape_and_the_base_exists_once(engines):
    a, b, c = engines
    assert a.model is b.model is c.model
    assert (a.lora.rank, b.lora.rank, c.lora.rank) == (8, 4, 2)
    assert b.lora.target_modules == ["q_proj", "v_proj"] and c.lora.target_modules == ["down_proj"]
    assert len(a.adapter_state()) == 2 * 7 * 2
    shapes = {k: tuple(t.shape) for k, t in b.adapter_state().items()}
    assert len(shapes) == 2 * 2 * 2
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 32)
    base_params = sum(p.numel() for n, p in a.model.named_parameters() if "lora_" not in n)
    assert base_params == sum(p.numel() for p in tiny_qwen2().parameters())
    lora_params = sum(p.numel() for n, p in a.model.named_parameters() if "lora_" in n)
    assert lora_params == sum(p.numel() for e in (a, b, c) for p in e.params)
    with pytest.raises(ValueError, match="already on the model"):
        a.sibling(config("b", 4, ["q_proj"]), "b")


def test_a_step_moves_only_its_own_run(engines):
    a, b, c = engines
    before = {run: e.adapter_state() for run, e in zip("abc", (a, b, c))}
    b.train_step(batch("b", 1), head_version=0)
    after = {run: e.adapter_state() for run, e in zip("abc", (a, b, c))}
    assert (a.step, b.step, c.step) == (0, 1, 0)
    assert any(not torch.equal(before["b"][k], after["b"][k]) for k in before["b"])
    for run in ("a", "c"):
        assert all(torch.equal(before[run][k], after[run][k]) for k in before[run]), run
    a.train_step(batch("a", 2), head_version=0)
    assert all(torch.equal(after["b"][k], t) for k, t in b.adapter_state().items())
    assert (a.step, b.step) == (1, 1) and a.optimizer is not b.optimizer


def test_a_runs_export_loads_in_peft_and_matches_the_shared_model(engines, tmp_path):
    a, b, _ = engines
    for _ in range(3):
        b.train_step(batch("b", 5), head_version=0)
    adapter_io.write_peft_dir(tmp_path, adapter_io.to_bytes(b.adapter_state()), b.lora_spec())
    alone = PeftModel.from_pretrained(tiny_qwen2(), tmp_path).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    b.activate()
    with torch.no_grad():
        shared = b.model(input_ids=ids).logits
        expected = alone(input_ids=ids).logits
        base = tiny_qwen2()(input_ids=ids).logits
    assert torch.allclose(shared, expected, atol=1e-5)
    assert not torch.allclose(expected, base, atol=1e-4)  # the step changed the output


def test_checkpoint_state_restores_one_run_without_touching_another(engines):
    a, b, _ = engines
    b.train_step(batch("b", 7), head_version=0)
    saved, optim, step = b.adapter_state(), b.optimizer_state(), b.step
    a_before = a.adapter_state()
    b.train_step(batch("b", 8), head_version=1)
    b.load_state(saved, optim, step)
    assert b.step == 1 and all(torch.equal(saved[k], t) for k, t in b.adapter_state().items())
    assert all(torch.equal(a_before[k], t) for k, t in a.adapter_state().items())
    c2 = b.sibling(config("d", 4, ["q_proj", "v_proj"]), "d")
    c2.drop()
    assert "d" not in a.model.peft_config


def test_a_runs_optimizer_state_is_what_torch_would_gather_for_it(engines):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    a, b, _ = engines
    a.train_step(batch("a", 3), head_version=0)
    b.train_step(batch("b", 4), head_version=0)
    for e in (a, b):
        got = e.optimizer_state()
        want = get_optimizer_state_dict(e.model, e.optimizer, options=StateDictOptions(full_state_dict=True))
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys() and got["state"]
        for name, values in want["state"].items():
            assert values.keys() == got["state"][name].keys()
            for k, t in values.items():
                assert torch.equal(got["state"][name][k], t) and got["state"][name][k] is not t  # a copy
