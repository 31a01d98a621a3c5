"""megatron-core's CUDA assumptions, routed to the CPU for gloo test runs.

Invariant: nothing here changes a run where torch has CUDA; on a CPU-only torch, after
`route_cuda_to_cpu()` and inside `cuda_factories_on_cpu()`, the megatron-core 0.19 code the
Megatron engine reaches runs with gloo, and every tensor it makes is a CPU tensor.

Why, exactly (megatron-core 0.19.2), each of which raises "Torch not compiled with CUDA
enabled" on a CPU-only torch:
- `torch.cuda.current_device()`: RoPE moves its frequencies there in every forward
  (`rotary_pos_embedding.py`), the pipeline's p2p receive buffers are made there
  (`p2p_communication.py`, `_communicate` and `_communicate_shapes`), the MoE router's
  token counters too. Routed: it returns "cpu".
- `torch.cuda.synchronize()`: after every shape exchange of the pipeline's p2p
  (`_communicate_shapes`, unconditional; the engine sends variable-length micro-batches) and
  after batched p2p (`batch_p2p_sync`). Routed: a no-op (gloo's waits are synchronous).
- `torch.zeros([], dtype=torch.int, device="cuda")`: the token counter every schedule makes
  (`schedules.py`, `forward_backward_no_pipelining` and both pipelining schedules). A device
  literal cannot be routed by replacing a function, so `cuda_factories_on_cpu` is a torch
  function mode that rewrites `device="cuda"` of tensor factories to the CPU while the
  schedule runs.
Not routed, so refused on CPU (the engine chooses another path there): the MoE alltoall token
dispatcher creates a `torch.cuda.Stream` when built and copies on it (the engine uses the
allgather dispatcher on CPU); Transformer Engine and the fused kernels (not used without TE).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def cuda_available() -> bool:
    return torch.cuda.is_available()


def route_cuda_to_cpu() -> list[str]:
    """Patch the two `torch.cuda` calls above on a CPU-only torch; returns what it patched."""
    if cuda_available():
        return []
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync
    return ["torch.cuda.current_device -> 'cpu'", "torch.cuda.synchronize -> no-op"]


def _cpu_device() -> str:
    return "cpu"


def _no_sync(device: Any = None) -> None:
    return None


class _CudaFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def cuda_factories_on_cpu() -> AbstractContextManager:
    """The context megatron-core's schedule runs in: the device rewrite on a CPU-only torch,
    nothing where CUDA exists."""
    return nullcontext() if cuda_available() else _CudaFactoriesOnCpu()
