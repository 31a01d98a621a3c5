"""A run's life in the run table (services/registry/runs.py): admission, stop, settling."""

from __future__ import annotations

import msgspec

from services.config.schema import LorabusConfig
from services.registry import runs
from services.registry.policy import Grant, VersionRecord, new_ledger


def cfg(run: str, **actor) -> LorabusConfig:
    return msgspec.convert({"run": run, "total_train_steps": 3, "actor": actor}, LorabusConfig)


def test_admit_refuses_reused_names_full_fleets_and_trainers_that_cannot_share():
    records = {"a": runs.new_record("f", cfg("a"), {}, 1.0)}
    assert runs.admit_problems(cfg("b"), records, max_runs=2) == []
    assert "never reused" in runs.admit_problems(cfg("a"), records, max_runs=2)[0]
    assert runs.admit_problems(cfg("b"), records, max_runs=1)[0].startswith("fleet.max_runs: 1 runs are live (a)")
    stopped = {"a": msgspec.structs.replace(records["a"], state="stopped")}
    assert runs.admit_problems(cfg("b"), stopped, max_runs=1) == []
    problem = runs.admit_problems(cfg("b", backend="megatron"), records, max_runs=2)[0]
    assert problem.startswith("actor.backend: 'megatron'") and "fsdp2" in problem


def test_stop_then_settle_when_no_grant_is_left():
    record = runs.new_record("f", cfg("a"), {}, 1.0)
    stopping = runs.stop(record, "", 2.0)
    assert stopping is not None and (stopping.state, stopping.reason) == ("stopping", "stopped by request")
    assert runs.stop(stopping, "again", 3.0) is None
    ledger = new_ledger("a")
    ledger.grants["g"] = Grant(version=0, replica="r", request_id="q", issued_at=0, expires_at=9)
    assert runs.settle(stopping, ledger, 3, 4.0) is None
    ledger.grants.clear()
    stopped = runs.settle(stopping, ledger, 3, 5.0)
    assert stopped is not None and stopped.state == "stopped" and stopped.changed_at == 5.0


def test_an_active_run_finishes_when_its_head_reaches_its_steps():
    record = runs.new_record("f", cfg("a"), {}, 1.0)
    ledger = new_ledger("a")
    assert runs.settle(record, ledger, 3, 2.0) is None
    ledger.head = 2
    ledger.versions[2] = VersionRecord(published_at=0, trainer_step=2, digest="")
    assert runs.settle(record, ledger, 3, 2.0) is None
    ledger.head = 4  # a restarted trainer resumed past an unsaved v3: v4 is still its second step
    ledger.versions[4] = VersionRecord(published_at=0, trainer_step=2, digest="")
    assert runs.settle(record, ledger, 3, 2.0) is None
    ledger.head = 3
    ledger.versions[3] = VersionRecord(published_at=0, trainer_step=3, digest="")
    done = runs.settle(record, ledger, 3, 2.0)
    assert done is not None and done.state == "finished" and done.reason == "v3 published"
    info = runs.info(done, cfg("a", lora_rank=4), ledger)
    assert (info.state, info.lora_rank, info.head_version, info.total_train_steps) == ("finished", 4, 3, 3)


def test_only_a_stopped_run_resumes_and_only_with_room():
    record = runs.new_record("f", cfg("a"), {}, 1.0)
    stopped = msgspec.structs.replace(record, state="stopped", reason="failed in trainer: x", changed_at=2.0)
    assert runs.resume_problems(stopped, live=1, max_runs=2) == []
    resumed = runs.resume(stopped, 3.0)
    assert resumed is not None and (resumed.state, resumed.reason, resumed.changed_at) == ("active", "", 3.0)
    assert runs.resume(record, 3.0) is None  # active already: nothing to change
    assert runs.resume_problems(stopped, live=2, max_runs=2)[0].startswith("fleet.max_runs: 2 runs are live")
    stopping = msgspec.structs.replace(record, state="stopping")
    assert "still stopping" in runs.resume_problems(stopping, live=1, max_runs=2)[0]
    finished = msgspec.structs.replace(record, state="finished")
    assert "submit a new run" in runs.resume_problems(finished, live=1, max_runs=2)[0]
