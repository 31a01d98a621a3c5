"""The run summary's policy-consistency figures: the train/inference mismatch and the canary's cost.

Read from what the streams hold (`summary.read_run`): each TrainerStep's mismatch (k3 KL and
|Δ logprob|, `services.trainer.mismatch`) and canary seconds, each replica's AdapterLoaded.
The mismatch of version v is the on-policy figure of the step that started from v: the only
moment the trainer holds v's weights, so the only clean comparison with the tokens v generated.
A version's time to servable on a replica is its AdapterLoaded.loaded_at minus the trainer's
step end (TrainerStep.trained_at). The canary's cost is its part of that time: what the trainer's
announcement waited for it (TrainerStep.canary_wait_seconds: 0 where the canary follows the event
as its own message, AdapterReady.canary_follows; its compute where it came before the event),
plus the replica's check where it came before the version was marked loaded (replicas that
report it, AdapterLoaded.canary_seconds). A replica checks a version while it serves it (first
waiting for a canary that follows) and holds its output until the check passes: that check is
no part of time to servable (counted here as beside serving), and its cost to the run, what
publication waited for it, is on the replica's /metrics (`lorabus_rollout_canary_seconds`,
`lorabus_rollout_canary_wait_seconds`), not in the streams.

Invariant: pure (no I/O); steps and loads that predate these fields count as absent, never as 0.
"""

from __future__ import annotations

from collections.abc import Iterable

from proto import messages as m


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def _pooled(figs: list[m.MismatchFigures]) -> dict | None:
    """Token-weighted means and the largest maxima of several steps' figures."""
    n = sum(f.tokens for f in figs)
    if n == 0:
        return None
    return {
        "tokens": n,
        "kl_mean": _round(sum(f.kl_mean * f.tokens for f in figs) / n),
        "kl_max": _round(max(f.kl_max for f in figs)),
        "abs_logprob_diff_mean": _round(sum(f.abs_mean * f.tokens for f in figs) / n),
        "abs_logprob_diff_max": _round(max(f.abs_max for f in figs)),
    }


def mismatch(steps: Iterable[m.TrainerStep]) -> dict | None:
    """The run's train/inference mismatch: pooled over steps, and per version (on-policy)."""
    measured = [s for s in steps if s.mismatch is not None]
    if not measured:
        return None
    on_policy = {s.version - 1: s.mismatch.on_policy for s in measured if s.mismatch and s.mismatch.on_policy}
    return {
        "estimator": "k3: exp(r) - 1 - r per token, r = trainer logprob - behaviour logprob (KL(behave || trainer))",
        "on_policy": _pooled(list(on_policy.values())),
        "all_tokens": _pooled([s.mismatch.all_tokens for s in measured if s.mismatch]),
        "by_version": {v: _pooled([f]) for v, f in sorted(on_policy.items())},
        "refused_groups": sum(s.mismatch.refused_groups for s in measured if s.mismatch),
        "steps_measured": len(measured),
    }


def _waited(step: m.TrainerStep) -> float | None:
    """The trainer's part of the time to servable: what the announcement waited for the canary
    (0 where it followed the event; all of its compute, from trainers that do not say)."""
    return step.canary_wait_seconds if step.canary_wait_seconds is not None else step.canary_seconds


def canary_cost(steps: Iterable[m.TrainerStep], loads: Iterable[m.AdapterLoaded]) -> dict | None:
    """What the canaries cost: seconds on each side and their share of time to servable (a load
    without canary_seconds, of a version the trainer computed a canary for, was checked beside
    serving: nothing of the replica's check in its time to servable)."""
    by_version = {s.version: s for s in steps}
    trainer = [s.canary_seconds for s in by_version.values() if s.canary_seconds is not None]
    replica = [ld.canary_seconds for ld in loads if ld.canary_seconds is not None]
    if not trainer and not replica:
        return None
    waited = {v: _waited(s) for v, s in by_version.items()}
    servable, fractions, beside = [], [], 0
    for ld in loads:
        step = by_version.get(ld.version)
        wait = waited.get(ld.version)
        if step is None or step.trained_at is None or wait is None:
            continue
        total = ld.loaded_at - step.trained_at
        if total <= 0:
            continue
        servable.append(total)
        fractions.append((wait + (ld.canary_seconds or 0.0)) / total)
        beside += ld.canary_seconds is None

    def stats(xs: list[float]) -> dict | None:
        return {"n": len(xs), "mean": _round(sum(xs) / len(xs)), "max": _round(max(xs))} if xs else None

    return {
        "trainer_seconds": stats(trainer),
        "trainer_wait_seconds": stats([w for w in waited.values() if w is not None]),
        "replica_seconds": stats(replica),
        "replica_checks_beside_serving": beside,
        "time_to_servable_s": stats(servable),
        "fraction_of_time_to_servable": stats(fractions),
    }


def lines(result: dict) -> list[str]:
    """The summary's printed lines for these figures (none when the run has none)."""
    out = []
    mm = result.get("train_infer_mismatch")
    if mm:
        for scope in ("on_policy", "all_tokens"):
            f = mm.get(scope)
            if f:
                out.append(
                    f"train/inference mismatch ({scope}, k3): KL mean {f['kl_mean']:.3g} max {f['kl_max']:.3g}, "
                    f"|Δ logprob| mean {f['abs_logprob_diff_mean']:.3g} max {f['abs_logprob_diff_max']:.3g} "
                    f"over {f['tokens']} tokens"
                )
        if mm.get("refused_groups"):
            out.append(f"groups refused beyond actor.max_train_infer_kl: {mm['refused_groups']}")
    cost = result.get("canary")
    if cost:
        parts = []
        if cost.get("trainer_seconds"):
            wait = cost.get("trainer_wait_seconds") or {"mean": 0.0}
            parts.append(f"trainer {cost['trainer_seconds']['mean'] * 1e3:.1f} ms (waited {wait['mean'] * 1e3:.1f} ms)")
        if cost.get("replica_seconds"):
            parts.append(f"replica {cost['replica_seconds']['mean'] * 1e3:.1f} ms")
        if cost.get("replica_checks_beside_serving"):
            parts.append("replica checks beside serving (their wait: lorabus_rollout_canary_wait_seconds)")
        if cost.get("fraction_of_time_to_servable"):
            frac, tts = cost["fraction_of_time_to_servable"], cost["time_to_servable_s"]
            parts.append(
                f"{frac['mean']:.1%} of time to servable (mean {tts['mean'] * 1e3:.0f} ms; worst {frac['max']:.1%})"
            )
        out.append("canary: " + ", ".join(parts))
    return out
