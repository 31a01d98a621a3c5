"""A run's life in the fleet's run table: pure decisions over `RunRecord`s and ledgers.

    active --stop--> stopping --no grant left--> stopped --resume--> active
    active --head reached total_train_steps--> finished

`active` runs get fleet grants; `stopping` ones get none but their in-flight groups are still
decided (and trained, if they complete a batch); `stopped` and `finished` runs keep their
versions, ledger and exports for good. A `stopped` run may be resumed under its own name: every
service serves it again from where it stopped (the trainer from its last checkpoint). A run
name is never reused in a fleet by another run: its streams and ledger outlive it. The registry
is the run table's only writer, so these functions need no locking; they decide, the registry
writes.
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import structs

from proto.messages import RunInfo, RunRecord, RunStateName
from services.config.schema import LorabusConfig
from services.registry.policy import Ledger

LIVE: tuple[RunStateName, ...] = ("active", "stopping")
"""states whose registry still runs (decisions, reports, exports)"""


def new_record(fleet: str, cfg: LorabusConfig, config: dict, now: float) -> RunRecord:
    return RunRecord(
        fleet=fleet,
        run=cfg.run,
        state="active",
        share=cfg.fleet.share,
        config=config,
        submitted_at=now,
        changed_at=now,
    )


def admit_problems(cfg: LorabusConfig, records: Mapping[str, RunRecord], max_runs: int) -> list[str]:
    """Why the fleet cannot take the run `cfg` now (config conflicts are `runconfig.conflicts`'s)."""
    a = cfg.actor
    if a.backend != "fsdp2" or a.nproc_per_node != 1:
        # the trainer adds a run as a peft adapter beside the others (FSDP2Engine.sibling)
        return [
            f"actor.backend: {a.backend!r} with actor.nproc_per_node {a.nproc_per_node}: this fleet's "
            "trainer cannot take a second run; runs share one trainer with backend fsdp2 and "
            "nproc_per_node 1 (start such a fleet for many runs)"
        ]
    if cfg.run in records:
        state = records[cfg.run].state
        return [
            f"run: {cfg.run!r} is already a run of this fleet ({state}); run names are never "
            "reused, since its streams and ledger stay (choose another run name)"
        ]
    live = sorted(r for r, rec in records.items() if rec.state in LIVE)
    if len(live) >= max_runs:
        return [
            f"fleet.max_runs: {max_runs} runs are live ({', '.join(live)}); stop one "
            "(`lorabus run stop NAME`) or raise fleet.max_runs in the fleet's config"
        ]
    return []


def stop(record: RunRecord, reason: str, now: float) -> RunRecord | None:
    """The record after a stop request, or None when there is nothing to change."""
    if record.state != "active":
        return None
    return structs.replace(record, state="stopping", changed_at=now, reason=reason or "stopped by request")


def resume_problems(record: RunRecord, live: int, max_runs: int) -> list[str]:
    """Why `record`'s run cannot be resumed now (slot room is `capacity.problems`'s)."""
    if record.state == "stopping":
        return [f"run: {record.run!r} is still stopping (groups in flight); resume it once `lorabus run list` "
                "says stopped"]  # fmt: skip
    if record.state == "finished":
        return [f"run: {record.run!r} finished its total_train_steps; submit a new run to train further"]
    if record.state == "stopped" and live >= max_runs:
        return [f"fleet.max_runs: {max_runs} runs are live; stop one (`lorabus run stop NAME`) before "
                f"resuming {record.run!r}"]  # fmt: skip
    return []


def resume(record: RunRecord, now: float) -> RunRecord | None:
    """The record of a resumed run, or None when it is active already."""
    if record.state != "stopped":
        return None
    return structs.replace(record, state="active", changed_at=now, reason="")


def settle(record: RunRecord, ledger: Ledger | None, total_train_steps: int, now: float) -> RunRecord | None:
    """The record's next state given its ledger, or None while it stays as it is."""
    if record.state == "stopping" and (ledger is None or ledger.running == 0):
        return structs.replace(record, state="stopped", changed_at=now)
    # the head's trainer step, not its number: a trainer restarted after announcing a version it
    # had not checkpointed resumes past it, so versions can run ahead of steps (seen in the chaos
    # tier at k = 0: finished at v24 after 22 steps, and the trainer waited for its last batch)
    if record.state == "active" and ledger is not None and ledger.head is not None:
        head = ledger.versions.get(ledger.head)
        if head is not None and head.trainer_step >= total_train_steps:
            return structs.replace(record, state="finished", changed_at=now, reason=f"v{ledger.head} published")
    return None


def info(record: RunRecord, cfg: LorabusConfig, ledger: Ledger | None, memory: int | None = None) -> RunInfo:
    """`memory`: the run's adapter bytes under a fleet memory budget (None: no budget)."""
    return RunInfo(
        run=record.run,
        lora_name=cfg.gconfig.lora_name,
        state=record.state,
        share=record.share,
        lora_rank=cfg.actor.lora_rank,
        total_train_steps=cfg.total_train_steps,
        head_version=None if ledger is None else ledger.head,
        running=0 if ledger is None else ledger.running,
        accepted=0 if ledger is None else ledger.accepted,
        reason=record.reason,
        adapter_memory_bytes=memory,
    )
