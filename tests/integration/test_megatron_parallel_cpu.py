"""Pipeline and expert parallelism in the Megatron engine on CPU with two gloo ranks: the same
GRPO steps from the same base and adapter give, to fp32 tolerance, the loss, the gradient norm
and the gathered adapter of a one-rank run: a dense Qwen3 in two pipeline stages (megatron-core's
1F1B schedule, variable-length micro-batches), a Qwen3 MoE with its 4 experts split over two
expert-parallel ranks (the allgather dispatcher, micro-batches padded to one shape), and the MoE
in two pipeline stages.

Each run is a child process with the megatron-bridge site `make megatron-env` builds first on
PYTHONPATH (the venv's transformers is newer than megatron-bridge imports with), as
tests/integration/test_megatron_bridge_cpu.py does. The one-rank run writes the random Qwen3
checkpoint and a random adapter (large enough B that a misplaced layer shows), both runs start
from them, and each writes its losses, its whole adapter in bridge naming (gathered from every
stage, layers renumbered) and its published PEFT tensors.

This file is also the worker: `python tests/integration/test_megatron_parallel_cpu.py one|pp2|ep2
ARCH WORK` (under torchrun for two ranks).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("LORABUS_MEGATRON_SITE", ROOT / ".cache" / "megatron-site"))
STEPS = 2


def _layout(name: str) -> dict[str, int]:
    return {
        "one": {},
        "pp2": {"pipeline_model_parallel_size": 2},
        "ep2": {"expert_model_parallel_size": 2},
        # four ranks: run by hand (two shared cores are too few for a test)
        "pp2ep2": {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2},
    }[name]


def _config(work: Path, layout: str, world: int):
    from services.config.loader import config_from_dict

    return config_from_dict(
        {
            "run": "megatron-parallel",
            "run_dir": str(work / f"run-{layout}"),
            "total_train_steps": STEPS,
            "gconfig": {"temperature": 0.9, "n_samples": 4},
            "actor": {
                "backend": "megatron",
                "path": str(work / "hf"),
                "device": "cpu",
                "dtype": "float32",
                "nproc_per_node": world,
                "lora_rank": 4,
                "lora_alpha": 8.0,
                "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                "mb_spec_max_tokens": 40,  # several micro-batches: the 1F1B schedule has warm-up
                "megatron": {"bridge_type": "megatron-bridge", **_layout(layout)},
                # SGD, not Adam: Adam is blind to a wrong gradient scale between layouts
                "optimizer": {"type": "sgd", "lr": 0.5, "gradient_clipping": 100.0, "warmup_steps_proportion": 0.0},
                "ppo": {"ppo_n_minibatches": 2},
            },
            "train_dataset": {"path": "builtin:arith", "reward_fn": "services.common.rewards:arith_reward"},
        }
    )


def _worker(layout: str, arch: str, work: Path) -> None:
    from benchmarks.megatron_bridge_step import cpu_shims, parse_args, write_hf_checkpoint

    cpu_shims()  # typing.override on Python 3.11, before megatron-bridge is imported
    from services.trainer.engines.base import leave_distributed
    from services.trainer.engines.megatron.engine import MegatronEngine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout == "one":
        write_hf_checkpoint(work / "hf", _hf_args(parse_args, arch))
    t0 = time.perf_counter()
    engine = MegatronEngine(_config(work, layout, world))
    built = time.perf_counter() - t0
    if layout == "one":
        g = torch.Generator().manual_seed(5)
        start = {
            n: torch.randn(t.shape, generator=g) * (0.05 if ".linear_out." in n else t.shape[-1] ** -0.5)
            for n, t in sorted(engine.bridge_adapter_state().items())
        }
        torch.save(start, work / "start.pt")
    engine.load_bridge_adapter(torch.load(work / "start.pt"))
    losses, norms = [], []
    for step in range(STEPS):
        stats = engine.train_step(_batch(step, engine.vocab_size), step + 1)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)
    bridge = engine.bridge_adapter_state()
    peft = engine.adapter_state()
    if engine.rank == 0:
        local = engine.optimizer.names
        torch.save(
            {"loss": losses, "grad_norm": norms, "bridge": bridge, "peft": peft, "rank0_names": local,
             "build_s": built, "world": world},
            work / f"{layout}.pt",
        )  # fmt: skip
    leave_distributed()


def _batch(step: int, vocab: int) -> list:
    """The benchmark's random groups, with behaviour logprobs near a random model's (about
    -log V), so that importance weights stay near 1 and the loss and gradients are not tiny."""
    import msgspec

    from benchmarks.megatron_lora_step import random_groups

    g = torch.Generator().manual_seed(50 + step)
    groups = random_groups(2, 4, 6, 10, vocab, step + 1, 11 + step)
    return [
        msgspec.structs.replace(
            t,
            completions=[
                msgspec.structs.replace(
                    c, logprobs=(-math.log(vocab) - 0.3 * torch.rand(len(c.token_ids), generator=g)).tolist()
                )
                for c in t.completions
            ],
        )
        for t in groups
    ]


def _hf_args(parse_args, arch: str):
    """write_hf_checkpoint's arguments, through the benchmark's own parser: a 4-layer tiny Qwen3
    (4 experts when MoE) in float32 on the CPU."""
    argv = ["--out", "-", "--shape", "tiny", "--layers", "4", "--seed", "3", "--device", "cpu", "--dtype", "float32"]
    return parse_args(argv + (["--moe", "--experts", "4"] if arch == "moe" else []))


def _site_path() -> list[Path]:
    return [SITE, ROOT]


needs_site = pytest.mark.skipif(
    not (SITE / "megatron" / "bridge").is_dir(), reason=f"no megatron-bridge site at {SITE} (make megatron-env)"
)


def _one_rank(arch: str, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join(map(str, _site_path()))
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, __file__, "one", arch, str(work)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(work / "one.pt")


def _compare(one: dict, split: dict) -> None:
    for got, want in zip(split["loss"], one["loss"]):
        assert abs(got - want) < 1e-5, (split["loss"], one["loss"])
    for got, want in zip(split["grad_norm"], one["grad_norm"]):
        assert abs(got - want) < 1e-4 * max(1.0, want), (split["grad_norm"], one["grad_norm"])
    for key in ("bridge", "peft"):
        assert split[key].keys() == one[key].keys()
        for name, want in one[key].items():
            torch.testing.assert_close(split[key][name], want, atol=2e-5, rtol=1e-4, msg=name)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """arch -> (work directory, the one-rank run's results); each arch's run made once."""
    runs: dict[str, tuple[Path, dict]] = {}

    def get(arch: str) -> tuple[Path, dict]:
        if arch not in runs:
            work = tmp_path_factory.mktemp(f"megatron-{arch}")
            runs[arch] = (work, _one_rank(arch, work))
        return runs[arch]

    return get


def _two_ranks(layout: str, arch: str, work: Path) -> dict:
    from tests.fixtures.torchrun import run_torchrun

    run_torchrun(__file__, [layout, arch, work], timeout=240, pythonpath=_site_path())
    out = torch.load(work / f"{layout}.pt")
    assert out["world"] == 2
    return out


def _layers(names) -> set[str]:
    return {n.split(".")[2] for n in names}


@needs_site
@pytest.mark.timeout(300)
def test_pipeline_two_stages_match_one_rank(one_rank):
    work, one = one_rank("dense")
    pp = _two_ranks("pp2", "dense", work)
    # rank 0 holds the first two of four layers; the published adapter has all four
    assert _layers(pp["rank0_names"]) == {"0", "1"} and _layers(pp["bridge"]) == {"0", "1", "2", "3"}
    assert len(pp["peft"]) == 4 * 7 * 2  # q/k/v/o/gate/up/down, A and B, per layer
    _compare(one, pp)
    start = torch.load(work / "start.pt")
    assert any(not torch.equal(start[n], t) for n, t in one["bridge"].items())  # the steps moved it


def _experts(names) -> set[str]:
    return {n.split("local_experts.")[1].split(".")[0] for n in names if "local_experts." in n}


@needs_site
@pytest.mark.timeout(300)
def test_expert_parallel_two_ranks_match_one_rank(one_rank):
    work, one = one_rank("moe")
    ep = _two_ranks("ep2", "moe", work)
    # rank 0 holds experts 0-1 of 4 (every layer); the published adapter has all four
    assert _experts(ep["rank0_names"]) == {"0", "1"} and _experts(ep["bridge"]) == {"0", "1", "2", "3"}
    _compare(one, ep)


@needs_site
@pytest.mark.timeout(300)
def test_pipeline_two_stages_of_a_moe_model_match_one_rank(one_rank):
    work, one = one_rank("moe")
    pp = _two_ranks("pp2", "moe", work)
    assert _layers(pp["rank0_names"]) == {"0", "1"} and _experts(pp["rank0_names"]) == {"0", "1", "2", "3"}
    _compare(one, pp)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
