"""The FSDP2 engine: a real step in one process, and the same step sharded over 2 gloo ranks
under torchrun gives the same adapter.

This file is also the torchrun worker: `python -m torch.distributed.run --nproc_per_node=2
tests/integration/test_fsdp2_torchrun.py OUT` writes rank 0's adapter after the steps to OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # when run as a torchrun worker script
    sys.path.insert(0, str(REPO))

from proto.messages import Completion, Trajectory  # noqa: E402
from services.config.schema import (  # noqa: E402
    ActorConfig,
    GenerationConfig,
    LorabusConfig,
    OptimizerConfig,
    PPOConfig,
)
from services.trainer.engines.base import leave_distributed  # noqa: E402
from services.trainer.engines.fsdp2 import FSDP2Engine  # noqa: E402
from tests.fixtures.torchrun import run_torchrun  # noqa: E402

STEPS = 2


def tiny_base():
    from tests.fixtures.tiny import tiny_qwen2

    return tiny_qwen2(vocab_size=96, max_position_embeddings=128).train()


def config() -> LorabusConfig:
    return LorabusConfig(
        gconfig=GenerationConfig(temperature=0.8, n_samples=3),
        actor=ActorConfig(
            path="tiny",
            lora_rank=4,
            lora_alpha=8.0,
            device="cpu",
            seed=7,
            mb_spec_max_tokens=40,  # forces several micro-batches per rank
            # SGD, not Adam: Adam is blind to a wrong gradient scale across ranks
            optimizer=OptimizerConfig(type="sgd", lr=2.0, gradient_clipping=100.0),
            ppo=PPOConfig(ppo_n_minibatches=2, eps_clip=0.2, behav_imp_weight_cap=5.0),
        ),
    )


def batch(step: int) -> list[Trajectory]:
    """Deterministic groups with different prompt/completion lengths and rewards."""
    g = torch.Generator().manual_seed(100 + step)
    groups = []
    for i in range(3):
        prompt = torch.randint(1, 96, (3 + i,), generator=g).tolist()
        completions = []
        for j in range(3):
            n = 2 + (i + j) % 4
            completions.append(
                Completion(
                    token_ids=torch.randint(1, 96, (n,), generator=g).tolist(),
                    logprobs=(-4.5 - 0.5 * torch.rand(n, generator=g)).tolist(),
                    versions=[max(0, step - j % 2)] * n,
                    reward=float((i + j + step) % 3 == 0),
                )
            )
        groups.append(
            Trajectory(
                run="t",
                trajectory_id=f"s{step}g{i}",
                grant_id="x",
                replica="r",
                prompt_id=str(i),
                prompt_token_ids=prompt,
                completions=completions,
                started_at=0.0,
                finished_at=1.0,
            )
        )
    return groups


def run_steps(engine: FSDP2Engine) -> list:
    return [engine.train_step(batch(s), head_version=s) for s in range(STEPS)]


def test_single_process_step_trains_only_the_adapter():
    engine = FSDP2Engine(config(), tiny_base())
    base_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    v0 = engine.adapter_state()
    stats = run_steps(engine)
    v2 = engine.adapter_state()
    assert v0.keys() == v2.keys()
    assert any(not torch.equal(v0[k], v2[k]) for k in v0 if "lora_B" in k)
    for n, p in engine.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    # 3 groups x 3 completions, lengths 2..5: 29 tokens in step 0
    assert stats[0].tokens == sum(2 + (i + j) % 4 for i in range(3) for j in range(3))
    assert stats[0].groups == 3 and engine.step == STEPS
    # second minibatch of step 0 already moved away from pi_prox; behaviour logprobs of
    # about -4.7 vs uniform -4.56 give importance weights near 1
    assert 0.5 < stats[0].loss_stats["imp_weight_mean"] < 2.0
    assert stats[1].loss_stats["mean_staleness"] > 0


def test_two_gloo_ranks_match_single_process(tmp_path):
    out = tmp_path / "adapter.pt"
    run_torchrun(__file__, [out], timeout=240)
    sharded = torch.load(out)

    engine = FSDP2Engine(config(), tiny_base())
    v0 = engine.adapter_state()
    single_stats = run_steps(engine)
    single = engine.adapter_state()
    assert sharded["adapter"].keys() == single.keys()
    for k in single:
        torch.testing.assert_close(
            sharded["adapter"][k], single[k], atol=2e-4, rtol=1e-3
        )  # lr 2 amplifies reduction-order noise
    assert any(not torch.equal(v0[k], single[k]) for k in single)
    assert sharded["tokens"] == [s.tokens for s in single_stats]
    for got, want in zip(sharded["loss"], [s.loss for s in single_stats]):
        assert abs(got - want) < 1e-5


def _worker(out: str) -> None:
    engine = FSDP2Engine(config(), tiny_base())
    assert engine.world_size == 2
    stats = run_steps(engine)
    adapter = engine.adapter_state()  # collective: every rank gathers
    if engine.rank == 0:
        torch.save({"adapter": adapter, "tokens": [s.tokens for s in stats], "loss": [s.loss for s in stats]}, out)
    leave_distributed()


if __name__ == "__main__":
    _worker(sys.argv[1])
