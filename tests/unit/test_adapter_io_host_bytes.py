"""A tensor's bytes for serialisation, reached without a torch call where it lies ready on the host
(each call releases the GIL and waits for it back beside a thread busy in Python)."""

import pytest
import torch

pytestmark = pytest.mark.unit


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "b.lora_A.weight": torch.randn(4, 6, generator=g),
        "a.lora_B.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "c.transposed": torch.randn(5, 3, generator=g).t(),  # not contiguous: copied first
        "d.empty": torch.zeros(0, 3),
        "e.half": torch.randn(7, generator=g).half(),
    }


def test_the_bytes_are_each_tensors_memory_in_the_files_order():
    from services.common import adapter_io

    ts = tensors()
    data = adapter_io.to_bytes(ts)
    head, ordered = adapter_io._safetensors_layout(ts)
    want = head + b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in ordered)
    assert data == want
    back = adapter_io.from_bytes(data)
    assert set(back) == set(ts) and all(torch.equal(back[k], ts[k]) for k in ts)


def test_a_contiguous_cpu_tensor_is_read_through_no_torch_call(monkeypatch):
    from services.common import adapter_io

    ts = {k: v for k, v in tensors().items() if v.is_contiguous()}
    want = adapter_io.to_bytes(ts)

    def refused(*args, **kwargs):
        raise AssertionError("a torch call: it would release the GIL and wait to get it back")

    for name in ("reshape", "view", "numpy", "contiguous", "cpu", "detach"):
        monkeypatch.setattr(torch.Tensor, name, refused)
    assert adapter_io.to_bytes(ts) == want


def test_written_weights_are_the_same_bytes(tmp_path):
    from services.common import adapter_io

    ts = tensors()
    adapter_io.write_weights(tmp_path / "w.safetensors", ts)
    assert (tmp_path / "w.safetensors").read_bytes() == adapter_io.to_bytes(ts)
