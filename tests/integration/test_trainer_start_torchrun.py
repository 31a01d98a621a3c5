"""The memory-efficient start under torchrun: rank 0 reads the checkpoint, rank 1 builds on
the meta device and receives its shard by broadcast. Both ranks must end with exactly the
weights (base and LoRA init) a single process loads, and then train like it, here with
gradient checkpointing on.

This file is also the torchrun worker: `python -m torch.distributed.run --nproc_per_node=2
tests/integration/test_trainer_start_torchrun.py MODEL_DIR OUT`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # when run as a torchrun worker script
    sys.path.insert(0, str(REPO))

from services.config.schema import ActorConfig, LorabusConfig, OptimizerConfig  # noqa: E402
from services.trainer.engines.base import leave_distributed  # noqa: E402
from services.trainer.engines.fsdp2 import FSDP2Engine  # noqa: E402
from tests.fixtures.tiny import tiny_qwen2  # noqa: E402
from tests.fixtures.torchrun import run_torchrun  # noqa: E402
from tests.unit.test_trainer_precision import batch  # noqa: E402


def config(model_dir: str) -> LorabusConfig:
    return LorabusConfig(
        actor=ActorConfig(
            path=model_dir,
            device="cpu",
            lora_rank=4,
            lora_alpha=8.0,
            seed=7,
            gradient_checkpointing=True,
            optimizer=OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=1e9),
        )
    )


def test_rank0_broadcast_start_gives_the_single_process_weights(tmp_path):
    model_dir = tmp_path / "model"
    tiny_qwen2(seed=4).save_pretrained(model_dir)
    out = tmp_path / "state.pt"
    run_torchrun(__file__, [model_dir, out], timeout=300)
    sharded = torch.load(out)

    single = FSDP2Engine(config(str(model_dir)))
    want = single.model.state_dict()
    assert sharded["start"].keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(sharded["start"][k], v), k
    assert sharded["rank1_was_meta"]
    for s in range(2):
        single.train_step(batch(s), head_version=s)
    trained = single.adapter_state()
    for k, v in trained.items():
        torch.testing.assert_close(sharded["adapter"][k], v, atol=1e-5, rtol=1e-4)
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)  # B started at 0


def _worker(model_dir: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from services.trainer import startup

    rank = int(os.environ["RANK"])
    was_meta = startup.on_meta(startup.load_base(config(model_dir).actor, torch.device("cpu"), rank, 2))
    engine = FSDP2Engine(config(model_dir))
    start = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for s in range(2):
        engine.train_step(batch(s), head_version=s)
    adapter = engine.adapter_state()
    if rank == 0:
        torch.save({"start": start, "adapter": adapter}, out)
    flags = [None, None]
    torch.distributed.all_gather_object(flags, was_meta)
    if rank == 0:
        saved = torch.load(out)
        saved["rank1_was_meta"] = flags[1] and not flags[0]
        torch.save(saved, out)
    leave_distributed()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
