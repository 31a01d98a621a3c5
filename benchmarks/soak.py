"""Soak: one long `lorabus up` on the tiny task, with memory, files and stream sizes sampled.

    python benchmarks/soak.py [--versions 1000] [--interval 5] [--out benchmarks/results/soak_cpu.json]
    python benchmarks/soak.py --nats-gomemlimit 64MiB --out benchmarks/results/soak_cpu_nats_gomemlimit.json

Invariant of the result: every series is judged on its growth over the second half of the run
(versions N/2..N), where a bounded process or stream is flat; a series that grows is reported
with its rate (per 100 versions, and bytes per version for sizes), and is called expected only
where the design says it keeps every version (the store, the export directory) or where its
stream's retention is by age alone (`services/common/streams.py`: max_age, no max_bytes or
max_msgs), never merely because it grows slowly.

One `lorabus up --config examples/tiny.yaml total_train_steps=N` (its own nats-server, registry,
trainer, two embedded rollout replicas, exporter, evaluator). While it runs, every `--interval`
seconds, per process of the run (`pids.json`, plus the launcher): resident memory (VmRSS),
open file descriptors, threads, and GPU memory from nvidia-smi where there is one (None on a
CPU machine); each JetStream stream's messages and bytes, read from the run's nats-server
monitoring endpoint (`/jsz`; the port from the ports file named on its command line: the
benchmark reads, it never talks to JetStream); the bytes under the run directory's store,
export, checkpoints and nats directories; the trainer's published version and each rollout
replica's loaded-version count (`lorabus_rollout_loaded_versions`, from their metrics ports).

Summary per series, over the samples taken while the trainer trains (v0 published, vN not yet:
the shutdown that follows closes files and threads): the value after warm-up (the first sample at or past `--warmup` of
the versions), at the end, the maximum, the least-squares slope per 100 versions over the second
half, bytes per version (sizes: the slope from warm-up on), and a verdict: `bounded` when the
fitted growth over the second half is within the series' tolerance (TOLERANCES), or when the
peak of the last quarter is within it of the second quarter's (a sawtooth: the registry's
journal is compacted every 512 entries); else `grows (expected: why)` or `GROWS (unexplained)`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = "examples/tiny.yaml"

TOLERANCES = {
    "rss_mib": ("max(5% of the value after warm-up, 16 MiB)", lambda base: max(0.05 * base, 16.0)),
    "gpu_mib": ("max(5% of the value after warm-up, 64 MiB)", lambda base: max(0.05 * base, 64.0)),
    "fds": ("4 descriptors", lambda base: 4.0),
    "threads": ("2 threads", lambda base: 2.0),
    "loaded_versions": ("0 versions (the keep window is fixed)", lambda base: 0.5),
    "stream_msgs": ("max(5% of the value after warm-up, 16 messages)", lambda base: max(0.05 * base, 16.0)),
    "stream_bytes": ("max(5% of the value after warm-up, 64 KiB)", lambda base: max(0.05 * base, 65536.0)),
    "dir_bytes": ("max(5% of the value after warm-up, 64 KiB)", lambda base: max(0.05 * base, 65536.0)),
}
"""growth over the second half (fitted slope x its span of versions) that still counts as flat"""

JUDGED = tuple(TOLERANCES)
EXPECTED_DIRS = {
    "store": "every version's adapter object is kept: the ADAPTERS events that name them are the run's "
    "history (30 days) and nothing deletes them",
    "export": "the exporter writes every version as a PEFT directory, by design",
    "nats": "the streams' files: grows with the streams whose retention is by age (above)",
}


# --- one sample -------------------------------------------------------------------------------


def proc_status(pid: int) -> dict | None:
    """VmRSS (MiB), open descriptors and threads of `pid`; None when it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        return None
    return {
        "rss_mib": round(int(fields.get("VmRSS", "0 kB").split()[0]) / 1024, 2),
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def gpu_mib_by_pid() -> dict[int, float] | None:
    """GPU memory per process from nvidia-smi; None without one (a CPU machine)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    used: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0.0) + float(mib)
    return used


def monitor_url(nats_pid: int) -> str | None:
    """The run's nats-server monitoring URL: `nats_server.py` starts it with `-m -1` and a
    `--ports_file_dir`, and the server writes its ports there as `nats-server_<pid>.ports`."""
    try:
        argv = Path(f"/proc/{nats_pid}/cmdline").read_bytes().split(b"\0")
        ports_dir = argv[argv.index(b"--ports_file_dir") + 1].decode()
        ports = json.loads((Path(ports_dir) / f"nats-server_{nats_pid}.ports").read_text())
    except (OSError, ValueError, IndexError, json.JSONDecodeError):
        return None
    monitoring = ports.get("monitoring") or []
    return monitoring[0] if monitoring else None


def get(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except OSError:
        return None


def stream_sizes(monitor: str) -> dict[str, dict]:
    """Every stream of the server: messages, bytes and its limits (from /jsz)."""
    body = get(f"{monitor}/jsz?streams=true&config=true")
    if body is None:
        return {}
    sizes = {}
    for account in json.loads(body).get("account_details") or []:
        for s in account.get("stream_detail") or []:
            config, state = s.get("config") or {}, s.get("state") or {}
            sizes[s["name"]] = {
                "messages": state.get("messages", 0),
                "bytes": state.get("bytes", 0),
                "limits": {k: config.get(k) for k in ("max_age", "max_msgs", "max_bytes", "max_msgs_per_subject")},
            }
    return sizes


def dir_bytes(path: Path) -> int:
    """Apparent size of every file under `path` (what the run wrote, not the blocks it took)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def metrics_of(target: str) -> dict[tuple[str, str], float]:
    """(metric name, sorted labels) -> value from a Prometheus endpoint; {} when it is down."""
    from prometheus_client.parser import text_string_to_metric_families

    body = get(f"http://{target}/metrics", timeout=2.0)
    if body is None:
        return {}
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            values[(sample.name, json.dumps(sample.labels, sort_keys=True))] = sample.value
    return values


def metric(values: dict, name: str) -> float | None:
    return next((v for (n, _), v in values.items() if n == name), None)


class Sampler(threading.Thread):
    """Samples the run every `interval` s until `done` is set; `samples` grows by one dict each."""

    def __init__(self, run_dir: Path, launcher_pid: int, interval: float, prefix: str):
        super().__init__(daemon=True)
        self.run_dir, self.launcher_pid, self.interval, self.prefix = run_dir, launcher_pid, interval, prefix
        self.samples: list[dict] = []
        self.pids_seen: dict[str, list[int]] = {}
        self.done = threading.Event()
        self.started = time.monotonic()
        self.limits: dict[str, dict] = {}

    def short(self, stream: str) -> str:
        """`ADAPTERS` for the run's streams, `KV_ledger` for its KV buckets' streams."""
        if stream.startswith(self.prefix):
            return stream[len(self.prefix) :]
        return re.sub(r"^KV_lorabus_.*?_(ledger_parts|ledger|runs)$", r"KV_\1", stream)

    def run(self) -> None:
        while not self.done.is_set():
            try:
                sample = self.sample()
            except Exception as exc:  # a sample lost, not the soak: say so in the output
                print(f"soak: sample failed: {exc!r}", flush=True)
                sample = None
            if sample is not None:
                self.samples.append(sample)
            self.done.wait(self.interval)

    def sample(self) -> dict | None:
        try:
            pids = json.loads((self.run_dir / "pids.json").read_text())
            targets = json.loads((self.run_dir / "prometheus_targets.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        pids = {"launcher": self.launcher_pid, **pids}
        gpu = gpu_mib_by_pid()
        procs = {}
        for name, pid in pids.items():
            if pid not in self.pids_seen.setdefault(name, []):
                self.pids_seen[name].append(pid)
            status = proc_status(pid)
            if status is not None:
                status["gpu_mib"] = None if gpu is None else gpu.get(pid, 0.0)
                procs[name] = status
        streams = {}
        monitor = monitor_url(pids["nats-server"]) if "nats-server" in pids else None
        for name, s in (stream_sizes(monitor) if monitor else {}).items():
            streams[self.short(name)] = {"messages": s["messages"], "bytes": s["bytes"]}
            self.limits[self.short(name)] = s["limits"]
        version = None
        loaded: dict[str, dict] = {}
        for target in targets:
            process = target["labels"]["process"]
            if process == "trainer":
                version = metric(metrics_of(target["targets"][0]), "lorabus_trainer_version")
            elif process.startswith("rollout-"):
                values = metrics_of(target["targets"][0])
                loaded[process] = {
                    "loaded_versions": metric(values, "lorabus_rollout_loaded_versions"),
                    "loaded_version": metric(values, "lorabus_rollout_loaded_version"),
                }
        if version is None and "ADAPTERS" in streams:  # trainer between scrapes: v0..vN announced
            version = streams["ADAPTERS"]["messages"] - 1
        dirs = {d: dir_bytes(self.run_dir / d) for d in ("store", "export", "checkpoints", "nats")}
        return {
            "t": round(time.monotonic() - self.started, 2),
            "version": None if version is None else int(version),
            "load_1m": os.getloadavg()[0],
            "procs": procs,
            "streams": streams,
            "dirs": dirs,
            "rollouts": loaded,
        }


# --- the summary ------------------------------------------------------------------------------


def columns(samples: list[dict]) -> dict[str, list]:
    """The samples as series `kind.name` -> one value per sample (None where absent)."""
    keys: dict[str, None] = {}
    rows = []
    for s in samples:
        row = {}
        for name, p in s["procs"].items():
            for kind in ("rss_mib", "fds", "threads", "gpu_mib"):
                row[f"{kind}.{name}"] = p[kind]
        for name, st in s["streams"].items():
            row[f"stream_msgs.{name}"] = st["messages"]
            row[f"stream_bytes.{name}"] = st["bytes"]
        for name, size in s["dirs"].items():
            row[f"dir_bytes.{name}"] = size
        for name, r in s["rollouts"].items():
            row[f"loaded_versions.{name}"] = r["loaded_versions"]
        keys.update(dict.fromkeys(row))
        rows.append(row)
    return {k: [row.get(k) for row in rows] for k in keys}


def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs; None with fewer than 3 points or no spread in xs."""
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def expected_growth(series: str, limits: dict[str, dict], run_s: float) -> str | None:
    """Why a growing series is by design, or None (a leak until shown otherwise)."""
    kind, _, name = series.partition(".")
    if kind == "dir_bytes":
        return EXPECTED_DIRS.get(name)
    if kind in ("stream_msgs", "stream_bytes"):
        lim = limits.get(name) or {}
        max_age_s = (lim.get("max_age") or 0) / 1e9
        by_size = any((lim.get(k) or -1) > 0 for k in ("max_msgs", "max_bytes"))
        if (per_subject := lim.get("max_msgs_per_subject") or -1) > 0:
            return f"max_msgs_per_subject {per_subject}: flat once every subject holds {per_subject}"
        if not by_size and max_age_s > run_s:
            return (f"retention by age only (max_age {max_age_s / 3600:.0f} h, no max_msgs/max_bytes): "
                    f"grows until its oldest messages are {max_age_s / 3600:.0f} h old")  # fmt: skip
    return None


def verdict(growth: float, peak_growth: float | None, tolerance: float, why: str | None) -> str:
    """`bounded` when the fitted second-half growth is within tolerance, or when it is not but
    the peaks are flat (a sawtooth: a journal compacted every so often, a collector's cycle)."""
    if growth <= tolerance:
        return "bounded"
    if peak_growth is not None and peak_growth <= tolerance:
        return "bounded (peaks flat: the fit follows a sawtooth)"
    return f"grows (expected: {why})" if why is not None else "GROWS (unexplained)"


def summarise(samples: list[dict], versions: int, warmup: float, limits: dict[str, dict]) -> dict:
    # the trainer exits once it has published the last version, the others are stopped soon
    # after, and a process shutting down closes files and threads: judge the run while it trains
    training = [s for s in samples if s["version"] is not None and 0 <= s["version"] < versions]
    cols = columns(training)
    vs = [s["version"] for s in training]
    run_s = training[-1]["t"] if training else 0.0
    warm_v, half_v = warmup * versions, versions / 2
    out = {}
    for series, values in cols.items():
        kind = series.partition(".")[0]
        points = [(v, y) for v, y in zip(vs, values) if v is not None and y is not None]
        if not points:
            continue
        after = next((y for v, y in points if v >= warm_v), points[-1][1])
        second = [(v, y) for v, y in points if v >= half_v]
        slope = fit_slope([v for v, _ in second], [y for _, y in second])
        whole = fit_slope([v for v, _ in points if v >= warm_v], [y for v, y in points if v >= warm_v])
        row: dict = {
            "after_warmup": after,
            "end": points[-1][1],
            "max": max(y for _, y in points),
            "slope_per_100_versions": None if slope is None else round(100 * slope, 4),
            "samples": len(points),
        }
        if kind in ("stream_bytes", "dir_bytes") and whole is not None:
            row["bytes_per_version"] = round(whole, 1)
        if kind in JUDGED and slope is not None:
            span = max(v for v, _ in second) - min(v for v, _ in second)
            growth = slope * span
            tolerance = TOLERANCES[kind][1](float(after))
            second_quarter = [y for v, y in points if versions / 4 <= v < half_v]
            last_quarter = [y for v, y in points if v >= 3 * versions / 4]
            peak_growth = max(last_quarter) - max(second_quarter) if second_quarter and last_quarter else None
            row["second_half_growth"] = round(growth, 3)
            row["peak_growth"] = None if peak_growth is None else round(peak_growth, 3)
            row["tolerance"] = round(tolerance, 3)
            row["verdict"] = verdict(growth, peak_growth, tolerance, expected_growth(series, limits, run_s))
        out[series] = row
    return out


# --- the run ----------------------------------------------------------------------------------


def soak(args: argparse.Namespace, run_dir: Path) -> dict:
    from services.common import streams
    from services.config.loader import load_config

    overrides = [f"run_dir={run_dir}", f"total_train_steps={args.versions}", *args.overrides]
    cfg = load_config(CONFIG, overrides)
    prefix = streams.stream_name(cfg.run, "X")[:-1]
    cmd = [sys.executable, "-m", "services.local.launcher", "--config", CONFIG, "--timeout", str(args.timeout),
           "--progress-every", "30", *overrides]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "up.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        env = dict(os.environ)
        if args.nats_gomemlimit:  # read by the Go runtime only: the nats-server, not the services
            env["GOMEMLIMIT"] = args.nats_gomemlimit
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(run_dir, proc.pid, args.interval, prefix)
        sampler.start()
        next_line = 0.0
        while proc.poll() is None:
            time.sleep(1.0)
            if time.monotonic() >= next_line and sampler.samples:
                s = sampler.samples[-1]
                rss = sum(p["rss_mib"] for n, p in s["procs"].items())
                print(f"[{s['t']:7.0f}s] v{s['version']} of {args.versions}  RSS {rss:.0f} MiB  "
                      f"load {s['load_1m']:.1f}", flush=True)  # fmt: skip
                next_line = time.monotonic() + 60
        sampler.done.set()
        sampler.join()
    wall = time.monotonic() - started
    final_dirs = {d: dir_bytes(run_dir / d) for d in ("store", "export", "checkpoints", "nats")}
    summary_file = run_dir / "summary.json"
    run_summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    samples = sampler.samples
    versions_done = max((s["version"] for s in samples if s["version"] is not None), default=None)
    run_s = samples[-1]["t"] if samples else wall
    return {
        "launcher_exit": proc.returncode,
        "wall_s": round(wall, 1),
        "versions_reached": versions_done,
        "s_per_version": round(run_s / versions_done, 3) if versions_done else None,
        "restarts": {name: len(pids) - 1 for name, pids in sampler.pids_seen.items()},
        "launcher_restarts": run_summary.get("restarts"),
        "trajectories": run_summary.get("trajectories"),
        "stream_limits": sampler.limits,
        "final_dir_bytes": final_dirs,
        "series": summarise(samples, args.versions, args.warmup, sampler.limits),
        "samples": {
            "t": [s["t"] for s in samples],
            "version": [s["version"] for s in samples],
            "load_1m": [round(s["load_1m"], 2) for s in samples],
            **columns(samples),
        },
    }


def table(doc: dict) -> str:
    def fmt(x) -> str:
        if x is None:
            return "-"
        if isinstance(x, float) and not x.is_integer():
            return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
        return f"{int(x)}"

    lines = [f"{'series':<34} {'after warm-up':>13} {'end':>12} {'max':>12} {'/100 v':>10} {'B/version':>10}  verdict"]
    for name, r in doc["series"].items():
        if "verdict" not in r:
            continue
        lines.append(
            f"{name:<34} {fmt(r['after_warmup']):>13} {fmt(r['end']):>12} {fmt(r['max']):>12} "
            f"{fmt(r['slope_per_100_versions']):>10} {fmt(r.get('bytes_per_version')):>10}  {r['verdict']}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=1000, help="total_train_steps of the run")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument(
        "--warmup", type=float, default=0.1, help="fraction of the versions before the 'after warm-up' value"
    )
    ap.add_argument("--timeout", type=float, help="the launcher's --timeout (default 300 s + 5 s per version)")
    ap.add_argument("--run-dir", help="keep the run here (default: a temporary directory, removed)")
    ap.add_argument(
        "--nats-gomemlimit",
        help="GOMEMLIMIT for the run's nats-server (e.g. 64MiB): tells the Go heap it keeps from the heap it uses",
    )
    ap.add_argument("--note", default="", help="said in the JSON (the machine's load, what else ran)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/soak_cpu.json"))
    ap.add_argument("overrides", nargs="*", help="config overrides for the run, key=value")
    args = ap.parse_args()
    args.timeout = args.timeout or 300.0 + 5.0 * args.versions
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        run_dir = Path(args.run_dir).resolve() if args.run_dir else Path(tmp) / "run"
        result = soak(args, run_dir)
    doc = {
        "benchmark": "soak",
        "task": CONFIG,
        "versions": args.versions,
        "interval_s": args.interval,
        "warmup_versions": args.warmup * args.versions,
        "second_half_from_version": args.versions / 2,
        "tolerances": {kind: text for kind, (text, _) in TOLERANCES.items()},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "gpu": shutil.which("nvidia-smi") is not None,
        },
        "nats_gomemlimit": args.nats_gomemlimit,
        "note": args.note,
        **result,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    print(f"{doc['versions_reached']} of {args.versions} versions in {doc['wall_s']} s "
          f"({doc['s_per_version']} s/version), launcher exit {doc['launcher_exit']}; wrote {out}")  # fmt: skip
    return 0 if doc["launcher_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
