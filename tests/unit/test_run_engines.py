"""Several runs in one embedded engine (services/rollout/run_engines.py): adapters of different
rank and target modules share one slot pool, and each run's version generates exactly what an
engine holding that adapter alone generates."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from proto.messages import LoraSpec
from services.common import adapter_io
from services.common.lora_targets import HF_LINEAR
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.engines.http import AdapterDirs, Http
from services.rollout.engines.vllm import VllmEngine
from services.rollout.run_engines import KEY_STRIDE, RunEngines, RunKeys
from tests.fixtures.tiny import tiny_qwen2
from tests.unit.test_embedded_engine import EOS, REQS, assert_same

ALL = list(HF_LINEAR)


def adapter(base, rank: int, alpha: float, targets: list[str], seed: int) -> tuple[bytes, LoraSpec]:
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    state = {adapter_io.standardize_key(k): v for k, v in get_peft_model_state_dict(model).items()}
    return adapter_io.to_bytes(state), LoraSpec(rank=rank, alpha=alpha, target_modules=targets, base_model="tiny")


@pytest.fixture(scope="module")
def base():
    return tiny_qwen2()


def alone(base) -> EmbeddedEngine:
    return EmbeddedEngine(copy.deepcopy(base), eos_ids=[EOS], pad_id=0, slots=2)


async def test_runs_of_other_ranks_and_modules_generate_as_if_alone(base):
    own = adapter(base, 8, 16.0, ALL, seed=1)
    small = adapter(base, 4, 4.0, ["q_proj", "v_proj"], seed=2)
    mid = adapter(base, 2, 8.0, ["down_proj", "o_proj"], seed=3)
    engine = alone(base)
    runs = RunEngines(engine, "own", slots=6, rank=8)
    views = {name: runs.view(name, "x") for name in ("own", "small", "mid")}
    await views["own"].load_version(0, *own)
    await views["small"].load_version(0, *small)
    await views["small"].load_version(1, *mid)  # another version of a run: any adapter of its shape
    await views["mid"].load_version(3, *mid)
    assert engine.slots is not None and engine.slots.rank == 8 and engine.slots.table.slots == 6
    assert await views["own"].loaded_versions() == [0]
    assert await views["small"].loaded_versions() == [0, 1]
    assert await views["mid"].loaded_versions() == [3]
    # the newest key is merged; every other run's rows are corrected: all must equal the adapter alone
    cases = ((views["own"], 0, own), (views["small"], 0, small), (views["small"], 1, mid), (views["mid"], 3, mid))
    wants, steps = [], []
    for view, version, (weights, spec) in cases:
        reference = alone(base)
        await reference.load_version(0, weights, spec)
        wants.append(await reference.generate(REQS, 0))
        start = engine.steps
        assert_same(await view.generate(REQS, version), wants[-1])
        steps.append(engine.steps - start)
    # a replica serving its runs' batches at once: one batch (as long as the longest), each
    # run's rows as if alone
    start = engine.steps
    together = await asyncio.gather(*(view.generate(REQS, version) for view, version, _ in cases))
    assert engine.steps - start == max(steps)
    for got, want in zip(together, wants):
        assert_same(got, want)
    await views["small"].unload_version(0)
    assert await views["small"].loaded_versions() == [1] and await views["own"].loaded_versions() == [0]
    with pytest.raises(KeyError):
        await views["mid"].generate(REQS, 0)  # run mid has no v0 (run small had one)


async def test_an_adapter_the_pool_cannot_hold_is_refused(base):
    engine = alone(base)
    runs = RunEngines(engine, "own", slots=4, rank=4)
    await runs.view("own", "x").load_version(0, *adapter(base, 4, 8.0, ["q_proj"], seed=1))
    with pytest.raises(ValueError, match="targets .*v_proj.*the fleet's slots do not hold"):
        await runs.view("b", "x").load_version(0, *adapter(base, 2, 8.0, ["v_proj"], seed=2))
    with pytest.raises(ValueError, match="rank 8 is above the fleet's slot rank 4"):
        await runs.view("b", "x").load_version(0, *adapter(base, 8, 8.0, ["q_proj"], seed=3))


def test_keys_keep_the_own_runs_versions_and_separate_the_others():
    keys = RunKeys("own")
    assert keys.key("own", 7) == 7
    assert keys.key("b", 7) == KEY_STRIDE + 7 and keys.key("c", 0) == 2 * KEY_STRIDE
    assert keys.versions("b", [7, KEY_STRIDE + 7, KEY_STRIDE + 2, 2 * KEY_STRIDE]) == [2, 7]
    assert keys.versions("nobody", [7]) == []


async def test_server_runs_are_named_with_their_run(tmp_path):
    http = Http(timeout_s=1.0)
    own = VllmEngine(["http://127.0.0.1:1"], AdapterDirs("lora", tmp_path), http=http)
    runs = RunEngines(own, "fleet", slots=8, rank=16)
    assert runs.view("fleet", "lora") is own
    other = runs.view("r2", "lora")
    assert isinstance(other, VllmEngine) and other.http is http and other.urls == own.urls
    assert other.dirs.name(3) == "r2-lora-v3" and own.dirs.name(3) == "lora-v3"
    assert other.dirs.local(3) == tmp_path / "r2-lora-v3"
    await http.close()
