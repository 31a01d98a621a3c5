"""bf16 compute must not lose adapter updates: the LoRA masters, their gradients and Adam's
state are fp32, so a bf16 run's update equals the fp32 run's up to the rounding of the
forward pass, even at learning rates far below a bf16 ulp of the weights."""

from __future__ import annotations

import copy

import torch

from proto.messages import Completion, Trajectory
from services.config.schema import ActorConfig, LorabusConfig, OptimizerConfig
from services.trainer.engines.fsdp2 import FSDP2Engine
from services.trainer.lora import lora_parameters
from tests.fixtures.tiny import tiny_qwen2

STEPS = 3
LR = 1e-5
"""a bf16 ulp of a LoRA-A entry of this model (|A| ~ 0.1) is ~5e-4: 50 Adam steps' worth"""


def batch(step: int, vocab: int = 97) -> list[Trajectory]:
    g = torch.Generator().manual_seed(step)
    groups = []
    for i in range(2):
        completions = [
            Completion(
                token_ids=torch.randint(1, vocab, (6,), generator=g).tolist(),
                logprobs=[-4.6] * 6,
                versions=[step] * 6,
                reward=float(j % 2),
            )
            for j in range(4)
        ]
        groups.append(
            Trajectory(
                run="t",
                trajectory_id=f"s{step}g{i}",
                grant_id="x",
                replica="r",
                prompt_id=str(i),
                prompt_token_ids=torch.randint(1, vocab, (5,), generator=g).tolist(),
                completions=completions,
                started_at=0.0,
                finished_at=1.0,
            )
        )
    return groups


def engine(dtype: str, base) -> FSDP2Engine:
    cfg = LorabusConfig(
        actor=ActorConfig(
            path="tiny",
            dtype=dtype,
            device="cpu",
            lora_rank=4,
            lora_alpha=8.0,
            seed=3,
            optimizer=OptimizerConfig(type="adam", lr=LR, gradient_clipping=1e9),
        )
    )
    return FSDP2Engine(cfg, base)


def masters(e: FSDP2Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in lora_parameters(e.model)}


def test_bf16_run_keeps_the_fp32_runs_adapter_update():
    base = tiny_qwen2(seed=0)
    # Both runs see the same base weights (bf16-representable), so what differs is only the
    # precision of the forward arithmetic.
    rounded = copy.deepcopy(base).to(torch.bfloat16).float()
    e32, e16 = engine("float32", rounded), engine("bfloat16", copy.deepcopy(base).to(torch.bfloat16))
    assert {p.dtype for p in e16.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    with torch.no_grad():  # the same fp32 initial adapter in both
        for (_, p16), (_, p32) in zip(lora_parameters(e16.model), lora_parameters(e32.model)):
            p16.copy_(p32)
    start32, start16 = masters(e32), masters(e16)  # each run against its own start
    for s in range(STEPS):
        e32.train_step(batch(s), head_version=s)
        e16.train_step(batch(s), head_version=s)
    end32, end16 = masters(e32), masters(e16)

    a_keys = [k for k in start32 if ".lora_A." in k]
    d32 = torch.cat([(end32[k] - start32[k]).flatten() for k in start32])
    d16 = torch.cat([(end16[k] - start16[k]).flatten() for k in start32])
    d16_a = torch.cat([(end16[k] - start16[k]).flatten() for k in a_keys])
    # Lost updates (a bf16 adapter) leave nearly every A entry where it was.
    assert (d16_a == 0).float().mean() < 0.01
    # What is left is the forward's bf16 rounding: a few per cent of the update, direction kept.
    rel = float((d16 - d32).norm() / d32.norm())
    cos = float(torch.nn.functional.cosine_similarity(d16, d32, dim=0))
    assert rel < 0.15 and cos > 0.99, (rel, cos)
    assert 0.9 < float(d16.norm() / d32.norm()) < 1.1

    # The adapter leaves once, in the serving dtype the spec names; the masters stay fp32.
    published = e16.adapter_state()
    assert e16.lora_spec().dtype == "bfloat16"
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    assert {p.dtype for p in e16.params} == {torch.float32}
    for group in e16.optimizer.state.values():
        assert {t.dtype for t in group.values() if t.dim() > 0} == {torch.float32}


def test_bf16_checkpoint_keeps_the_fp32_masters():
    e16 = engine("bfloat16", tiny_qwen2(seed=0))
    e16.train_step(batch(0), head_version=0)
    adapter, optim = e16.adapter_state(), e16.optimizer_state()
    want = masters(e16)
    resumed = engine("bfloat16", tiny_qwen2(seed=0))
    resumed.load_state(adapter, optim, 1)
    got = masters(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)
