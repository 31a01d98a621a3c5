"""The pipelined GRPO step's contract with megatron-core's schedule, without Megatron: a one-stage
schedule that calls `forward_step_func` and `loss_func` as megatron-core's do gives exactly the
plain step's loss and adapter; padding micro-batches to one shape changes neither.

(The real 1F1B schedule over two gloo stages: tests/integration/test_megatron_parallel_cpu.py.)
"""

from __future__ import annotations

import msgspec
import torch

from services.config.schema import PPOConfig
from services.trainer import batching
from services.trainer.engines.megatron import pipeline
from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
from services.trainer.engines.megatron.state import adapter_named_parameters
from services.trainer.engines.megatron.step import (
    micro_batch_loss,
    pad_micro_batch,
    plan_step,
    target_logprobs,
    train_step,
)
from tests.fixtures.megatron_ref import attach_lora
from tests.unit.test_megatron_engine import TinyMegatronLM, _groups

PPO = msgspec.structs.replace(PPOConfig(), ppo_n_minibatches=2)


def one_stage_schedule(*, forward_step_func, data_iterator, model, num_microbatches, forward_only, **shape):
    """megatron-core's schedule on one stage: forward, loss_func's (loss, tokens, extras), the
    extras kept in order, backward unless forward-only; nothing scaled (per-token loss)."""
    store = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model[0])
        loss, tokens, extras = loss_func(output)
        assert tokens.dtype == torch.int and loss.dim() == 0
        store.append(extras)
        if not forward_only:
            loss.backward()
    return store


def _model_and_optimizer():
    torch.manual_seed(0)
    model = TinyMegatronLM()
    attach_lora(model, rank=4, alpha=8.0, targets=("linear_fc1", "linear_fc2"))
    with torch.no_grad():  # a non-zero B: gradients reach A too
        for name, p in model.named_parameters():
            if "linear_out" in name:
                p.normal_(0, 0.05)
    named = adapter_named_parameters(model.named_parameters())
    return model, MasterAdapterOptimizer(named, lambda ps: torch.optim.SGD(ps, lr=0.5))


def test_pipeline_step_equals_the_plain_step():
    plain_model, plain_opt = _model_and_optimizer()
    want = train_step(plain_model, plain_opt, _groups(), head_version=2, ppo=PPO, max_tokens=16)
    model, opt = _model_and_optimizer()
    got = pipeline.train_step(
        model, opt, _groups(), head_version=2, schedule=one_stage_schedule, is_last_stage=True,
        last_stage_rank=0, pp_group=None, ppo=PPO, max_tokens=16,
    )  # fmt: skip
    assert got.loss == want.loss and got.grad_norm == want.grad_norm and got.tokens == want.tokens
    assert got.loss_stats == want.loss_stats
    plain = dict(adapter_named_parameters(plain_model.named_parameters()))
    for name, p in adapter_named_parameters(model.named_parameters()):
        assert torch.equal(p, plain[name]), name


def test_padding_to_one_shape_keeps_every_logprob_and_the_loss():
    model, _ = _model_and_optimizer()
    (plan, *_) = plan_step(_groups(), PPO, 0, 1, 16, pad_id=0)
    mb = plan[0]
    padded = pad_micro_batch(mb, rows=mb.input_ids.shape[0] + 2, length=mb.input_ids.shape[1] + 3, pad_id=0)
    b, w = mb.targets.shape
    with torch.no_grad():
        lp, lp_pad = target_logprobs(model, mb, "cpu", 1.0), target_logprobs(model, padded, "cpu", 1.0)
    assert torch.allclose(lp_pad[:b, :w], lp, atol=1e-6)
    assert float(padded.loss_weights[b:].abs().sum() + padded.loss_weights[:, w:].abs().sum()) == 0.0
    loss, stats = micro_batch_loss(lp, lp, mb, 2, PPO, "cpu")
    loss_pad, stats_pad = micro_batch_loss(lp_pad, lp_pad, padded, 2, PPO, "cpu")
    assert abs(float(loss) - float(loss_pad)) < 1e-7 and stats.tokens == stats_pad.tokens
    assert isinstance(padded, batching.MicroBatch) and padded.groups.shape == (b + 2,)
