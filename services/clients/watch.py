"""`lorabus watch --config FILE`: print the run's events live, one line each.

A read-only bus user (the `evaluator` NATS identity in deployments is enough): it subscribes to
`lorabus.<run>.>` with a core subscription, so it never creates consumers or changes the run.
`--json` prints the raw JSON instead, for piping into `jq`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from types import UnionType
from typing import TYPE_CHECKING

from proto import codec, subjects
from proto import messages as m
from services.common import entry
from services.config.schema import LorabusConfig

PROG = "lorabus watch"

if TYPE_CHECKING:
    from nats.aio.msg import Msg

_BY_FAMILY: dict[str, type | UnionType] = {  # a Struct, or a tagged union of them
    "adapter": m.AdapterReady,
    "export": m.ExportDone,
    "eval": m.EvalResult,
    "trainer": m.TrainerStep,
    "decision": m.TrajectoryDecision,
    "trajectory": m.Trajectory,
    "deadletter": m.DeadLetter,
    "rollout": m.RolloutReport,
}


def describe(subject: str, data: bytes) -> str:
    """One human line per event; unknown or undecodable events are shown, not hidden."""
    family = subject.split(".")[2] if subject.count(".") >= 2 else ""
    type_ = _BY_FAMILY.get(family)
    if type_ is None:
        return f"{subject} ({len(data)} bytes)"
    try:
        msg = codec.decode(data, type_)
    except codec.DecodeError as exc:
        return f"{subject} UNDECODABLE ({exc.reason}): {exc}"
    return f"{subject} {_summary(msg)}"


def _summary(msg) -> str:
    match msg:
        case m.AdapterReady():
            kinds = ",".join(type(p).__name__.removesuffix("Payload").lower() for p in msg.payloads)
            return f"{msg.adapter_name} step={msg.trainer_step} r={msg.lora.rank} via={kinds}"
        case m.AdapterLoaded():
            return f"{msg.replica} loaded v{msg.version} via {msg.via} in {msg.load_seconds:.3f}s"
        case m.AdapterUnloaded():
            return f"{msg.replica} unloaded v{msg.version} ({msg.reason})"
        case m.AdapterFailed():
            return f"{msg.replica} FAILED v{msg.version} attempt {msg.attempt}: {msg.reason}"
        case m.ReplicaHeartbeat():
            return f"{msg.replica} {msg.engine} loaded={msg.loaded_versions} in_flight={msg.in_flight}"
        case m.TrainerStep():
            return (
                f"step {msg.step} -> v{msg.version} loss={msg.loss:.4f} "
                f"reward={msg.reward_mean:.3f} tokens={msg.tokens} {msg.step_seconds:.2f}s"
            )
        case m.TrajectoryDecision():
            return f"{msg.trajectory_id} {msg.verdict} head=v{msg.head_version} {msg.reason}".rstrip()
        case m.Trajectory():
            rewards = [round(c.reward, 2) for c in msg.completions]
            return f"{msg.trajectory_id} v{msg.oldest_version()} rewards={rewards}"
        case m.ExportDone():
            return f"v{msg.version} exported to {msg.uri}"
        case m.EvalResult():
            return f"v{msg.version} {msg.metric}={msg.score:.4f} (n={msg.n}) by {msg.evaluator}"
        case m.DeadLetter():
            return f"from {msg.service}: {msg.reason} on {msg.subject}: {msg.error}"
    return repr(msg)


async def watch(
    cfg: LorabusConfig,
    as_json: bool,
    include_trajectories: bool,
    out: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    stop = entry.stop_event(stop)
    # read-only: the watcher's identity may not create streams, and needs none
    async with entry.connected(cfg, "watch", ensure_streams=False) as bus:
        # a raw subscription: show every message, even ones this build cannot decode
        async def on_msg(msg: Msg) -> None:
            if not include_trajectories and ".trajectory." in msg.subject:
                return
            out(f"{msg.subject} {msg.data.decode(errors='replace')}" if as_json else describe(msg.subject, msg.data))

        await bus.subscribe_raw(f"{subjects.run_prefix(cfg.run)}.>", on_msg)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = entry.parser(PROG, __doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print raw JSON payloads")
    p.add_argument("--trajectories", action="store_true", help="include trajectory messages")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = entry.start(args, PROG, service="watch")
    asyncio.run(watch(cfg, args.json, args.trajectories))
    return 0


if __name__ == "__main__":
    sys.exit(main())
