"""`lorabus up --config FILE` on AReaL 1.0.4's own FSDP2 + SGLang GSM8K GRPO LoRA example, the
file as AReaL ships it (tests/fixtures/areal/gsm8k_grpo_lora.yaml), offline.

What the file names is where an AReaL user has it, made here: `openai/gsm8k` (main config,
train/test) and `Qwen/Qwen2.5-1.5B-Instruct` in a Hugging Face cache, the model a tiny Qwen2
with a chat template built from a config. The hub is never asked (HF_HUB_OFFLINE). The file's
`sglang:d4` starts four servers through `lorabus up`'s own SGLang launch (`python -m
sglang.launch_server` with the translated flags); SGLang needs CUDA, so `--server-site` gives a
site whose `sglang.launch_server` is the SGLang protocol server (tests/fixtures/sglang_launch.py).
`fsdp:d4` is four trainer ranks under torchrun (gloo on CPU).

The run is shortened on the command line in AReaL's own key names, as its launcher takes them:
`train_dataset.batch_size=2` (which the file's `${train_dataset.batch_size}` carries into the
consumer batch), `gconfig.max_new_tokens=8`, `total_train_steps=2`. Every other value is the
file's, and the start-up table shows each hyper-parameter it keeps.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.e2e.up_run import run_up
from tests.fixtures import gsm8k, sglang_launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = "tests/fixtures/areal/gsm8k_grpo_lora.yaml"
STEPS = 2

KEPT = {
    # AReaL key: what its row must say it became (the file's value, or AReaL's default)
    "seed": "seed = 1",
    "actor.backend": "actor.backend = 'fsdp2', actor.nproc_per_node = 4",
    "rollout.backend": "rollout.engine = 'sglang', rollout.replicas = 4",
    "gconfig.n_samples": "gconfig.n_samples = 4",
    "gconfig.max_new_tokens": "gconfig.max_new_tokens = 8",
    "gconfig.temperature": "gconfig.temperature = 1.0",
    "gconfig.top_p": "gconfig.top_p = 1.0",
    "gconfig.top_k": "gconfig.top_k = 0",
    "actor.dtype": "actor.dtype = 'bfloat16'",
    "actor.optimizer.type": "actor.optimizer.type = 'adamw'",
    "actor.optimizer.lr": "actor.optimizer.lr = 0.00017",
    "actor.optimizer.weight_decay": "actor.optimizer.weight_decay = 0.017",
    "actor.optimizer.beta1": "actor.optimizer.beta1 = 0.9",
    "actor.optimizer.beta2": "actor.optimizer.beta2 = 0.999",
    "actor.optimizer.eps": "actor.optimizer.eps = 1e-08",
    "actor.optimizer.gradient_clipping": "actor.optimizer.gradient_clipping = 1.0",
    "actor.optimizer.lr_scheduler_type": "actor.optimizer.lr_scheduler_type = 'constant'",
    "actor.optimizer.warmup_steps_proportion": "actor.optimizer.warmup_steps_proportion = 0.001",
    "actor.eps_clip": "actor.ppo.eps_clip = 0.4",
    "actor.reward_scaling": "actor.ppo.reward_scaling = 10.0",
    "actor.reward_bias": "actor.ppo.reward_bias = -0.5",
    "actor.reward_clip": "actor.ppo.reward_clip = 20.0",
    "actor.kl_ctl": "actor.ppo.kl_ctl = 0.0",
    "actor.ppo_n_minibatches": "actor.ppo.ppo_n_minibatches = 1",
    "actor.use_decoupled_loss": "actor.ppo.use_decoupled_loss = True",
    "actor.rejection_sampling.upper": "actor.ppo.behav_imp_weight_cap = 5.0",
    "actor.rejection_sampling.action": "actor.ppo.behav_imp_weight_mode = 'mask'",
    "actor.reward_norm.mean_level": "actor.ppo.group_adv_norm = True",
    "actor.reward_norm.std_level": "actor.ppo.adv_norm_std = True",
    "actor.adv_norm.mean_level": "actor.ppo.batch_adv_norm = True",
    "actor.adv_norm.std_level": "actor.ppo.batch_adv_norm_std = True",
    "actor.reward_norm.eps": "actor.ppo.norm_eps = 1e-05",
    "actor.lora_rank": "actor.lora_rank = 16",
    "actor.lora_alpha": "actor.lora_alpha = 16",
    "actor.target_modules": "actor.target_modules = ['all-linear']",
    "actor.gradient_checkpointing": "actor.gradient_checkpointing = True",
    "actor.disable_dropout": "actor.disable_dropout = True",
    "actor.mb_spec.max_tokens_per_mb": "actor.mb_spec_max_tokens = 10240",
    "rollout.max_head_offpolicyness": "rollout.max_head_offpolicyness = 2",
    "rollout.max_concurrent_rollouts": "rollout.max_concurrent_rollouts = 256",
    "rollout.consumer_batch_size": "rollout.consumer_batch_size = 2",
    "sglang.max_lora_rank": "sglang.max_lora_rank = 16",
    "train_dataset.max_length": "train_dataset.max_length = 1024",
    "train_dataset.shuffle": "train_dataset.shuffle = True",
    "total_train_epochs": "total_train_steps = 2 (10 x (12 prompts // batch 2) = 60; total_train_steps 2",
}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    gsm8k.hf_cache(home)
    gsm8k.hf_model(home, "Qwen/Qwen2.5-1.5B-Instruct")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return home


def _row(log: str, key: str) -> str:
    lines = [line for line in log.splitlines() if re.match(rf"{re.escape(key)}\s", line)]
    return "\n".join(lines)


def test_areal_fsdp2_sglang_example_runs_as_it_is(tmp_path, offline_hub):
    run_dir = tmp_path / "run"
    summary = run_up(
        EXAMPLE,
        run_dir,
        STEPS,
        "train_dataset.batch_size=2",
        "gconfig.max_new_tokens=8",
        timeout_s=420.0,
        flags=[
            "--sglang-python",
            sys.executable,
            "--server-site",
            str(sglang_launch.site(tmp_path / "site")),
        ],
    )
    log = (run_dir / "up.log").read_text()
    assert "is an AReaL experiment file" in log
    for key, became in KEPT.items():
        assert became in _row(log, key), f"{key}: {_row(log, key) or 'no row'}"
    # the run: two steps trained on GSM8K prompts and exported, each version scored
    assert summary["trainer_steps"] == STEPS and summary["trained_groups"] == STEPS * 2, summary
    assert set(map(int, summary["eval_by_version"])) >= set(range(STEPS + 1)), summary
    trainer = (run_dir / "trainer.log").read_text()
    assert "LoRA r=16" in trainer and "world size 4" in trainer
    # four servers, started with the flags the file's sglang section became
    for i in range(4):
        server = (run_dir / f"sglang-{i}.log").read_text()
        assert "--random-seed=1" in server and "--context-length=32768" in server, server[-2000:]
        assert "--mem-fraction-static=0.8" in server
