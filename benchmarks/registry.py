"""Registry throughput and latency over a real nats-server.

Starts nats-server (services.common.nats_server) and the registry as its own process
(`python -m services.registry`), then N concurrent clients, each a replica, loop: request
admission -> publish the trajectory (JetStream) -> wait for its decision. Reports decisions/s,
admission and decision latency percentiles, and the registry's ledger writes per decision
(group commit), as a table and as JSON (`--out FILE`).

    .venv/bin/python benchmarks/registry.py --clients 32 --seconds 10 --out bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proto import subjects  # noqa: E402
from proto.messages import (  # noqa: E402
    AdapterReady,
    AdmissionGrant,
    AdmissionReply,
    AdmissionRequest,
    Completion,
    LoraSpec,
    ObjectPayload,
    Trajectory,
    TrajectoryDecision,
)
from services.common.bus import Bus  # noqa: E402
from services.common.config_schema import BusConfig  # noqa: E402
from services.common.nats_server import start_nats_server  # noqa: E402
from services.registry.status import RegistryStatus, StatusRequest  # noqa: E402

RUN = "bench"


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def write_config(path: Path, url: str, clients: int, metrics_port: int) -> None:
    # k and B so large that the staleness budget never binds: this measures the machinery.
    path.write_text(
        f"""
run: {RUN}
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


async def client(bus: Bus, i: int, stop_at: float, tokens: int, out: dict) -> None:
    replica = f"c{i}"
    inbox: asyncio.Queue = asyncio.Queue()

    async def on_decision(msg: TrajectoryDecision, meta) -> None:
        inbox.put_nowait((time.perf_counter(), msg))

    await bus.subscribe(subjects.decision(RUN, replica), TrajectoryDecision, on_decision)
    n = 0
    while time.perf_counter() < stop_at:
        n += 1
        t0 = time.perf_counter()
        reply = await bus.request(
            subjects.admission(RUN),
            AdmissionRequest(run=RUN, replica=replica, request_id=f"{replica}-{n}", loaded_versions=[0]),
            AdmissionReply,
            timeout=5.0,
        )
        t1 = time.perf_counter()
        if not isinstance(reply, AdmissionGrant):
            out["denied"] += 1
            await asyncio.sleep(reply.retry_after_s)
            continue
        out["admit"].append(t1 - t0)
        traj = Trajectory(
            run=RUN, trajectory_id=f"{replica}-t{n}", grant_id=reply.grant_id, replica=replica,
            prompt_id="p", prompt_token_ids=list(range(32)),
            completions=[Completion(token_ids=[7] * tokens, logprobs=[-0.5] * tokens,
                                    versions=[0] * tokens, reward=1.0) for _ in range(4)],
            started_at=time.time(), finished_at=time.time(),
        )  # fmt: skip
        t2 = time.perf_counter()
        await bus.publish(subjects.trajectory(RUN, replica), traj, msg_id=traj.trajectory_id)
        got_at, decision = await asyncio.wait_for(inbox.get(), 10.0)
        assert decision.trajectory_id == traj.trajectory_id, decision
        out["decide"].append(got_at - t2)
        out["round"].append(got_at - t0)
        out["verdicts"][decision.verdict] = out["verdicts"].get(decision.verdict, 0) + 1


async def bench(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lorabus-bench-"))
    server = start_nats_server(tmp / "nats")
    config = tmp / "registry.yaml"
    metrics_port = 19000 + os.getpid() % 1000
    write_config(config, server.url, args.clients, metrics_port)
    log = open(tmp / "registry.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, *(["-m", "cProfile", "-o", args.profile] if args.profile else []),
         "-m", "services.registry", "--config", str(config), "--log-level", "WARNING"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    bus = await Bus.connect(BusConfig(url=server.url), run=RUN, service="bench")
    try:
        await bus.ensure_streams()
        for _ in range(200):
            try:
                await bus.request(subjects.registry_status(RUN), StatusRequest(run=RUN), RegistryStatus, timeout=0.5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        lora = LoraSpec(rank=8, alpha=16, target_modules=["q_proj"], base_model="b")
        await bus.publish(subjects.adapter_ready(RUN, 0), AdapterReady(
            run=RUN, lora_name="l", version=0, trainer_step=0, created_at=time.time(), lora=lora,
            payloads=[ObjectPayload(uri="file:///x", bytes=1, sha256="0" * 64)]), msg_id="v0")  # fmt: skip
        while (await bus.request(subjects.registry_status(RUN), StatusRequest(run=RUN), RegistryStatus)).ledger.head != 0:
            await asyncio.sleep(0.05)

        # warm-up, then the measured window
        out = {"admit": [], "decide": [], "round": [], "denied": 0, "verdicts": {}}
        await asyncio.gather(*(client(bus, i, time.perf_counter() + 1.0, args.tokens, out) for i in range(args.clients)))
        writes0 = scrape(metrics_port, "lorabus_registry_ledger_writes_total")
        pids = {"registry": proc.pid, "nats_server": server.proc.pid, "clients": os.getpid()}
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        out = {"admit": [], "decide": [], "round": [], "denied": 0, "verdicts": {}}
        start = time.perf_counter()
        stop_at = start + args.seconds
        await asyncio.gather(*(client(bus, args.clients + i, stop_at, args.tokens, out) for i in range(args.clients)))
        elapsed = time.perf_counter() - start
        writes = scrape(metrics_port, "lorabus_registry_ledger_writes_total") - writes0
        cpu = {k: round(cpu_seconds(p) - cpu0[k], 2) for k, p in pids.items()}
        st = await bus.request(subjects.registry_status(RUN), StatusRequest(run=RUN), RegistryStatus)
    finally:
        await bus.close()
        proc.terminate()
        proc.wait(timeout=10)
        server.close()
    n = len(out["decide"])
    ms = lambda xs, q: round(percentile(xs, q) * 1e3, 3)  # noqa: E731
    return {
        "clients": args.clients,
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
        "ledger_bytes_at_end_approx": None if st is None else len(__import__("msgspec").json.encode(st.ledger)),
        "seen_remembered": st.seen_count,
        "cpu_seconds": cpu,
        "registry_cpu_us_per_decision": round(cpu["registry"] / max(n, 1) * 1e6, 1),
        "load_average_1m": os.getloadavg()[0],
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per completion (4 per group)")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--profile", help="run the registry under cProfile, stats to this file")
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    rows = [
        ("clients", result["clients"]),
        ("decisions/s", result["decisions_per_s"]),
        ("admissions/s", result["admissions_per_s"]),
        ("admission p50 / p99 ms", f"{result['admit_ms']['p50']} / {result['admit_ms']['p99']}"),
        ("decision p50 / p99 ms", f"{result['decision_ms']['p50']} / {result['decision_ms']['p99']}"),
        ("round trip p50 / p99 ms", f"{result['round_trip_ms']['p50']} / {result['round_trip_ms']['p99']}"),
        ("ledger writes / decision", result["ledger_writes_per_decision"]),
        ("verdicts", result["verdicts"]),
        ("cpu seconds", result["cpu_seconds"]),
        ("registry CPU us / decision", result["registry_cpu_us_per_decision"]),
        ("load average (1 min)", result["load_average_1m"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
