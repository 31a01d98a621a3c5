"""`lorabus up --config FILE`: a whole local deployment on one machine.

Starts a nats-server with JetStream in the run directory (unless `--bus-url` points at one),
then the registry, trainer, `rollout.replicas` rollout processes, the exporter and (optionally)
the evaluator, each as its own process with its log in the run directory. It prints progress from
the bus while the run goes, stops everything on Ctrl-C or once the trainer has finished and the
last version is exported, and prints a summary.

With `rollout.engine: vllm` and no `rollout.server_urls` it also starts one vLLM server per
rollout replica (`services.local.inference_servers`), waits for them before starting the
sidecars, and stops them last.

Every way out of a run is an `Outcome`; `exit_status` alone maps it to the exit code (0 only for
a finished or interrupted run) and the message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from pathlib import Path
from typing import TYPE_CHECKING

from proto import messages as m
from proto import subjects
from services.common.config import load_config
from services.common.config_schema import LorabusConfig
from services.local import inference_servers, processes
from services.local.ports import free_port

if TYPE_CHECKING:  # follow() imports the bus when the run starts; these names are for the checker
    from services.common.bus import Bus, MsgMeta


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str | None = None
    """inference servers: the base URL"""
    env_extra: dict[str, str] = field(default_factory=dict)
    server: bool = False
    """an inference server: stopped as a process group, dies with the launcher"""

    def start(self, env: dict[str, str]) -> None:
        log = open(self.log_path, "ab", buffering=0)
        # own process group: Ctrl-C in the terminal reaches only the launcher, which then stops
        # the children in order
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, **self.env_extra},
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            preexec_fn=processes.die_with_parent if self.server else None,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def popen(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise RuntimeError(f"child {self.name}: not started; call start() first")
        return self.proc

    @property
    def pid(self) -> int:
        return self.popen().pid

    @property
    def returncode(self) -> int | None:
        return self.popen().returncode


@dataclass
class Progress:
    """What the launcher learns from the bus; also the summary's content."""

    started: float = field(default_factory=time.monotonic)
    """time.monotonic() when the run started"""
    head: int = -1
    steps: list[m.TrainerStep] = field(default_factory=list)
    verdicts: dict[str, int] = field(default_factory=dict)
    exported: dict[int, str] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)
    max_accepted_staleness: int = 0
    others: dict[str, dict[str, int]] = field(default_factory=dict)
    """runs submitted to the fleet: run -> newest version announced (head) and exported"""

    def others_exported(self) -> bool:
        """Every submitted run's newest version is exported (its last, once the trainer is gone)."""
        return all(o["exported"] >= o["head"] for o in self.others.values())

    def line(self) -> str:
        last = self.steps[-1] if self.steps else None
        reward = f"{last.reward_mean:.3f}" if last else "-"
        tps = f"{last.tokens / last.step_seconds:.0f}" if last and last.step_seconds else "-"
        accepted = self.verdicts.get("accepted", 0)
        rejected = sum(v for k, v in self.verdicts.items() if k != "accepted")
        replicas = " ".join(f"{r}:v{v}" for r, v in sorted(self.loaded.items())) or "-"
        return (
            f"[{time.monotonic() - self.started:6.1f}s] head v{max(self.head, 0)} | reward {reward} | "
            f"accepted {accepted} rejected {rejected} | train tok/s {tps} | replicas {replicas}"
        )


def trainer_launcher(cfg: LorabusConfig) -> list[str]:
    """What precedes `services.trainer`: plain `python -m`, or torchrun for several ranks
    (`--standalone`: a local rendezvous on a free port, so runs never collide)."""
    n = cfg.actor.nproc_per_node
    if n == 1:
        return [sys.executable, "-m"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m"]


def server_children(plans: list[inference_servers.ServerPlan], run_dir: Path) -> list[Child]:
    return [Child(p.name, p.argv, run_dir / f"{p.name}.log", url=p.url, env_extra=p.env, server=True) for p in plans]


def child_commands(
    cfg: LorabusConfig,
    config_path: str,
    overrides: list[str],
    run_dir: Path,
    evaluate: bool,
    servers: Sequence[inference_servers.ServerPlan] = (),
) -> list[Child]:
    py = [sys.executable, "-m"]
    common = ["--config", config_path, *overrides]
    children = [
        Child("registry", [*py, "services.registry", *common], run_dir / "registry.log"),
        Child("exporter", [*py, "services.exporter", *common], run_dir / "exporter.log"),
        Child("trainer", [*trainer_launcher(cfg), "services.trainer", *common], run_dir / "trainer.log"),
    ]
    own_server = {p.replica: p.sidecar_overrides() for p in servers}
    for i in range(cfg.rollout.replicas):
        replica = f"rollout-{i}"
        children.append(
            Child(
                replica,
                [*py, "services.rollout", *common, *own_server.get(replica, []), "--replica", replica],
                run_dir / f"{replica}.log",
            )
        )
    if evaluate:
        children.append(
            Child(
                "evaluator",
                [*py, "services.clients.evaluate", *common],
                run_dir / "evaluator.log",
            )
        )
    return children


def assign_metrics_ports(children: list[Child], run_dir: Path) -> None:
    """Give every child a fixed metrics port and write them as a Prometheus file_sd target
    list (`<run_dir>/prometheus_targets.json`), so a local Prometheus can scrape the run."""
    targets = []
    for child in children:
        port = free_port()
        extra = [f"metrics.port={port}", "metrics.host=127.0.0.1"]
        # overrides are one positional group: keep them together, before any later flag
        at = child.argv.index("--replica") if "--replica" in child.argv else len(child.argv)
        child.argv[at:at] = extra
        component = "rollout" if child.name.startswith("rollout-") else child.name
        targets.append({"targets": [f"127.0.0.1:{port}"], "labels": {"component": component, "process": child.name}})
    (run_dir / "prometheus_targets.json").write_text(json.dumps(targets, indent=2))


def write_pids(run_dir: Path, children: list[Child]) -> None:
    """For operators and tests that want to signal one service."""
    (run_dir / "pids.json").write_text(json.dumps({c.name: c.pid for c in children}))


def stop_children(children: list[Child], timeout_s: float = 40.0) -> None:
    """SIGTERM every child's process group (each child leads its own: vLLM's engine core and
    torchrun's ranks are children of the process we started), SIGKILL what is left at the end.
    The timeout covers torchrun, which gives its ranks up to 30 s to finish a step."""
    for child in reversed(children):
        if child.alive():
            processes.terminate_group(child.pid)
    deadline = time.monotonic() + timeout_s
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.kill()
            child.proc.wait()


async def follow(cfg: LorabusConfig, progress: Progress) -> list[Bus]:
    """Subscribe to the run's events (core subscriptions: the launcher only watches)."""
    from services.common.bus import Bus

    bus = await Bus.connect(cfg.bus, run=cfg.run, service="launcher")
    run = cfg.run

    async def on_ready(msg: m.AdapterReady, _meta: MsgMeta) -> None:
        progress.head = max(progress.head, msg.version)

    async def on_step(msg: m.TrainerStep, _meta: MsgMeta) -> None:
        progress.steps.append(msg)

    async def on_decision(msg: m.TrajectoryDecision, _meta: MsgMeta) -> None:
        progress.verdicts[msg.verdict] = progress.verdicts.get(msg.verdict, 0) + 1
        if msg.verdict == "accepted" and msg.oldest_version is not None:
            staleness = msg.head_version - msg.oldest_version
            progress.max_accepted_staleness = max(progress.max_accepted_staleness, staleness)

    async def on_export(msg: m.ExportDone, _meta: MsgMeta) -> None:
        progress.exported[msg.version] = msg.uri

    async def on_eval(msg: m.EvalResult, _meta: MsgMeta) -> None:
        progress.evals[msg.version] = msg.score

    async def on_report(msg: m.RolloutReport, _meta: MsgMeta) -> None:
        if isinstance(msg, m.AdapterLoaded):
            progress.loaded[msg.replica] = max(progress.loaded.get(msg.replica, -1), msg.version)

    await bus.subscribe(subjects.adapter_ready_all(run), m.AdapterReady, on_ready)
    await bus.subscribe(subjects.trainer_step(run), m.TrainerStep, on_step)
    await bus.subscribe(subjects.decision_all(run), m.TrajectoryDecision, on_decision)
    await bus.subscribe(subjects.export_done_all(run), m.ExportDone, on_export)
    await bus.subscribe(subjects.eval_result_all(run), m.EvalResult, on_eval)
    await bus.subscribe(subjects.rollout_report_all(run), m.RolloutReport, on_report)

    async def on_run(record: m.RunRecord) -> None:
        if record.run == run or record.run in progress.others:
            return
        other = progress.others[record.run] = {"head": -1, "exported": -1}

        async def on_other_ready(msg: m.AdapterReady, _meta: MsgMeta) -> None:
            other["head"] = max(other["head"], msg.version)

        async def on_other_export(msg: m.ExportDone, _meta: MsgMeta) -> None:
            other["exported"] = max(other["exported"], msg.version)

        await bus.subscribe(subjects.adapter_ready_all(record.run), m.AdapterReady, on_other_ready)
        await bus.subscribe(subjects.export_done_all(record.run), m.ExportDone, on_other_export)

    try:
        await bus.watch_run_records(run, on_run)
    except Exception as exc:  # a bus user without rights on the run table: the own run only
        print(f"lorabus up: not following the fleet's other runs ({exc!r})", flush=True)
    return [bus]


async def accepted_unconsumed(bus, run: str) -> int | None:
    """Accepted trajectories the trainer has not (yet) acknowledged: nothing accepted is lost,
    it is either trained on or still here for the next run."""
    from services.common import streams

    trainer = streams.consumer(run, "trainer")
    try:
        return await bus.consumer_backlog(trainer.stream, trainer.durable)
    except Exception:  # server gone: the summary reports it unknown
        return None


def summary(cfg: LorabusConfig, progress: Progress, run_dir: Path, elapsed: float) -> dict:
    per_version = {}
    for step in progress.steps:
        # the reward of the groups a step consumed describes the policies that generated them:
        # attribute it to the version the step started from
        per_version[step.version - 1] = step.reward_mean
    return {
        "run": cfg.run,
        "run_dir": str(run_dir),
        "elapsed_s": round(elapsed, 1),
        "head_version": progress.head,
        "trainer_steps": len(progress.steps),
        "reward_by_version": per_version,
        "eval_by_version": dict(sorted(progress.evals.items())),
        "trajectories": dict(progress.verdicts),
        "max_accepted_staleness": progress.max_accepted_staleness,
        "max_head_offpolicyness": cfg.rollout.max_head_offpolicyness,
        "exported": dict(sorted(progress.exported.items())),
        "trained_groups": sum(step.groups for step in progress.steps),
        "loaded": dict(sorted(progress.loaded.items())),
        "other_runs": dict(sorted(progress.others.items())),
    }


def print_summary(result: dict) -> None:
    print("\n== lorabus run summary ==")
    print(
        f"run {result['run']}: {result['trainer_steps']} steps, head v{result['head_version']}, "
        f"{result['elapsed_s']} s; logs in {result['run_dir']}"
    )
    print(f"trajectories: {result['trajectories']}")
    print(f"{'version':>8} {'train reward':>13} {'eval score':>11}  export")
    versions = sorted(set(result["reward_by_version"]) | set(result["exported"]))
    for v in versions:
        reward = result["reward_by_version"].get(v)
        score = result["eval_by_version"].get(v)
        print(
            f"{v:>8} {'' if reward is None else f'{reward:.3f}':>13} "
            f"{'' if score is None else f'{score:.3f}':>11}  {result['exported'].get(v, '')}"
        )


class Outcome(Enum):
    """Why `lorabus up` stopped watching; `exit_status` turns it into the exit code and message."""

    FINISHED = auto()
    """the trainer exited 0 and the last version is exported (and evaluated, with the evaluator),
    and so is every submitted run's last version"""
    INTERRUPTED = auto()
    """SIGINT or SIGTERM: the operator stopped the run"""
    SERVERS_UNHEALTHY = auto()
    """an inference server exited or did not answer /health within --server-timeout"""
    CHILD_CRASHED = auto()
    """a service other than the trainer exited (rollouts are restarted first, so this is not one)"""
    TRAINER_FAILED = auto()
    """the trainer exited non-zero"""
    TIMEOUT = auto()
    """--timeout passed before the run finished, whether or not the trainer was done"""


def exit_status(outcome: Outcome, detail: str, run_dir: Path, timeout_s: float) -> tuple[int, str | None]:
    """The exit code, and the line for stderr; `detail` is what `supervise` found."""
    match outcome:
        case Outcome.FINISHED | Outcome.INTERRUPTED:
            return 0, None
        case Outcome.SERVERS_UNHEALTHY:
            return 1, detail
        case Outcome.CHILD_CRASHED:
            return 1, f"{detail} stopped; see its log in {run_dir}"
        case Outcome.TRAINER_FAILED:
            return 1, f"trainer exited with {detail}; see {run_dir / 'trainer.log'}"
        case Outcome.TIMEOUT:
            return 1, f"timeout after {timeout_s} s"


@dataclass
class Deployment:
    """The children of one run; `pids.json` always lists every child that has been started."""

    children: list[Child]
    env: dict[str, str]
    run_dir: Path
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def servers(self) -> list[Child]:
        return [c for c in self.children if c.server]

    @property
    def rollouts(self) -> list[Child]:
        return [c for c in self.children if c.name.startswith("rollout-")]

    @property
    def trainer(self) -> Child:
        return next(c for c in self.children if c.name == "trainer")

    def start(self, group: list[Child]) -> None:
        for child in group:
            child.start(self.env)
            print(f"  started {child.name:<10} pid {child.pid}  log {child.log_path.name}")
        write_pids(self.run_dir, [c for c in self.children if c.proc is not None])

    def replace_dead_rollouts(self) -> None:
        """Rollouts are cattle: a dead replica is replaced and rejoins at the head."""
        for child in self.rollouts:
            if not child.alive():
                print(f"lorabus up: {child.name} exited ({child.returncode}); restarting it", flush=True)
                child.start(self.env)
                self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
                write_pids(self.run_dir, self.children)


async def supervise(
    dep: Deployment,
    cfg: LorabusConfig,
    args: argparse.Namespace,
    progress: Progress,
    stop: asyncio.Event,
) -> tuple[Outcome, str]:
    """Start the children in order, then watch them until one of the ways out."""
    # the sidecars wait for their servers; the trainer starts meanwhile (v0 is ready sooner)
    dep.start([c for c in dep.children if c not in dep.rollouts])
    try:
        await inference_servers.wait_healthy(dep.servers, args.server_timeout, stop)
    except RuntimeError as exc:
        return Outcome.SERVERS_UNHEALTHY, str(exc)
    if stop.is_set():
        return Outcome.INTERRUPTED, ""
    dep.start(dep.rollouts)
    final_version = cfg.total_train_steps
    last_print = 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now - last_print >= args.progress_every:
            print(progress.line(), flush=True)
            last_print = now
        dep.replace_dead_rollouts()
        crashed = [c for c in dep.children if not c.alive() and c is not dep.trainer]
        if crashed:
            return Outcome.CHILD_CRASHED, ", ".join(f"{c.name} (exit {c.returncode})" for c in crashed)
        trainer = dep.trainer
        if not trainer.alive():
            if trainer.returncode != 0:
                return Outcome.TRAINER_FAILED, str(trainer.returncode)
            exported = final_version in progress.exported and progress.others_exported()
            if exported and (not args.evaluate or final_version in progress.evals):
                return Outcome.FINISHED, ""
        if now - progress.started > args.timeout:
            return Outcome.TIMEOUT, ""
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except TimeoutError:
            pass
    return Outcome.INTERRUPTED, ""


async def run_up(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    cfg = load_config(args.config, overrides)
    try:
        start_servers = inference_servers.needs_servers(cfg)
        python = inference_servers.vllm_python(args.vllm_python) if start_servers else None
    except inference_servers.CannotStartServers as exc:
        print(f"lorabus up: {exc}", file=sys.stderr)
        return 2
    if start_servers:
        # the servers start before the trainer has published v0: no preloaded v0
        overrides.append("rollout.preload_v0=false")
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    nats = None
    if args.bus_url:
        overrides.append(f"bus.url={args.bus_url}")
    else:
        from services.local.nats_server import start_nats_server

        nats = start_nats_server(run_dir / "nats")
        overrides.append(f"bus.url={nats.url}")
    cfg = load_config(args.config, overrides)

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the children share 2 cores on a laptop-class machine: one thread each avoids oversubscription
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    plans = inference_servers.plan_vllm_servers(cfg, run_dir, python) if python is not None else []
    # servers first: stopped last
    children = server_children(plans, run_dir) + child_commands(
        cfg, args.config, overrides, run_dir, args.evaluate, plans
    )
    dep = Deployment(children, env, run_dir)
    assign_metrics_ports([c for c in children if not c.server], run_dir)
    print(f"lorabus up: run {cfg.run} in {run_dir} (bus {cfg.bus.url})")
    progress = Progress()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    buses = await follow(cfg, progress)
    try:
        outcome, detail = await supervise(dep, cfg, args, progress, stop)
        exit_code, message = exit_status(outcome, detail, run_dir, args.timeout)
        if message is not None:
            print(f"lorabus up: {message}", file=sys.stderr)
    finally:
        print(progress.line(), flush=True)
        stop_children(children)
        unconsumed = await accepted_unconsumed(buses[0], cfg.run)
        for bus in buses:
            await bus.close()
        if nats is not None:
            nats.stop()
    result = summary(cfg, progress, run_dir, time.monotonic() - progress.started)
    result["restarts"] = dep.restarts
    result["accepted_unconsumed"] = unconsumed
    (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
    print_summary(result)
    return exit_code


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lorabus up", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config (e.g. examples/tiny.yaml)")
    p.add_argument("--bus-url", help="use this NATS server instead of starting one")
    p.add_argument("--no-evaluate", dest="evaluate", action="store_false", help="do not start the held-out evaluator")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many s")
    p.add_argument("--progress-every", type=float, default=5.0, help="seconds between lines")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per service process")
    p.add_argument(
        "--vllm-python",
        help="rollout.engine vllm without server_urls: the python of "
        f"the venv with vLLM (default {inference_servers.DEFAULT_VLLM_PYTHON} if it exists)",
    )
    p.add_argument(
        "--server-timeout", type=float, default=300.0, help="seconds the vLLM servers may take to become healthy"
    )
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run_up(parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
