"""`lorabus up --config FILE`: a whole local deployment on one machine.

Starts a nats-server with JetStream in the run directory (unless `--bus-url` points at one),
then the registry, trainer, `rollout.replicas` rollout processes, the exporter and (optionally)
the evaluator, each as its own process with its log in the run directory. It prints progress from
the bus while the run goes and supervises: a process that dies (the nats-server included, on its
store and port) is restarted under `supervision.RestartPolicy`. It stops everything on Ctrl-C or
once the last version is exported and scored (scores still missing then are waited for at most
`evaluator.max_wait_s`; the progress line says so, with the versions left), and prints a summary
read back from the streams (`summary.py`). A run already finished is recognised before anything starts: rerunning
the command prints its summary at once; any other ending says that rerunning it resumes the run.

With `rollout.engine: vllm|sglang` and no `rollout.server_urls` it also starts one server per
rollout replica (`services.local.inference_servers`), waits for them before starting the
sidecars, and stops them last. A server that dies, hangs or answers /health with errors is
killed and restarted, and its sidecar with it once the new server is ready
(`services.local.server_watch` says why).

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
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proto import messages as m
from proto import subjects
from services.common.run_table import RunTable
from services.config import runconfig
from services.config.loader import load_config
from services.config.schema import LorabusConfig
from services.local import inference_servers, processes, trainer_site
from services.local.nats_server import NatsServer, NatsServerError, start_nats_server
from services.local.outcome import Outcome, exit_status, resume_hint
from services.local.ports import free_ports
from services.local.processes import Child
from services.local.server_watch import ServerWatch, WatchPolicy, kill_group
from services.local.summary import HELDOUT, Progress, print_summary, read_run, summary, training_done
from services.local.supervision import Restarts, describe_exit
from services.rollout import server_cmd

if TYPE_CHECKING:  # follow() imports the bus when the run starts; these names are for the checker
    from services.common.bus import Bus, MsgMeta


def trainer_launcher(cfg: LorabusConfig) -> list[str]:
    """What precedes `services.trainer`: plain `python -m`, or torchrun for several ranks
    (`--standalone`: a local rendezvous on a free port, so runs never collide)."""
    n = cfg.actor.nproc_per_node
    if n == 1:
        return [sys.executable, "-m"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m"]


def server_children(plans: list[inference_servers.ServerPlan], run_dir: Path) -> list[Child]:
    return [
        Child(p.name, p.argv, run_dir / f"{p.name}.log", url=p.url, env_extra=p.env, server=True, sidecar=p.replica)
        for p in plans
    ]


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
    for child, port in zip(children, free_ports(len(children)), strict=True):
        extra = [f"metrics.port={port}", "metrics.host=127.0.0.1"]
        # overrides are one positional group: keep them together, before any later flag
        at = child.argv.index("--replica") if "--replica" in child.argv else len(child.argv)
        child.argv[at:at] = extra
        component = "rollout" if child.name.startswith("rollout-") else child.name
        targets.append({"targets": [f"127.0.0.1:{port}"], "labels": {"component": component, "process": child.name}})
    (run_dir / "prometheus_targets.json").write_text(json.dumps(targets, indent=2))


def write_pids(run_dir: Path, children: list[Child], nats: NatsServer | None = None) -> None:
    """For operators and tests that want to signal one service (or the run's nats-server)."""
    pids = {c.name: c.pid for c in children if c.proc is not None}
    if nats is not None and nats.proc is not None:
        pids["nats-server"] = nats.proc.pid
    (run_dir / "pids.json").write_text(json.dumps(pids))


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


async def follow(cfg: LorabusConfig, progress: Progress) -> Bus:
    """Subscribe to the run's events for the progress line (core subscriptions: the launcher
    only watches; the summary is read from the streams)."""
    from services.common.bus import Bus

    bus = await Bus.connect(cfg.bus, run=cfg.run, service="launcher")
    run = cfg.run

    # the run's own events only (without NATS auth anyone may publish on these subjects)
    async def on_ready(msg: m.AdapterReady, _meta: MsgMeta) -> None:
        if msg.run == run:
            progress.head = max(progress.head, msg.version)

    async def on_step(msg: m.TrainerStep, _meta: MsgMeta) -> None:
        if msg.run == run:
            progress.last_step = msg

    async def on_decision(msg: m.TrajectoryDecision, _meta: MsgMeta) -> None:
        progress.verdicts[msg.verdict] = progress.verdicts.get(msg.verdict, 0) + 1

    async def on_report(msg: m.RolloutReport, _meta: MsgMeta) -> None:
        if msg.run == run:
            progress.serving.observe(msg)

    await bus.subscribe(subjects.adapter_ready_all(run), m.AdapterReady, on_ready)
    await bus.subscribe(subjects.trainer_step(run), m.TrainerStep, on_step)
    await bus.subscribe(subjects.decision_all(run), m.TrajectoryDecision, on_decision)
    await bus.subscribe(subjects.rollout_report_all(run), m.RolloutReport, on_report)

    async def on_run(record: m.RunRecord) -> None:
        if record.run == run or record.run in progress.others:
            return
        other = progress.others[record.run] = {"head": -1, "exported": -1, "scored": -1}
        try:  # its last version, which the evaluator scores under every policy
            progress.other_finals[record.run] = runconfig.restore(record.config, cfg).total_train_steps
        except Exception as exc:  # a record this launcher cannot read: its newest export counts as last
            print(f"lorabus up: run {record.run}'s config does not load here ({exc})", flush=True)

        async def on_other_ready(msg: m.AdapterReady, _meta: MsgMeta) -> None:
            other["head"] = max(other["head"], msg.version)

        async def on_other_export(msg: m.ExportDone, _meta: MsgMeta) -> None:
            other["exported"] = max(other["exported"], msg.version)

        async def on_other_eval(msg: m.EvalResult, _meta: MsgMeta) -> None:
            if msg.run == record.run:  # a stranger's "score" is not the run's
                other["scored"] = max(other["scored"], msg.version)

        await bus.subscribe(subjects.adapter_ready_all(record.run), m.AdapterReady, on_other_ready)
        await bus.subscribe(subjects.export_done_all(record.run), m.ExportDone, on_other_export)
        await bus.subscribe(subjects.eval_result(record.run, HELDOUT), m.EvalResult, on_other_eval)

    try:
        await RunTable(bus, run).watch(on_run)
    except Exception as exc:  # a bus user without rights on the run table: the own run only
        print(f"lorabus up: not following the fleet's other runs ({exc!r})", flush=True)
    return bus


async def accepted_unconsumed(bus: Bus, run: str) -> int | None:
    """Accepted trajectories the trainer has not (yet) acknowledged: nothing accepted is lost,
    it is either trained on or still here for the next run."""
    from services.common import streams

    trainer = streams.consumer(run, "trainer")
    try:
        return await bus.consumer_backlog(trainer.stream, trainer.durable)
    except Exception:  # server gone: the summary reports it unknown
        return None


@dataclass
class Deployment:
    """The children of one run; `pids.json` always lists every child that has been started."""

    children: list[Child]
    env: dict[str, str]
    run_dir: Path
    nats: NatsServer | None = None
    """the run's own nats-server (None with --bus-url)"""
    restarts: Restarts = field(default_factory=Restarts)

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
        write_pids(self.run_dir, self.children, self.nats)

    def restart_dead(self, now: float, finished: set[str]) -> str | None:
        """Restart every started child that died (names in `finished` exited because their
        work is done), after its backoff; returns why the run must end, or None."""
        for child in self.children:
            if child.proc is None or child.alive() or child.name in finished:
                continue
            how = describe_exit(child.returncode)
            pending = child.name in self.restarts.due
            delay = self.restarts.on_death(child.name, now)
            if delay is None:
                return (
                    f"{child.name} died ({how}) {self.restarts.policy.budget} times in "
                    f"{self.restarts.policy.window_s:.0f} s; given up"
                )
            if not pending:
                last = processes.log_tail(child.log_path, 1).strip()
                print(
                    f"lorabus up: {child.name} died ({how}); restarting it in {delay:.1f} s "
                    f"(restart {self.restarts.recent(child.name, now) + 1} of "
                    f"{self.restarts.policy.budget}){f'; its log ends: {last[:160]}' if last else ''}",
                    flush=True,
                )
            if self.restarts.ready(child.name, now):
                if child.server:  # what is left of its group (vLLM's engine core) goes first
                    kill_group(child)
                child.start(self.env)
                print(f"  restarted {child.name:<8} pid {child.pid}", flush=True)
                write_pids(self.run_dir, self.children, self.nats)
        return None

    def restart_held(self, child: Child) -> None:
        """Start a sidecar the server watch stopped with its server (counted as a restart)."""
        child.start(self.env)
        self.restarts.done.setdefault(child.name, []).append(time.monotonic())
        print(f"  restarted {child.name:<8} pid {child.pid}", flush=True)
        write_pids(self.run_dir, self.children, self.nats)

    def server_watch(self, start_timeout_s: float, health_timeout_s: float) -> ServerWatch:
        by_name = {c.name: c for c in self.children}
        sidecars = {s.name: by_name[s.sidecar] for s in self.servers if s.sidecar in by_name}
        policy = WatchPolicy(start_timeout_s=start_timeout_s, timeout_s=health_timeout_s)
        return ServerWatch(self.servers, sidecars, self.restart_held, policy)


async def watch_nats(nats: NatsServer, url: str, restarts: Restarts, now: float) -> str | None:
    """Bring the run's nats-server back on the same store (and port, which the clients reconnect
    to) when it died; returns why that is impossible, or None."""
    if nats.running:
        return None
    pending = "nats-server" in restarts.due
    delay = restarts.on_death("nats-server", now)
    if delay is None:
        return f"died {restarts.policy.budget} times; last log lines:\n{nats.log_tail(5)}"
    if not pending:
        how = describe_exit(nats.proc.returncode if nats.proc is not None else None)
        print(f"lorabus up: nats-server died ({how}); restarting it on {nats.store_dir} in {delay:.1f} s", flush=True)
    if not restarts.ready("nats-server", now):
        return None
    try:
        await asyncio.to_thread(nats.start)
    except NatsServerError as exc:
        return str(exc)
    if nats.url != url:
        return f"came back on {nats.url}, not {url} (the port was taken meanwhile); the services cannot follow"
    print(f"  restarted nats-server at {nats.url} (store {nats.store_dir})", flush=True)
    return None


async def supervise(
    dep: Deployment,
    cfg: LorabusConfig,
    args: argparse.Namespace,
    progress: Progress,
    stop: asyncio.Event,
    bus: Bus,
    nats: NatsServer | None,
) -> tuple[Outcome, str]:
    """Start the children in order, then keep them (and the run's nats-server) alive until the
    run is finished or one of the other ways out."""
    # the sidecars wait for their servers; the trainer starts meanwhile (v0 is ready sooner)
    dep.start([c for c in dep.children if c not in dep.rollouts])
    try:
        await inference_servers.wait_healthy(dep.servers, args.server_timeout, stop)
    except RuntimeError as exc:
        return Outcome.SERVERS_UNHEALTHY, str(exc)
    if stop.is_set():
        return Outcome.INTERRUPTED, ""
    dep.start(dep.rollouts)
    watch = dep.server_watch(args.server_timeout, server_cmd.health_timeout_s(cfg, dep.env))
    watch.started(time.monotonic())
    try:
        final_version = cfg.total_train_steps
        last_print = last_read = 0.0
        finished: set[str] = set()
        while not stop.is_set():
            now = time.monotonic()
            if now - last_print >= args.progress_every:
                print(progress.line(), flush=True)
                last_print = now
            if nats is not None and not nats.running:
                if lost := await watch_nats(nats, cfg.bus.url, dep.restarts, now):
                    return Outcome.BUS_LOST, lost
                write_pids(dep.run_dir, dep.children, nats)
            trainer = dep.trainer
            if not trainer.alive() and trainer.returncode == 0 and now - last_read >= 1.0:
                # the trainer's last step is done: the streams say whether the run is
                last_read = now
                try:
                    record = await read_run(bus, cfg.run)
                except Exception as exc:  # the server is being restarted: read again next time
                    print(f"lorabus up: cannot read the run's streams yet ({type(exc).__name__})", flush=True)
                    # a clean exit is judged on the streams, not restarted blind: a restarted
                    # trainer that finds the run done exits again, and reads as a crash loop
                    finished.add("trainer")
                else:
                    if progress.others_exported() and training_done(cfg, record, progress, args.evaluate, now):
                        return Outcome.FINISHED, ""
                    if record.head >= final_version:
                        finished.add("trainer")
                    else:  # stopped early (SIGTERM from outside): a restart resumes it
                        finished.discard("trainer")
            for line in await watch.tick(now):
                print(line, flush=True)
            if (gave_up := dep.restart_dead(now, finished | set(watch.held))) is not None:
                return Outcome.GAVE_UP, gave_up
            if now - progress.started > args.timeout:
                return Outcome.TIMEOUT, ""
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except TimeoutError:
                pass
        return Outcome.INTERRUPTED, ""
    finally:
        await watch.close()


async def report(
    cfg: LorabusConfig,
    bus: Bus,
    run_dir: Path,
    elapsed: float,
    restarts: dict[str, int],
    progress: Progress | None = None,
) -> None:
    """Read the run back from its streams, print the summary and write summary.json."""
    try:
        record = await read_run(bus, cfg.run)
    except Exception as exc:
        print(f"lorabus up: no summary: the run's streams cannot be read ({type(exc).__name__}: {exc})",
              file=sys.stderr)  # fmt: skip
        return
    result = summary(cfg, record, run_dir, elapsed, progress.eval_wait if progress else None)
    result["other_runs"] = dict(sorted(progress.others.items())) if progress else {}
    for other, seen in result["other_runs"].items():
        try:  # each submitted run's held-out curve, read back from its own streams as the own run's
            seen["eval_by_version"] = dict(sorted((await read_run(bus, other)).evals.items()))
        except Exception as exc:
            print(f"lorabus up: run {other}'s scores cannot be read ({type(exc).__name__})", file=sys.stderr)
    result["restarts"] = restarts
    result["accepted_unconsumed"] = await accepted_unconsumed(bus, cfg.run)
    (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
    print_summary(result)


async def run_up(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    cfg = load_config(args.config, overrides)
    try:
        start_servers = inference_servers.needs_servers(cfg)
        python = inference_servers.server_python(cfg, args.vllm_python, args.sglang_python) if start_servers else None
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
        nats = start_nats_server(run_dir / "nats")
        overrides.append(f"bus.url={nats.url}")
    cfg = load_config(args.config, overrides)
    progress = Progress()
    try:
        bus = await follow(cfg, progress)
    except Exception:
        if nats is not None:
            nats.stop()
        raise
    try:
        record = await read_run(bus, cfg.run)
        if record.finished(cfg, args.evaluate):
            print(f"lorabus up: run {cfg.run} in {run_dir} is already finished (v{cfg.total_train_steps} "
                  "exported); its summary, from the streams:")  # fmt: skip
            await report(cfg, bus, run_dir, 0.0, {})
            return 0
        if record.head >= 0:
            print(f"lorabus up: resuming run {cfg.run} at v{record.head} ({len(record.steps)} steps stored)")
        return await deploy(args, cfg, overrides, run_dir, python, progress, bus, nats)
    finally:
        await bus.close()
        if nats is not None:
            nats.stop()


async def deploy(
    args: argparse.Namespace,
    cfg: LorabusConfig,
    overrides: list[str],
    run_dir: Path,
    python: str | None,
    progress: Progress,
    bus: Bus,
    nats: NatsServer | None,
) -> int:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the children share 2 cores on a laptop-class machine: one thread each avoids oversubscription
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    try:
        plans = inference_servers.plan_servers(cfg, run_dir, python, args.server_site) if python is not None else []
        site = trainer_site.trainer_site(cfg, args.trainer_site)
    except (inference_servers.CannotStartServers, trainer_site.BadTrainerSite) as exc:
        print(f"lorabus up: {exc}", file=sys.stderr)
        return 2
    # servers first: stopped last
    children = server_children(plans, run_dir) + child_commands(
        cfg, args.config, overrides, run_dir, args.evaluate, plans
    )
    if site is not None:
        print(f"lorabus up: the trainer imports megatron-core/megatron-bridge from {site}")
        trainer_site.give_trainer(children, site)
    dep = Deployment(children, env, run_dir, nats)
    assign_metrics_ports([c for c in children if not c.server], run_dir)
    print(f"lorabus up: run {cfg.run} in {run_dir} (bus {cfg.bus.url})")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        outcome, detail = await supervise(dep, cfg, args, progress, stop, bus, nats)
    finally:
        print(progress.line(), flush=True)
        stop_children(children)
    exit_code, message = exit_status(outcome, detail, run_dir, args.timeout)
    await report(cfg, bus, run_dir, time.monotonic() - progress.started, dep.restarts.counts(), progress)
    if message is not None:
        print(f"lorabus up: {message}", file=sys.stderr)
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
    p.add_argument("--sglang-python", help="rollout.engine sglang without server_urls: a python with SGLang")
    p.add_argument("--server-site", help="a pip --target site of vLLM/SGLang, on the servers' PYTHONPATH only")
    p.add_argument(
        "--trainer-site",
        help="a pip --target site with megatron-core/megatron-bridge, on the trainer's PYTHONPATH only "
        f"(actor.backend megatron; default {trainer_site.DEFAULT_MEGATRON_SITE} if the launcher lacks them)",
    )
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds the servers may take to become healthy")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(run_up(args))
    except KeyboardInterrupt:
        return 130
    except Exception:  # a crash of the launcher itself: say how to go on, after the traceback
        traceback.print_exc()
        print(f"lorabus up: the launcher failed; {resume_hint('the run directory')}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
