"""What `lorabus up` reports: a progress line from live events, and a summary from the streams.

The summary is read back from the run's JetStream streams (`read_run`), never from what the
launcher happened to receive live: events published while it was disconnected (a restarted
nats-server) or before it started (a resumed run) are counted, and counted once. Duplicates in
the streams are resolved the way the services resolve them: a trajectory's first decision wins
(a redelivered trajectory gets its decision published again), a trainer step is one step
however often it was announced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proto import messages as m
from services.clients import eval_policy
from services.local import consistency, delivery

if TYPE_CHECKING:
    from services.common.bus import Bus
    from services.config.schema import EvaluatorConfig, LorabusConfig


@dataclass
class Serving:
    """Which versions each replica serves, from its reports in stream order: a version counts
    from its AdapterLoaded until an AdapterFailed gives it up there (a load given up, or a
    version withdrawn after its canary failed); a failure that will be retried leaves it."""

    versions: dict[str, set[int]] = field(default_factory=dict)

    def observe(self, report: m.RolloutReport) -> None:
        if isinstance(report, m.AdapterLoaded):
            self.versions.setdefault(report.replica, set()).add(report.version)
        elif isinstance(report, m.AdapterFailed) and not report.will_retry:
            self.versions.setdefault(report.replica, set()).discard(report.version)

    def newest(self) -> dict[str, int]:
        """replica -> the newest version it serves (-1: none left)"""
        return {r: max(vs, default=-1) for r, vs in sorted(self.versions.items())}


@dataclass
class Progress:
    """What the launcher learns from live events: the progress line only."""

    started: float = field(default_factory=time.monotonic)
    """time.monotonic() when the run started"""
    head: int = -1
    last_step: m.TrainerStep | None = None
    verdicts: dict[str, int] = field(default_factory=dict)
    serving: Serving = field(default_factory=Serving)
    eval_wait: EvalWait | None = None
    """set once the last version is exported while scores are missing"""
    others: dict[str, dict[str, int]] = field(default_factory=dict)
    """runs submitted to the fleet: run -> newest version announced (head), exported and scored
    by the held-out evaluator (-1: none yet)"""
    other_finals: dict[str, int] = field(default_factory=dict)
    """a submitted run -> its last version (its total_train_steps), which every policy scores"""

    def others_exported(self) -> bool:
        """Every submitted run's newest version is exported (its last, once the trainer is gone)."""
        return all(o["exported"] >= o["head"] for o in self.others.values())

    def others_unscored(self, e: EvaluatorConfig) -> list[str]:
        """Submitted runs whose newest exported version the evaluator owes a score (`run vN`).
        Its durable takes a run's exports in order, so that score comes after the earlier ones."""
        out = []
        for run, o in sorted(self.others.items()):
            newest = o["exported"]
            final = self.other_finals.get(run, newest)
            if newest >= 0 and o.get("scored", -1) < newest and eval_policy.wanted(e, newest, final):
                out.append(f"{run} v{newest}")
        return out

    def line(self) -> str:
        last = self.last_step
        reward = f"{last.reward_mean:.3f}" if last else "-"
        tps = f"{last.tokens / last.step_seconds:.0f}" if last and last.step_seconds else "-"
        accepted = self.verdicts.get("accepted", 0)
        rejected = sum(v for k, v in self.verdicts.items() if k != "accepted")
        replicas = " ".join(f"{r}:v{v}" for r, v in self.serving.newest().items()) or "-"
        waiting = f" | {self.eval_wait.line(time.monotonic())}" if self.eval_wait else ""
        return (
            f"[{time.monotonic() - self.started:6.1f}s] head v{max(self.head, 0)} | reward {reward} | "
            f"accepted {accepted} rejected {rejected} | train tok/s {tps} | replicas {replicas}{waiting}"
        )


@dataclass
class EvalWait:
    """The last version is exported; scores are still missing. The run waits for them at most
    `max_wait_s` (evaluator.max_wait_s), then ends with what it has."""

    since: float
    """time.monotonic() when the wait began"""
    max_wait_s: float
    missing: list[int]
    """the own run's versions still to score"""
    waited_s: float = 0.0
    """how long it waited, once it is over"""
    others: list[str] = field(default_factory=list)
    """submitted runs' newest versions still to score, as `run vN`"""

    def names(self) -> list[str]:
        return [f"v{v}" for v in self.missing] + self.others

    def over(self, now: float) -> bool:
        return not self.names() or now - self.since >= self.max_wait_s

    def line(self, now: float) -> str:
        names = self.names()
        if not names:
            return "evaluation done"
        if self.waited_s:
            return f"stopped waiting for the evaluator after {self.waited_s:.0f}s: {len(names)} version(s) unscored"
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return (
            f"training done, waiting for the evaluator: {len(names)} version(s) to score "
            f"({shown}); {now - self.since:.0f}s of at most {self.max_wait_s:.0f}s"
        )


@dataclass
class RunRecord:
    """A run as its streams hold it."""

    head: int = -1
    steps: dict[int, m.TrainerStep] = field(default_factory=dict)
    """step index -> its last announcement"""
    decisions: dict[str, m.TrajectoryDecision] = field(default_factory=dict)
    """trajectory id -> its first decision"""
    exported: dict[int, str] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)
    serving: Serving = field(default_factory=Serving)
    failed_loads: int = 0
    """AdapterFailed reports that gave the version up (will_retry false)"""
    loads: list[m.AdapterLoaded] = field(default_factory=list)
    """every first load of a version on a replica (not the re-loads of a restore)"""

    def verdicts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for d in self.decisions.values():
            counts[d.verdict] = counts.get(d.verdict, 0) + 1
        return counts

    def unscored(self, cfg: LorabusConfig, evaluate: bool) -> list[int]:
        """Exported versions the evaluator will still score (`evaluator.versions` decides which)."""
        if not evaluate:
            return []
        return eval_policy.still_to_score(cfg.evaluator, self.exported, self.evals, cfg.total_train_steps)

    def finished(self, cfg: LorabusConfig, evaluate: bool) -> bool:
        """The last version is exported and every score the evaluator owes is in."""
        return cfg.total_train_steps in self.exported and not self.unscored(cfg, evaluate)


def training_done(cfg: LorabusConfig, record: RunRecord, progress: Progress, evaluate: bool, now: float) -> bool:
    """Once the last version is exported: True when no score is missing or the bounded wait for
    them is over. Starts (and updates) `progress.eval_wait` while scores are missing."""
    if cfg.total_train_steps not in record.exported:
        return False
    missing = record.unscored(cfg, evaluate)
    # the fleet's evaluator scores the submitted runs too: their last scores are waited for alike
    others = progress.others_unscored(cfg.evaluator) if evaluate else []
    if progress.eval_wait is None:
        if not missing and not others:
            return True
        progress.eval_wait = EvalWait(now, cfg.evaluator.max_wait_s, missing, others=others)
        print(f"lorabus up: {progress.eval_wait.line(now)}", flush=True)
    wait = progress.eval_wait
    wait.missing, wait.others = missing, others
    if not wait.over(now):
        return False
    wait.waited_s = now - wait.since
    if names := wait.names():
        print(
            f"lorabus up: stopped waiting for the evaluator after {wait.waited_s:.0f}s "
            f"(evaluator.max_wait_s); {len(names)} version(s) unscored: {', '.join(names)}",
            flush=True,
        )
    return True


HELDOUT = "heldout"
"""the name `lorabus up` starts its evaluator under (`lorabus evaluate`'s default)"""


async def read_run(bus: Bus, run: str) -> RunRecord:
    from services.common import streams

    record = RunRecord()
    ready: list[m.AdapterReady] = await bus.read_all(streams.ADAPTERS(run), m.AdapterReady)
    record.head = max((ev.version for ev in ready), default=-1)
    # only the run's own steps and reports: without NATS auth anyone may publish on their
    # subjects, and a stranger's step must neither replace the run's nor skew its figures
    steps: list[m.TrainerStep] = await bus.read_all(streams.TRAINER(run), m.TrainerStep)
    record.steps = {step.step: step for step in steps if step.run == run}
    decisions: list[m.TrajectoryDecision] = await bus.read_all(streams.DECISIONS(run), m.TrajectoryDecision)
    for d in decisions:
        record.decisions.setdefault(d.trajectory_id, d)
    # only the run's own exports and the held-out evaluator's scores (without NATS auth anyone
    # may publish on export.* and eval.*: a stranger's "score" must not become the run's)
    exports: list[m.ExportDone] = await bus.read_all(streams.EXPORTS(run), m.ExportDone)
    record.exported = {done.version: done.uri for done in exports if done.run == run}
    evals: list[m.EvalResult] = await bus.read_all(streams.EVALS(run), m.EvalResult)
    record.evals = {r.version: r.score for r in evals if r.run == run and r.evaluator == HELDOUT}
    reports: list[m.RolloutReport] = await bus.read_all(streams.REPORTS(run), m.RolloutReport)
    for report in (r for r in reports if r.run == run):
        record.serving.observe(report)
        if isinstance(report, m.AdapterLoaded):
            if report.load_seconds > 0:  # a restore's re-load reports 0 and no canary
                record.loads.append(report)
        elif isinstance(report, m.AdapterFailed) and not report.will_retry:
            record.failed_loads += 1
    return record


def summary(
    cfg: LorabusConfig, record: RunRecord, run_dir: Path, elapsed: float, eval_wait: EvalWait | None = None
) -> dict:
    steps = [record.steps[i] for i in sorted(record.steps)]
    # the reward of the groups a step consumed describes the policies that generated them:
    # attribute it to the version the step started from
    per_version = {step.version - 1: step.reward_mean for step in steps}
    staleness = [
        d.head_version - d.oldest_version
        for d in record.decisions.values()
        if d.verdict == "accepted" and d.oldest_version is not None
    ]
    return {
        "run": cfg.run,
        "run_dir": str(run_dir),
        "elapsed_s": round(elapsed, 1),
        "head_version": record.head,
        "trainer_steps": len(steps),
        "reward_by_version": per_version,
        "eval_by_version": dict(sorted(record.evals.items())),
        "trajectories": record.verdicts(),
        "max_accepted_staleness": max(staleness, default=0),
        "max_head_offpolicyness": cfg.rollout.max_head_offpolicyness,
        "exported": dict(sorted(record.exported.items())),
        "trained_groups": sum(step.groups for step in steps),
        "loaded": record.serving.newest(),
        "adapter_versions_given_up": record.failed_loads,
        "eval_unscored": eval_wait.missing if eval_wait else [],
        "eval_unscored_other_runs": eval_wait.others if eval_wait else [],
        "eval_waited_s": round(eval_wait.waited_s, 1) if eval_wait else 0.0,
        "train_infer_mismatch": consistency.mismatch(steps),
        "canary": consistency.canary_cost(steps, record.loads),
        "delivery": delivery.delivery(steps, record.loads),
    }


def print_summary(result: dict) -> None:
    print("\n== lorabus run summary ==")
    print(
        f"run {result['run']}: {result['trainer_steps']} steps, head v{result['head_version']}, "
        f"{result['elapsed_s']} s; logs in {result['run_dir']}"
    )
    print(f"trajectories: {result['trajectories']}")
    for line in [*consistency.lines(result), *delivery.lines(result)]:
        print(line)
    if result.get("restarts"):
        print(f"restarts: {result['restarts']}")
    if result["eval_unscored"]:
        print(
            f"evaluator: still scoring {len(result['eval_unscored'])} version(s) "
            f"({', '.join(f'v{v}' for v in result['eval_unscored'])}) when the wait for it ended after "
            f"{result['eval_waited_s']} s (evaluator.max_wait_s); the scores below are the ones it had"
        )
    elif result["eval_waited_s"]:
        print(f"evaluator: the last scores came {result['eval_waited_s']} s after training ended")
    if others := result.get("eval_unscored_other_runs"):
        print(f"evaluator: submitted runs still to score when the wait ended: {', '.join(others)}")
    for other, seen in result.get("other_runs", {}).items():
        scores = " ".join(f"v{v} {score:.3f}" for v, score in seen.get("eval_by_version", {}).items())
        shown = f", held-out {scores}" if scores else ""
        print(f"run {other} (submitted): head v{seen['head']}, exported v{seen['exported']}{shown}")
    print(f"{'version':>8} {'train reward':>13} {'eval score':>11}  export")
    versions = sorted(set(result["reward_by_version"]) | set(result["exported"]))
    for v in versions:
        reward = result["reward_by_version"].get(v)
        score = result["eval_by_version"].get(v)
        print(
            f"{v:>8} {'' if reward is None else f'{reward:.3f}':>13} "
            f"{'' if score is None else f'{score:.3f}':>11}  {result['exported'].get(v, '')}"
        )
