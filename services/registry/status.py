"""`lorabus registry status --config FILE`: ask the running registry for its ledger and print
it (versions, who has them loaded, counts), or `--json` for the raw reply."""

from __future__ import annotations

import asyncio
import sys
from typing import ClassVar

import msgspec

from proto import subjects
from proto.codec import MAX_MESSAGE_BYTES
from proto.messages import Message, Name, UnixTime
from services.common import entry
from services.config.schema import LorabusConfig
from services.registry.policy import Ledger

STATUS_TIMEOUT_S = 3.0
PROG = "lorabus registry status"


class StatusRequest(Message, kw_only=True):
    """`lorabus.<run>.registry.status` request (core request/reply)."""

    run: Name


class RegistryStatus(Message, kw_only=True):
    """The registry's answer: its ledger (without the remembered trajectory ids, which are
    only counted) and the policy figures derived from it."""

    max_bytes: ClassVar[int] = MAX_MESSAGE_BYTES
    """the ledger grows with its replicas (up to MAX_REPLICAS) and grants: tens of KB in a busy run"""

    run: Name
    ledger: Ledger
    seen_count: int
    capacity: int
    max_head_offpolicyness: int
    consumer_batch_size: int
    max_concurrent_rollouts: int
    ledger_revision: int
    sent_at: UnixTime


def render(status: RegistryStatus) -> str:
    led = status.ledger
    head = "none" if led.head is None else f"v{led.head}"
    lines = [
        f"run {status.run}: head {head}, k={status.max_head_offpolicyness}, "
        f"B={status.consumer_batch_size}, max_concurrent={status.max_concurrent_rollouts}",
        f"accepted {led.accepted}, running {led.running}, capacity {status.capacity}, "
        f"trajectory ids remembered {status.seen_count}, ledger revision {status.ledger_revision}",
        "rejected: " + (", ".join(f"{k}={v}" for k, v in sorted(led.rejected.items())) or "none"),
        "denied:   " + (", ".join(f"{k}={v}" for k, v in sorted(led.denied.items())) or "none"),
        "",
        f"{'version':>7}  {'step':>5}  {'state':<8}  {'exported':<8}  loaded by",
    ]
    for v in sorted(led.versions, reverse=True):
        r = led.versions[v]
        state = "retired" if r.retired else ("head" if v == led.head else "live")
        loaded = ", ".join(sorted(r.loaded_by)) or "-"
        lines.append(
            f"{'v' + str(v):>7}  {r.trainer_step:>5}  {state:<8}  {'yes' if r.exported else 'no':<8}  {loaded}"
        )
    if led.replicas:
        header = f"{'replica':<16}  {'engine':<8}  {'loaded':<16}  {'failures':>8}  {'last seen':>13}  incarnation"
        lines += ["", header]
        for name in sorted(led.replicas):
            s = led.replicas[name]
            loaded = ",".join(f"v{v}" for v in sorted(s.loaded)) or "-"
            # a few characters tell a restart apart; the replaced ones count how often it restarted
            incarnation = f"{s.incarnation[:8] or '-'} ({len(s.replaced)} replaced)"
            lines.append(
                f"{name:<16}  {s.engine or '?':<8}  {loaded:<16}  {s.failures:>8}  {s.last_seen:>13.1f}  {incarnation}"
            )
    if led.grants:
        lines += ["", f"{'grant':<24}  {'version':>7}  {'replica':<16}  expires at"]
        for gid, g in sorted(led.grants.items(), key=lambda kv: kv[1].issued_at):
            lines.append(f"{gid:<24}  {'v' + str(g.version):>7}  {g.replica:<16}  {g.expires_at:.1f}")
    return "\n".join(lines)


async def fetch_status(cfg: LorabusConfig, timeout: float = STATUS_TIMEOUT_S) -> RegistryStatus:
    # a reader: it must not create or change the run's streams
    async with entry.connected(cfg, "registry-status", ensure_streams=False) as bus:
        return await bus.request(
            subjects.registry_status(cfg.run), StatusRequest(run=cfg.run), RegistryStatus,
            timeout=timeout,
        )  # fmt: skip


def main(argv: list[str]) -> int:
    import nats.errors

    from services.common.bus import BusError

    parser = entry.parser(PROG, "print the running registry's ledger")
    parser.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    args = parser.parse_args(argv)
    cfg = entry.start(args, PROG, service="registry-status")
    try:
        status = asyncio.run(fetch_status(cfg))
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        print(
            f"{PROG}: no registry answered on {subjects.registry_status(cfg.run)} "
            f"within {STATUS_TIMEOUT_S}s; is `lorabus registry --config {args.config}` running?",
            file=sys.stderr,
        )
        return 1
    except BusError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print(msgspec.json.format(msgspec.json.encode(status)).decode() if args.json else render(status))
    return 0
