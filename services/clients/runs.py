"""`lorabus run submit FILE | list | stop NAME | resume NAME --config FLEET`: the runs of a running fleet.

`--config` is the fleet's config (the file `lorabus up` was started with): it says where the
bus is and which fleet to talk to, and it is what a run file is laid over. `submit` checks the
run file here first (the same check the registry repeats), so a broken file is reported
without a round trip; the registry has the last word (run names, max_runs).

Exit status: 0 done, 1 the fleet refused or did not answer, 2 a config problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import msgspec
import nats.errors

from proto import subjects
from proto.messages import RunReply
from services.common import entry
from services.common.adapter_memory import human
from services.config.loader import ConfigError
from services.config.schema import LorabusConfig

PROG = "lorabus run"


def parse(argv: list[str]) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", required=True, help="the fleet's config (the file `lorabus up` was started with)")
    common.add_argument("--log-level", default="WARNING")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the registry's answer")
    p = argparse.ArgumentParser(prog=PROG, description="submit, list, stop and resume the runs of a running fleet")
    sub = p.add_subparsers(dest="op", required=True)
    s = sub.add_parser("submit", parents=[common], help="add a run: FILE holds its run keys (docs/multi-run.md)")
    s.add_argument("file")
    sub.add_parser("list", parents=[common], help="the fleet's runs").add_argument("--json", action="store_true")
    t = sub.add_parser("stop", parents=[common], help="stop granting a run work; its versions and exports stay")
    t.add_argument("name")
    t.add_argument("--reason", default="")
    r = sub.add_parser("resume", parents=[common], help="serve a stopped run again, from its last checkpoint")
    r.add_argument("name")
    # key=value overrides of the fleet's config may come anywhere, as for `lorabus up`
    args, rest = p.parse_known_args(argv)
    bad = [r for r in rest if "=" not in r or r.startswith("-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (overrides of the fleet's config are key=value)")
    args.overrides = rest
    return args


def render(reply: RunReply) -> str:
    # the memory column only where the fleet has a memory budget (the registry sizes runs then)
    memory = any(r.adapter_memory_bytes is not None for r in reply.runs)
    lines = [
        f"{'run':<24} {'state':<9} {'share':>5} {'rank':>4} {'lora_name':<16} {'head':>6} {'steps':>5} "
        f"{'running':>7} {'accepted':>8}" + (f" {'memory':>10}" if memory else "") + "  reason"
    ]
    for r in reply.runs:
        head = "-" if r.head_version is None else f"v{r.head_version}"
        size = "-" if r.adapter_memory_bytes is None else human(r.adapter_memory_bytes)
        lines.append(
            f"{r.run:<24} {r.state:<9} {r.share:>5g} {r.lora_rank:>4} {r.lora_name:<16} {head:>6} "
            f"{r.total_train_steps:>5} {r.running:>7} {r.accepted:>8}"
            + (f" {size:>10}" if memory else "")
            + (f"  {r.reason}" if r.reason else "")
        )
    return "\n".join(lines)


async def ask(args: argparse.Namespace, fleet: LorabusConfig, run_tree: dict | None, run_name: str) -> RunReply:
    from services.common.run_table import RunTable

    async with entry.connected(fleet, "run-cli", ensure_streams=False) as bus:
        table = RunTable(bus, fleet.run)
        if args.op == "submit":
            assert run_tree is not None
            return await table.submit(run_name, run_tree, timeout=args.timeout)
        if args.op == "stop":
            return await table.stop(args.name, args.reason, timeout=args.timeout)
        if args.op == "resume":
            return await table.resume(args.name, timeout=args.timeout)
        return await table.list(timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    fleet = entry.start(args, PROG, service="run-cli")
    run_tree, run_name = None, ""
    if args.op == "submit":
        from services.config import runconfig

        try:
            run_tree, cfg = runconfig.load_run(fleet, runconfig.fleet_tree(args.config, args.overrides), args.file)
        except ConfigError as exc:
            print(f"{PROG} submit: {exc}", file=sys.stderr)
            return 2
        run_name = cfg.run
    from services.common.bus import BusError

    try:
        reply = asyncio.run(ask(args, fleet, run_tree, run_name))
    except BusError as exc:
        print(f"{PROG} {args.op}: {exc}", file=sys.stderr)
        return 1
    except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError):
        subject = subjects.run_control(fleet.run, args.op)
        print(
            f"{PROG} {args.op}: no registry of fleet {fleet.run!r} answered on {subject} within "
            f"{args.timeout}s; is the fleet up (`lorabus up --config {args.config}`)?",
            file=sys.stderr,
        )
        return 1
    if not reply.ok:
        listed = "\n".join(f"  - {p}" for p in reply.problems)
        print(f"{PROG} {args.op}: fleet {reply.fleet!r} refused:\n{listed}", file=sys.stderr)
        return 1
    if args.op == "list" and args.json:
        print(json.dumps(msgspec.to_builtins(reply.runs), indent=2))
    elif args.op == "list":
        print(render(reply))
    else:
        verb = {"submit": "submitted to", "stop": "stopping in", "resume": "resumed in"}[args.op]
        for r in reply.runs:
            size = "" if r.adapter_memory_bytes is None else f", trainer memory {human(r.adapter_memory_bytes)}"
            print(f"run {r.run} {verb} fleet {reply.fleet}: {r.state}, share {r.share:g}, rank {r.lora_rank}{size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
