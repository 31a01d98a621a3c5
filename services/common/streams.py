"""JetStream streams, KV buckets and durable consumers of one run: names, subjects, retention.

Every persisted subject family of `proto.subjects` is captured by exactly one stream. The
admission request/reply subject is deliberately in none: a stream capturing it would answer
the rollout's request with a PubAck before the registry could reply. Every durable consumer a
service runs is a row of `_CONSUMERS`; `deploy/nats/nats.conf` grants the API calls they need.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from proto import codec, subjects
from proto import messages as m

HOUR = 3600.0
DAY = 24 * HOUR
DUPLICATE_WINDOW_S = 120.0
"""how long JetStream remembers a Nats-Msg-Id: covers a publisher retrying across a restart"""

_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,255}$")


def stream_name(run: str, kind: str) -> str:
    """`LORABUS_<run>_<KIND>`; no dots, since stream names are tokens of JetStream API subjects."""
    name = f"LORABUS_{subjects.token(run, 'run')}_{kind}"
    if not _STREAM_NAME.match(name):
        raise ValueError(f"stream name {name!r}: use only [A-Za-z0-9_-], at most 255 characters")
    return name


def ADAPTERS(run: str) -> str:  # noqa: N802 - the contract names streams like constants
    return stream_name(run, "ADAPTERS")


def CANARIES(run: str) -> str:  # noqa: N802
    return stream_name(run, "CANARIES")


def REPORTS(run: str) -> str:  # noqa: N802
    return stream_name(run, "REPORTS")


def TRAJECTORIES(run: str) -> str:  # noqa: N802
    return stream_name(run, "TRAJECTORIES")


def ACCEPTED(run: str) -> str:  # noqa: N802
    return stream_name(run, "ACCEPTED")


def DECISIONS(run: str) -> str:  # noqa: N802
    return stream_name(run, "DECISIONS")


def EXPORTS(run: str) -> str:  # noqa: N802
    return stream_name(run, "EXPORTS")


def EVALS(run: str) -> str:  # noqa: N802
    return stream_name(run, "EVALS")


def TRAINER(run: str) -> str:  # noqa: N802
    return stream_name(run, "TRAINER")


def DEADLETTER(run: str) -> str:  # noqa: N802
    return stream_name(run, "DEADLETTER")


def ledger_bucket(run: str) -> str:
    """The registry's version ledger (JetStream KV; bucket names allow no dots either)."""
    return f"lorabus_{subjects.token(run, 'run')}_ledger"


def runs_bucket(fleet: str) -> str:
    """The fleet's run table: one `RunRecord` per run, key = run (JetStream KV)."""
    return f"lorabus_{subjects.token(fleet, 'fleet')}_runs"


def kv_stream(bucket: str) -> str:
    """The stream JetStream keeps KV bucket `bucket` in."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str = "") -> str:
    """The subject of `key` in KV bucket `bucket` (with no key: the prefix of every key's)."""
    return f"$KV.{bucket}.{key}"


# (stream, subject pattern, max_age, max_msgs_per_subject, message type); -1 = unlimited.
# Adapter events and exports are the run's history: services that start late replay them, so
# they are kept for the run's lifetime. Heartbeats are chatter: keep the recent ones only.
# Trajectories are kept a day so a registry that was down can catch up from its durable.
# Canaries have a stream of their own (ADAPTERS' consumers decode every message there as an
# AdapterReady) kept as long as the events they vouch for, one per version: a replica reads the
# newest of its version's subject, never the history.
# Each stream stores no message larger than its type's cap (`Message.max_bytes`): the server
# refuses an oversize publish before any service sees it.
_LAYOUT: list[tuple[Callable[[str], str], Callable[[str], str], float, int, Any]] = [
    (ADAPTERS, subjects.adapter_ready_all, 30 * DAY, -1, m.AdapterReady),
    (CANARIES, subjects.adapter_canary_all, 30 * DAY, 1, m.AdapterCanary),
    (REPORTS, subjects.rollout_report_all, 1 * HOUR, 100, m.RolloutReport),
    (TRAJECTORIES, subjects.trajectory_all, 1 * DAY, -1, m.Trajectory),
    (ACCEPTED, subjects.accepted, 1 * DAY, -1, m.Trajectory),
    (DECISIONS, subjects.decision_all, 1 * DAY, -1, m.TrajectoryDecision),
    (EXPORTS, subjects.export_done_all, 30 * DAY, -1, m.ExportDone),
    (EVALS, subjects.eval_result_all, 30 * DAY, -1, m.EvalResult),
    (TRAINER, subjects.trainer_step, 30 * DAY, -1, m.TrainerStep),
    (DEADLETTER, subjects.dead_letter_all, 7 * DAY, -1, m.DeadLetter),
]
_COMPARED = ("subjects", "retention", "discard", "max_age", "max_msgs_per_subject", "max_msg_size", "storage",
             "duplicate_window")  # fmt: skip


def differs(existing: StreamConfig, wanted: StreamConfig) -> bool:
    """Whether a stream as the server holds it differs from its definition (the fields set here)."""
    have, want = existing.as_dict(), wanted.as_dict()
    return any(have.get(key) != want.get(key) for key in _COMPARED)


def stream_configs(run: str, replicas: int = 1) -> list[StreamConfig]:
    """The streams `Bus.ensure_streams` creates or updates for `run`, each kept in `replicas`
    copies (3 on a three-node cluster: a stream, and the consumers on it, survive a node)."""
    return [
        StreamConfig(
            name=name(run),
            subjects=[subject(run)],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=max_age,
            max_msgs_per_subject=per_subject,
            max_msg_size=codec.max_bytes_of(msg_type),
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=replicas,
        )
        for name, subject, max_age, per_subject, msg_type in _LAYOUT
    ]


class Consumer(msgspec.Struct, frozen=True):
    """One durable pull consumer: where it reads and how the server redelivers to it."""

    durable: str
    stream: str
    filter_subject: str | None
    ack_wait_s: float
    """redelivery delay of an un-acked message (after a crash, or while a handler runs)"""
    max_deliver: int
    """deliveries before a failing message is dead-lettered; -1: never given up"""
    max_ack_pending: int


ACK_WAIT_S = 10.0
"""how soon the messages a dead reader held come back to its successor. Readers keep what they
hold alive with in-progress acks (`Puller.keep_alive`, the trainer's held batch), so a handler
may run for minutes (a large adapter to load or export); only a death lets the clock run out.
At k = 0 nothing else can fill the gap, so this is how long a killed service stalls the run
(it was 30 s for the trainer and registry, 120 s for rollouts and the exporter)."""

# (durable, stream, filter, ack_wait_s, max_deliver, max_ack_pending); `rollout-` is one row
# per replica (`rollout-<replica>`).
# The trainer holds a batch un-acked until its step is published and never gives a trajectory up.
_CONSUMERS: list[tuple[str, Callable[[str], str], Callable[[str], str] | None, float, int, int]] = [
    ("trainer", ACCEPTED, None, ACK_WAIT_S, -1, 64),
    ("exporter", ADAPTERS, subjects.adapter_ready_all, ACK_WAIT_S, 5, 1000),
    ("registry-adapters", ADAPTERS, None, ACK_WAIT_S, 5, 1000),
    ("registry-reports", REPORTS, None, ACK_WAIT_S, 5, 1000),
    ("registry-exports", EXPORTS, None, ACK_WAIT_S, 5, 1000),
    ("registry-trajectories", TRAJECTORIES, None, ACK_WAIT_S, 5, 1000),
    ("rollout-", ADAPTERS, None, ACK_WAIT_S, 5, 1000),
]


def consumer(run: str, durable: str) -> Consumer:
    """The consumer named `durable` of `run` (`rollout-<replica>` for a rollout replica)."""
    for name, stream, filter_subject, ack_wait_s, max_deliver, max_ack_pending in _CONSUMERS:
        if name.endswith("-"):  # one durable per replica: `rollout-<replica>`
            matches = durable.startswith(name) and len(durable) > len(name)
        else:
            matches = durable == name
        if matches:
            return Consumer(
                durable=durable,
                stream=stream(run),
                filter_subject=filter_subject(run) if filter_subject else None,
                ack_wait_s=ack_wait_s,
                max_deliver=max_deliver,
                max_ack_pending=max_ack_pending,
            )
    known = ", ".join(name + ("<replica>" if name.endswith("-") else "") for name, *_ in _CONSUMERS)
    raise ValueError(f"durable: {durable!r} is not a consumer of lorabus; use one of {known}")


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some concrete subject matches both NATS patterns (`*` one token, `>` the rest)."""
    ta, tb = a.split("."), b.split(".")
    for x, y in zip(ta, tb):
        if x == ">" or y == ">":
            return True
        if x != y and x != "*" and y != "*":
            return False
    if len(ta) == len(tb):
        return True
    # Different lengths and no `>` reached: no subject has both token counts.
    return False


def stream_for_subject(run: str, subject: str) -> str | None:
    """The stream that would capture a concrete `subject`, or None."""
    for config in stream_configs(run):
        if any(subjects_overlap(pattern, subject) for pattern in config.subjects or []):
            return config.name
    return None
