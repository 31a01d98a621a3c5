"""`lorabus up --config FILE` on AReaL 1.0.4's own Megatron + vLLM GSM8K GRPO LoRA example, the
file as AReaL ships it (tests/fixtures/areal/gsm8k_grpo_megatron_lora.yaml), offline.

What the file names is where an AReaL user has it, made here: `openai/gsm8k` (main config,
train/test) and `Qwen/Qwen3-0.6B` in a Hugging Face cache, the model a tiny Qwen3 with a chat
template built from a config. The hub is never asked (HF_HUB_OFFLINE). The trainer is the
Megatron engine on megatron-bridge 0.6.2's LoRA (no Transformer Engine, gloo on CPU), importing
megatron-core/megatron-bridge from the site `make megatron-env` builds (`lorabus up` puts it
on the trainer's PYTHONPATH only); the servers are the real vLLM CPU build `lorabus up` starts
itself (.cache/vllm-venv), each loading every version the trainer publishes: by the file's
`weight_update_mode: xccl`, broadcast to its sidecar and loaded into the server from there
(v0 precedes the broadcast group and comes as an object).

The run is shortened on the command line in AReaL's own key names, as its launcher takes them:
`train_dataset.batch_size=2` (carried by the file's `${train_dataset.batch_size}` into the
consumer batch), `gconfig.max_new_tokens=8`, `total_train_steps=2`, and the allocation:
the file's `megatron:d4p1t1` + `vllm:d4p1t1` is four trainer ranks and four vLLM CPU servers of
about 3 GiB each, which two cores and 24 GiB shared with the rest of the test session cannot
start in reasonable time (one server takes 40-100 s to come up here; four share the same two
cores), so `actor.backend=megatron:d1p1t1 rollout.backend=vllm:d1p1t1` gives the smallest
layout of the same kind; tests/unit/test_areal_megatron_plan.py checks the file's own d4 plan.

Three more overrides make the two steps say something about the Megatron -> PEFT -> vLLM path.
A tiny random model never answers a GSM8K question: under the example's reward every
completion scores 0, GRPO's advantages are 0 and the adapter would never move, so any
conversion would pass. `train_dataset.reward_fn` (lorabus's own key, accepted in AReaL files)
gives a reward that differs between completions (tests/fixtures/gsm8k.py `varied_reward`); the
held-out evaluator still scores every version with the file's GSM8K reward.
`actor.optimizer.lr=0.05` (the file's 3e-5 moves B by ~3e-5 in a step, far below what bf16
logits resolve) makes v1 differ from v0 visibly, and `rollout.max_head_offpolicyness=0` makes
the second step train on v1's completions only: their behaviour logprobs come from vLLM serving
the adapter converted from Megatron's v1, the proximal ones from Megatron itself, and the
importance weight between them is the check. Every other value is the file's, and the start-up
table shows each hyper-parameter it keeps.

Skipped only where the megatron-bridge site or the vLLM venv is missing (`make test` builds both).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.e2e.up_run import ROOT, run_up
from tests.fixtures import gsm8k

EXAMPLE = "tests/fixtures/areal/gsm8k_grpo_megatron_lora.yaml"
STEPS = 2
SITE = Path(os.environ.get("LORABUS_MEGATRON_SITE", ROOT / ".cache" / "megatron-site"))
VLLM_VENV = ROOT / ".cache" / "vllm-venv"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not (SITE / "megatron" / "bridge").is_dir(), reason=f"no megatron-bridge site at {SITE} (make megatron-env)"
    ),
    pytest.mark.skipif(
        not (VLLM_VENV / ".installed").exists(), reason=f"{VLLM_VENV}/.installed missing (make vllm-env)"
    ),
]

KEPT = {
    # AReaL key: what its row must say it became (the file's value, AReaL's default, or the
    # override above)
    "seed": "seed = 1",
    "actor.backend": (
        "actor.backend = 'megatron', actor.nproc_per_node = 1, actor.megatron tensor/pipeline/expert sizes 1/1/1"
    ),
    "rollout.backend": "rollout.engine = 'vllm', rollout.replicas = 1",
    "actor.path": "actor.path = 'Qwen/Qwen3-0.6B'",
    "gconfig.n_samples": "gconfig.n_samples = 4",
    "gconfig.max_new_tokens": "gconfig.max_new_tokens = 8",
    "gconfig.min_new_tokens": "gconfig.min_new_tokens = 0",
    "gconfig.greedy": "gconfig.greedy = False",
    "gconfig.temperature": "gconfig.temperature = 1.0",
    "gconfig.top_p": "gconfig.top_p = 1.0",
    "gconfig.top_k": "gconfig.top_k = 0",
    "gconfig.lora_name": "gconfig.lora_name = 'lora-gsm8k'",
    "actor.dtype": "actor.dtype = 'bfloat16'",
    "actor.disable_dropout": "actor.disable_dropout = True",
    "actor.gradient_checkpointing": "actor.gradient_checkpointing = False",
    "actor.mb_spec.max_tokens_per_mb": "actor.mb_spec_max_tokens = 10240",
    "actor.optimizer.type": "actor.optimizer.type = 'adamw'",
    "actor.optimizer.lr": "actor.optimizer.lr = 0.05",
    "actor.optimizer.weight_decay": "actor.optimizer.weight_decay = 0.003",
    "actor.optimizer.beta1": "actor.optimizer.beta1 = 0.9",
    "actor.optimizer.beta2": "actor.optimizer.beta2 = 0.999",
    "actor.optimizer.eps": "actor.optimizer.eps = 1e-08",
    "actor.optimizer.gradient_clipping": "actor.optimizer.gradient_clipping = 1.0",
    "actor.optimizer.lr_scheduler_type": "actor.optimizer.lr_scheduler_type = 'constant'",
    "actor.optimizer.warmup_steps_proportion": "actor.optimizer.warmup_steps_proportion = 0.001",
    "actor.ppo_n_minibatches": "actor.ppo.ppo_n_minibatches = 1",
    "actor.eps_clip": "actor.ppo.eps_clip = 0.4",
    "actor.reward_scaling": "actor.ppo.reward_scaling = 10.0",
    "actor.reward_bias": "actor.ppo.reward_bias = -0.5",
    "actor.reward_clip": "actor.ppo.reward_clip = 20.0",
    "actor.kl_ctl": "actor.ppo.kl_ctl = 0.0",
    "actor.use_decoupled_loss": "actor.ppo.use_decoupled_loss = True",
    # the file's pre-1.0 keys, read as AReaL's own migration reads them
    "actor.behave_imp_weight_cap": "actor.ppo.behav_imp_weight_cap = 5.0",
    "actor.behave_imp_weight_mode": "actor.ppo.behav_imp_weight_mode = 'mask'",
    "actor.reward_norm.mean_level": "actor.ppo.group_adv_norm = True",
    "actor.reward_norm.std_level": "actor.ppo.adv_norm_std = True",
    "actor.adv_norm.mean_level": "actor.ppo.batch_adv_norm = True",
    "actor.adv_norm.std_level": "actor.ppo.batch_adv_norm_std = True",
    "actor.reward_norm.eps": "actor.ppo.norm_eps = 1e-05",
    "actor.lora_rank": "actor.lora_rank = 16",
    "actor.lora_alpha": "actor.lora_alpha = 16",
    "actor.target_modules": "actor.target_modules = ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']",
    "actor.weight_update_mode": "actor.weight_update_mode = 'xccl'",
    "actor.megatron.bridge_type": "actor.megatron.bridge_type = 'megatron-bridge'",
    "rollout.max_concurrent_rollouts": "rollout.max_concurrent_rollouts = 256",
    "rollout.max_head_offpolicyness": "rollout.max_head_offpolicyness = 0",
    "rollout.consumer_batch_size": "rollout.consumer_batch_size = 2",
    "vllm.model": "vllm.model = 'Qwen/Qwen3-0.6B'",
    "vllm.dtype": "vllm.dtype = 'bfloat16'",
    "vllm.max_model_len": "vllm.max_model_len = 32768",
    "vllm.enable_lora": "vllm.enable_lora = True",
    "vllm.max_lora_rank": "vllm.max_lora_rank = 16",
    "vllm.max_loras": "vllm.max_loras = 8",
    "vllm.seed": "vllm.extra_args += --seed=1",
    "vllm.gpu_memory_utilization": "vllm.extra_args += --gpu-memory-utilization=0.9",
    "vllm.enforce_eager": "vllm.extra_args += --enforce-eager",
    "train_dataset.max_length": "train_dataset.max_length = 1024",
    "train_dataset.shuffle": "train_dataset.shuffle = True",
    "train_dataset.reward_fn": "train_dataset.reward_fn = 'tests.fixtures.gsm8k:varied_reward'",
    # the held-out set keeps AReaL's GSM8K reward
    "valid_dataset.path": "reward_fn = 'services.common.rewards:math_answer'",
    "total_train_epochs": "total_train_steps = 2 (10 x (12 prompts // batch 2) = 60; total_train_steps 2",
}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    gsm8k.hf_cache(home)
    gsm8k.hf_model(home, "Qwen/Qwen3-0.6B", arch="qwen3")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return home


HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""what the converter makes of linear_qkv, linear_proj, linear_fc1, linear_fc2"""


def _lora_b(export: Path) -> dict:
    from safetensors.torch import load_file

    return {k: t for k, t in load_file(export / "adapter_model.safetensors").items() if ".lora_B." in k}


def _row(log: str, key: str) -> str:
    lines = [line for line in log.splitlines() if re.match(rf"{re.escape(key)}\s", line)]
    return "\n".join(lines)


def test_areal_megatron_vllm_example_runs_as_it_is(tmp_path, offline_hub):
    run_dir = tmp_path / "run"
    summary = run_up(
        EXAMPLE,
        run_dir,
        STEPS,
        "train_dataset.batch_size=2",
        "gconfig.max_new_tokens=8",
        "actor.backend=megatron:d1p1t1",
        "rollout.backend=vllm:d1p1t1",
        "rollout.max_head_offpolicyness=0",
        "actor.optimizer.lr=0.05",
        "train_dataset.reward_fn=tests.fixtures.gsm8k:varied_reward",
        flags=["--trainer-site", str(SITE)],
    )
    log = (run_dir / "up.log").read_text()
    assert "is an AReaL experiment file" in log
    for key, became in KEPT.items():
        assert became in _row(log, key), f"{key}: {_row(log, key) or 'no row'}"
    # the run: two steps trained on GSM8K prompts by the Megatron engine, exported, each scored
    assert summary["trainer_steps"] == STEPS and summary["trained_groups"] == STEPS * 2, summary
    assert set(map(int, summary["eval_by_version"])) >= set(range(STEPS + 1)), summary
    trainer = (run_dir / "trainer.log").read_text()
    assert "Megatron" in trainer and "LoRA r=16" in trainer, trainer[-3000:]
    # exported as PEFT with HF's module names; v0 is LoRA's B = 0, every B has moved by v2
    b = {v: _lora_b(run_dir / "export" / f"v{v}") for v in range(STEPS + 1)}
    assert {k.split(".")[-3] for k in b[2]} == set(HF_MODULES) and len(b[2]) == 2 * len(HF_MODULES), sorted(b[2])
    assert all(t.abs().max() == 0 for t in b[0].values())
    assert all(t.abs().max() > 0 for t in b[2].values())
    config = json.loads((run_dir / "export" / "v2" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(HF_MODULES) and config["r"] == 16, config
    # the real vLLM server loaded every version under the file's lora_name
    server = (run_dir / "vllm-0.log").read_text(errors="replace")
    for v in range(STEPS + 1):
        assert f"name 'lora-gsm8k-v{v}'" in server, f"v{v} not loaded into vLLM:\n{server[-3000:]}"
    # step 1 trains on v1's completions only (off-policyness 0), sampled by vLLM serving the
    # adapter converted from Megatron's v1, and the trainer recomputes their logprobs with
    # Megatron's v1 before its update: the on-policy mismatch of v1 is bf16's noise alone (a
    # converter with gate and up swapped gives max |delta logprob| 0.27 and a mean KL 3e-3 here;
    # the right one 0.004 and 1e-6)
    mismatch = summary["train_infer_mismatch"]
    assert mismatch is not None and mismatch["steps_measured"] == STEPS, mismatch
    v1 = mismatch["by_version"]["1"]
    assert v1["tokens"] == 2 * 4 * 8 and v1["abs_logprob_diff_max"] < 0.05 and v1["kl_mean"] < 1e-4, mismatch
    # each version's canary (the Megatron model's own) followed its event, and the server's load of it passed
    # the replica's check, made while it served (a failed check withdraws and unloads the version)
    canary = summary["canary"]
    assert canary is not None and canary["replica_checks_beside_serving"] == STEPS, canary
    rollout_log = (run_dir / "rollout-0.log").read_text()
    passed = set(re.findall(r"-v(\d+) canary passed in", rollout_log))
    assert passed == {str(v) for v in range(STEPS + 1)}, passed
    steps = re.findall(r"step (\d+) -> v\d+ .* masked ([\d.]+) imp_weight", trainer)
    assert steps == [("0", "0.000"), ("1", "0.000")], steps
    via = dict(re.findall(r"loaded \S+-v(\d+) via (xccl|object)", rollout_log))
    assert via.get("0") == "object" and all(via.get(str(v)) == "xccl" for v in range(1, STEPS + 1)), via
