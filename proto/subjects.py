"""Subject names: every builder and parser lives here, so no service spells a subject itself.

All subjects of one run share the prefix `lorabus.<run>.`; tokens (run, replica, service,
evaluator) are `[A-Za-z0-9_-]` so that they never contain NATS separators or wildcards.
"""

from __future__ import annotations

import re

PREFIX = "lorabus"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# parsers accept exactly what the builders produce: tokens of 1-64, versions without leading zeros
_TOK = r"([A-Za-z0-9_-]{1,64})"
_VER = r"(0|[1-9][0-9]*)"
_ADAPTER_READY = re.compile(rf"^{PREFIX}\.{_TOK}\.adapter\.v{_VER}\.ready$")
_ADAPTER_CANARY = re.compile(rf"^{PREFIX}\.{_TOK}\.canary\.v{_VER}$")
_EXPORT_DONE = re.compile(rf"^{PREFIX}\.{_TOK}\.export\.v{_VER}\.done$")
_ROLLOUT = re.compile(rf"^{PREFIX}\.{_TOK}\.rollout\.{_TOK}\.([a-z]+)$")
_TRAJECTORY = re.compile(rf"^{PREFIX}\.{_TOK}\.trajectory\.{_TOK}$")


class SubjectError(ValueError):
    pass


def token(value: str, what: str = "name") -> str:
    """Check one subject token; the error says which field and what is allowed."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise SubjectError(f"{what}: {value!r} is not a valid subject token; use 1-64 of [A-Za-z0-9_-]")
    return value


def _version(version: int) -> int:
    # a float would add a '.' (a token separator) to the subject
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SubjectError(f"version: {version!r} must be an integer >= 0")
    return version


def run_prefix(run: str) -> str:
    return f"{PREFIX}.{token(run, 'run')}"


# adapter versions
def adapter_ready(run: str, version: int) -> str:
    return f"{run_prefix(run)}.adapter.v{_version(version)}.ready"


def adapter_ready_all(run: str) -> str:
    return f"{run_prefix(run)}.adapter.*.ready"


def parse_adapter_ready(subject: str) -> tuple[str, int]:
    m = _ADAPTER_READY.fullmatch(subject)
    if not m:
        raise SubjectError(f"{subject!r} is not an adapter-ready subject")
    return m.group(1), int(m.group(2))


# a version's canary, published after its adapter event (AdapterReady.canary_follows)
def adapter_canary(run: str, version: int) -> str:
    return f"{run_prefix(run)}.canary.v{_version(version)}"


def adapter_canary_all(run: str) -> str:
    return f"{run_prefix(run)}.canary.*"


def parse_adapter_canary(subject: str) -> tuple[str, int]:
    m = _ADAPTER_CANARY.fullmatch(subject)
    if not m:
        raise SubjectError(f"{subject!r} is not an adapter-canary subject")
    return m.group(1), int(m.group(2))


# rollout reports: kind is loaded | unloaded | failed | heartbeat
ROLLOUT_KINDS = ("loaded", "unloaded", "failed", "heartbeat")


def rollout_report(run: str, replica: str, kind: str) -> str:
    if kind not in ROLLOUT_KINDS:
        raise SubjectError(f"kind: {kind!r} is not one of {ROLLOUT_KINDS}")
    return f"{run_prefix(run)}.rollout.{token(replica, 'replica')}.{kind}"


def rollout_report_all(run: str) -> str:
    return f"{run_prefix(run)}.rollout.*.*"


def parse_rollout_report(subject: str) -> tuple[str, str, str]:
    m = _ROLLOUT.fullmatch(subject)
    if not m or m.group(3) not in ROLLOUT_KINDS:
        raise SubjectError(f"{subject!r} is not a rollout report subject")
    return m.group(1), m.group(2), m.group(3)


# admission: core request/reply, never captured by a stream (a stream would answer with a
# PubAck on the reply inbox before the registry does)
def admission(run: str) -> str:
    return f"{run_prefix(run)}.registry.admission"


def registry_status(run: str) -> str:
    return f"{run_prefix(run)}.registry.status"


# trajectories: rollouts publish here, the registry decides, accepted ones go to `accepted`
def trajectory(run: str, replica: str) -> str:
    return f"{run_prefix(run)}.trajectory.{token(replica, 'replica')}"


def parse_trajectory(subject: str) -> tuple[str, str]:
    """`lorabus.<run>.trajectory.<replica>` -> (run, replica): who sent a trajectory (with NATS
    auth, only that replica's user may publish there)."""
    m = _TRAJECTORY.fullmatch(subject)
    if not m:
        raise SubjectError(f"{subject!r} is not a trajectory subject")
    return m.group(1), m.group(2)


def trajectory_all(run: str) -> str:
    return f"{run_prefix(run)}.trajectory.*"


def accepted(run: str) -> str:
    return f"{run_prefix(run)}.accepted"


def decision(run: str, replica: str) -> str:
    return f"{run_prefix(run)}.decision.{token(replica, 'replica')}"


def decision_all(run: str) -> str:
    return f"{run_prefix(run)}.decision.*"


# exporter, evaluators, trainer, dead letters
def export_done(run: str, version: int) -> str:
    return f"{run_prefix(run)}.export.v{_version(version)}.done"


def export_done_all(run: str) -> str:
    return f"{run_prefix(run)}.export.*.done"


def parse_export_done(subject: str) -> tuple[str, int]:
    m = _EXPORT_DONE.fullmatch(subject)
    if not m:
        raise SubjectError(f"{subject!r} is not an export-done subject")
    return m.group(1), int(m.group(2))


def eval_result(run: str, evaluator: str) -> str:
    return f"{run_prefix(run)}.eval.{token(evaluator, 'evaluator')}"


def eval_result_all(run: str) -> str:
    return f"{run_prefix(run)}.eval.*"


def trainer_step(run: str) -> str:
    return f"{run_prefix(run)}.trainer.step"


def dead_letter(run: str, service: str) -> str:
    return f"{run_prefix(run)}.deadletter.{token(service, 'service')}"


def dead_letter_all(run: str) -> str:
    return f"{run_prefix(run)}.deadletter.*"


# the fleet: runs submitted, listed, stopped and resumed at runtime, and admission for any of its runs.
# `<fleet>` is the fleet's name (the `run` of the config `lorabus up` started it with); these
# subjects are core request/reply, captured by no stream, and share no pattern with a run's.
RUN_OPS = ("submit", "list", "stop", "resume")


def run_control(fleet: str, op: str) -> str:
    if op not in RUN_OPS:
        raise SubjectError(f"op: {op!r} is not one of {RUN_OPS}")
    return f"{PREFIX}.{token(fleet, 'fleet')}.fleet.run.{op}"


def fleet_admission(fleet: str) -> str:
    return f"{PREFIX}.{token(fleet, 'fleet')}.fleet.admission"
