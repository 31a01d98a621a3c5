"""AReaL's LR schedules (constant, linear, cosine with warm-up) and gradient checkpointing in
the FSDP2 engine, on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from services.config.loader import ConfigError, config_from_dict
from services.config.schema import ActorConfig, LorabusConfig, OptimizerConfig
from services.trainer.engines.fsdp2 import FSDP2Engine
from services.trainer.schedule import make_scheduler, warmup_steps
from tests.fixtures.tiny import tiny_qwen2
from tests.unit.test_trainer_precision import batch


def lrs(total: int, **opt) -> list[float]:
    o = OptimizerConfig(lr=1.0, **opt)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=o.lr)
    sched = make_scheduler(optimizer, o, total)
    out = []
    for _ in range(total):
        out.append(sched.get_last_lr()[0])
        optimizer.step()
        sched.step()
    return out


def test_constant_with_warmup_starts_at_zero_as_in_areal():
    assert lrs(6, warmup_steps=2) == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert lrs(4) == [1.0] * 4  # default proportion 0.001 of 4 steps: no warm-up


def test_linear_decays_to_zero_at_total_steps():
    got = lrs(6, lr_scheduler_type="linear", warmup_steps=2)
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])


def test_cosine_from_min_ratio_to_min_ratio():
    got = lrs(6, lr_scheduler_type="cosine", warmup_steps=2, min_lr_ratio=0.1)
    want = [0.1, 0.55] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) for s in range(2, 6)]
    assert got == pytest.approx(want)
    assert got[2] == pytest.approx(1.0)


def test_warmup_proportion_and_precedence():
    assert warmup_steps(OptimizerConfig(warmup_steps_proportion=0.25), 10) == 2
    assert warmup_steps(OptimizerConfig(warmup_steps=3, warmup_steps_proportion=0.5), 10) == 3
    assert lrs(8, warmup_steps_proportion=0.25)[:3] == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.optimizer.lr_scheduler_type=cosin", "did you mean 'cosine'"),
        ("actor.optimizer.warmup_steps=-1", "actor.optimizer.warmup_steps: -1 must be >= 0"),
        ("actor.optimizer.warmup_steps=10", "actor.optimizer.warmup_steps: 10 is not below total_train_steps 10"),
        (
            "actor.optimizer.warmup_steps_proportion=1.5",
            "actor.optimizer.warmup_steps_proportion: 1.5 must be in [0, 1)",
        ),
        ("actor.optimizer.min_lr_ratio=2", "actor.optimizer.min_lr_ratio: 2.0 must be in [0, 1]"),
        ("actor.optimizer.min_lr_ratio=0.1", "only cosine uses it"),
        ("actor.gradient_checkpointing=maybe", "actor.gradient_checkpointing"),
    ],
)
def test_new_fields_are_validated_by_name(override, message):
    tree = {"actor": {"path": "tiny"}, "train_dataset": {"path": "builtin:arith"}}
    with pytest.raises(ConfigError) as err:
        config_from_dict(tree, [override])
    assert message in str(err.value)


def cfg(**actor) -> LorabusConfig:
    opt = actor.pop("optimizer", OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=1e9))
    return LorabusConfig(
        total_train_steps=4,
        actor=ActorConfig(path="tiny", device="cpu", lora_rank=4, lora_alpha=8.0, seed=5, optimizer=opt, **actor),
    )


def test_engine_reports_the_lr_each_step_ran_with_and_resumes_it():
    opt = OptimizerConfig(type="sgd", lr=0.5, lr_scheduler_type="linear", warmup_steps=1)
    engine = FSDP2Engine(cfg(optimizer=opt), tiny_qwen2())
    got = [engine.train_step(batch(s), head_version=s).lr for s in range(3)]
    assert got == pytest.approx([0.0, 0.5, 0.5 * 2 / 3])
    resumed = FSDP2Engine(cfg(optimizer=opt), tiny_qwen2())
    resumed.load_state(engine.adapter_state(), engine.optimizer_state(), engine.step)
    assert resumed.train_step(batch(3), head_version=3).lr == pytest.approx(0.5 / 3)


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_update():
    engines = {gc: FSDP2Engine(cfg(gradient_checkpointing=gc), tiny_qwen2()) for gc in (False, True)}
    calls = {}
    for gc, e in engines.items():
        # inside the layer (recent transformers checkpoint `forward`, so the layer's own hooks
        # stay outside), and a pre-hook (the recompute stops early, once the last saved
        # tensor is back, before the post-hooks of the layer's last modules)
        attn = e.model.get_base_model().model.layers[0].self_attn
        calls[gc] = 0

        def count(*_, gc=gc):
            calls[gc] += 1

        attn.register_forward_pre_hook(count)
        for s in range(2):
            e.train_step(batch(s), head_version=s)
    # per micro-batch: the no-grad proximal pass, the train forward, and (checkpointed) its
    # recompute in the backward
    assert calls[True] == calls[False] * 3 // 2 and calls[False] > 0
    plain, ckpt = engines[False].adapter_state(), engines[True].adapter_state()
    assert any(v.abs().sum() > 0 for k, v in plain.items() if "lora_B" in k)
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-6, rtol=1e-5)
