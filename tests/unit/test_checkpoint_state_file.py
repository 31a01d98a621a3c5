"""The checkpoint's optimizer and RNG state (`checkpoint.write_state`, `trainer.bin`): the tensors'
bytes are written from their memory by os.writev (GIL released), never pickled; whatever the
structure holds comes back as it was, an optimizer resumed from it steps as the original, and a
damaged file or a checkpoint of an older trainer (`trainer.pt`) is handled."""

from __future__ import annotations

import os
import pickle
import random

import pytest
import torch

from services.common import adapter_io
from services.trainer import checkpoint


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b), (a, b)
        return
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _state() -> dict:
    """Every kind of thing an engine's optimizer state and the RNG put in a checkpoint."""
    return {
        "optimizer": {
            "state": {
                "a.lora_A": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 5), "exp_avg_sq": torch.rand(4, 5)},
                "a.lora_B": {"exp_avg": torch.randn(5, 4).t(), "empty": torch.zeros(0, 3)},  # not contiguous
                "odd": {
                    "bf16": torch.randn(3, 3).bfloat16(),
                    "flags": torch.tensor([True, False, True]),
                    "ids": torch.arange(7),
                    "f8": torch.randn(5).to(torch.float8_e4m3fn),
                },
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["a.lora_A", "a.lora_B"], "name": None}],
            "masters": {"base_model.model.x.lora_A.weight": torch.randn(2, 6)},
            "grad": torch.ones(2, requires_grad=True),  # not a plain tensor of bytes: pickled, still comes back
        },
        "rng": checkpoint.rng_state(),
    }


@pytest.fixture
def pickled(monkeypatch) -> list[torch.Tensor]:
    """The tensors pickled meanwhile (torch.save pickles every one, holding the GIL throughout)."""
    seen: list[torch.Tensor] = []
    reduce = torch.Tensor.__reduce_ex__

    def spy(self, proto):
        seen.append(self)
        return reduce(self, proto)

    monkeypatch.setattr(torch.Tensor, "__reduce_ex__", spy)
    return seen


def test_the_state_comes_back_as_it_was_and_no_tensor_is_pickled(tmp_path, pickled):
    state = _state()
    checkpoint.write_state(tmp_path / "t.bin", state)
    assert [t.requires_grad for t in pickled] == [True], "only what is not plain bytes is pickled"
    back = checkpoint.read_state(tmp_path / "t.bin")
    _same(state, back)
    torch.set_rng_state(back["rng"]["torch"])  # restorable as rng_state() gave it
    random.setstate(back["rng"]["python"])


def test_save_and_load_latest_use_it(tmp_path, pickled):
    weights = adapter_io.to_bytes({"base_model.model.x.lora_A.weight": torch.ones(2, 2)})
    state = _state()
    del state["optimizer"]["grad"]
    ckpt = checkpoint.Checkpoint(step=2, version=2, adapter_bytes=weights, optimizer=state["optimizer"],
                                 rng=state["rng"], trained_ids=["t"], trained_seqs=[(1, 4)])  # fmt: skip
    path = checkpoint.save(tmp_path, ckpt)
    assert pickled == []
    assert sorted(p.name for p in path.iterdir()) == sorted([adapter_io.WEIGHTS_NAME, "state.json", "trainer.bin"])
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None and (latest.step, latest.version, latest.trained_seqs) == (2, 2, [(1, 4)])
    assert latest.adapter_bytes == weights
    _same(state["optimizer"], latest.optimizer)
    _same(state["rng"], latest.rng)


def test_an_optimizer_resumed_from_it_steps_as_the_original(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.write_state(tmp_path / "t.bin", {"optimizer": opt.state_dict()})
    twin = pickle.loads(pickle.dumps(model))
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(checkpoint.read_state(tmp_path / "t.bin")["optimizer"])
    x = torch.randn(8, 6)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).square().mean().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_short_writes_are_resumed_where_they_stopped(tmp_path, monkeypatch):
    writev, calls = os.writev, []

    def short(fd, buffers):  # at most 1000 bytes a call, as a full disk or a signal may leave it
        calls.append(len(buffers))
        left, take = 1000, []
        for b in buffers:
            if left <= 0:
                break
            part = memoryview(b)[:left]
            take.append(part)
            left -= part.nbytes
        return writev(fd, take)

    monkeypatch.setattr(os, "writev", short)
    state = _state()
    checkpoint.write_state(tmp_path / "t.bin", state)
    assert len(calls) > 3
    monkeypatch.undo()
    _same(state, checkpoint.read_state(tmp_path / "t.bin"))


def test_many_tensors_go_out_in_batches_of_iov_max(tmp_path, monkeypatch):
    writev, sizes = os.writev, []
    monkeypatch.setattr(os, "writev", lambda fd, bufs: sizes.append(len(bufs)) or writev(fd, bufs))
    state = {str(i): torch.full((3,), float(i)) for i in range(3000)}
    checkpoint.write_state(tmp_path / "t.bin", state)
    assert max(sizes) <= 1024 and len(sizes) <= 7  # 3000 tensors, their padding, the header
    _same(state, checkpoint.read_state(tmp_path / "t.bin"))


def test_a_damaged_file_is_refused(tmp_path):
    checkpoint.write_state(tmp_path / "t.bin", _state())
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-10])
    with pytest.raises(RuntimeError, match="damaged"):
        checkpoint.read_state(tmp_path / "t.bin")
    (tmp_path / "t.bin").write_bytes(b"PK" + data[2:])
    with pytest.raises(RuntimeError, match="damaged"):
        checkpoint.read_state(tmp_path / "t.bin")


def test_a_checkpoint_of_an_older_trainer_still_loads(tmp_path):
    weights = adapter_io.to_bytes({"base_model.model.x.lora_A.weight": torch.ones(2, 2)})
    state = _state()
    ckpt = checkpoint.Checkpoint(
        step=5, version=5, adapter_bytes=weights, optimizer=state["optimizer"], rng=state["rng"]
    )
    path = checkpoint.save(tmp_path, ckpt)
    (path / "trainer.bin").unlink()
    torch.save({"optimizer": state["optimizer"], "rng": state["rng"]}, path / "trainer.pt")  # as they wrote it
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None and latest.step == 5
    _same(state["optimizer"], latest.optimizer)
