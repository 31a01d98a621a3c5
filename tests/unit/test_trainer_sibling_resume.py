"""A run's adapter rejoining the shared model from its checkpoint (a resumed run, or a trainer
restarted with submitted runs): the optimizer state loads while another run's adapter is the
active one, and the run trains on exactly where it left off."""

from __future__ import annotations

import copy

import torch

from services.trainer.engines.fsdp2 import FSDP2Engine
from tests.fixtures.tiny import tiny_qwen2
from tests.unit.test_trainer_siblings import batch, config


def test_a_sibling_resumes_from_its_checkpoint_while_another_adapter_is_active():
    own = FSDP2Engine(config("a", 8, ["all-linear"]), base=tiny_qwen2())
    b = own.sibling(config("b", 4, ["q_proj", "v_proj"]), "b")
    b.train_step(batch("b", 1), head_version=0)
    adapter, optim = copy.deepcopy(b.adapter_state()), copy.deepcopy(b.optimizer_state())  # a checkpoint
    b.train_step(batch("b", 2), head_version=1)
    want = b.adapter_state()  # where the run goes from its step-1 checkpoint
    b.drop()
    own.train_step(batch("a", 3), head_version=0)  # the own run's adapter is the active one now

    again = own.sibling(config("b", 4, ["q_proj", "v_proj"]), "b")
    again.load_state(adapter, optim, 1)
    assert again.step == 1 and all(torch.equal(adapter[k], t) for k, t in again.adapter_state().items())
    again.train_step(batch("b", 2), head_version=1)
    got = again.adapter_state()
    assert all(torch.allclose(want[k], t, atol=1e-6) for k, t in got.items())


def test_the_optimizer_state_a_checkpoint_takes_is_not_moved_by_later_steps():
    """A checkpoint is saved while the next step trains: what `optimizer_state` returned must be
    a copy (on the CPU, offloading copies nothing)."""
    engine = FSDP2Engine(config("a", 8, ["all-linear"]), base=tiny_qwen2())
    engine.train_step(batch("a", 1), head_version=0)
    state = engine.optimizer_state()
    before = copy.deepcopy(state)
    engine.train_step(batch("a", 2), head_version=1)
    moved = engine.optimizer_state()
    tensors = [(k, name) for k, s in before["state"].items() for name, t in s.items() if torch.is_tensor(t)]
    assert tensors
    assert all(torch.equal(state["state"][k][n], before["state"][k][n]) for k, n in tensors)
    assert any(not torch.equal(moved["state"][k][n], before["state"][k][n]) for k, n in tensors)
