"""The run summary's issue-28 figures (`services.local.consistency`): the mismatch per version and
pooled, and the canary's share of time to servable; and the replica's tolerance by dtype."""

from __future__ import annotations

import msgspec
import pytest

from proto import messages as m
from services.local import consistency
from services.rollout.canary import TOLERANCE, tolerance


def figs(tokens: int, kl: float, kl_max: float, ab: float, ab_max: float) -> m.MismatchFigures:
    return m.MismatchFigures(tokens=tokens, kl_mean=kl, kl_max=kl_max, abs_mean=ab, abs_max=ab_max)


def step(version: int, *, mismatch: m.Mismatch | None, trained_at: float | None = 100.0,
         canary_s: float | None = 0.01) -> m.TrainerStep:  # fmt: skip
    return m.TrainerStep(run="r", step=version - 1, version=version, loss=0.0, reward_mean=0.0, groups=2, tokens=10,
                         step_seconds=1.0, finished_at=trained_at or 1.0, trained_at=trained_at,
                         canary_seconds=canary_s, mismatch=mismatch)  # fmt: skip


def loaded(version: int, at: float, canary_s: float | None) -> m.AdapterLoaded:
    return m.AdapterLoaded(run="r", replica="a", version=version, via="object", load_seconds=0.05, loaded_at=at,
                           canary_seconds=canary_s)  # fmt: skip


def test_mismatch_is_pooled_by_tokens_and_given_per_version():
    a, b = figs(10, 1e-3, 0.01, 0.02, 0.1), figs(30, 3e-3, 0.05, 0.04, 0.3)
    steps = [
        step(1, mismatch=m.Mismatch(on_policy=a, all_tokens=a)),
        step(2, mismatch=m.Mismatch(on_policy=b, all_tokens=figs(40, 4e-3, 0.2, 0.05, 0.9), refused_groups=1)),
        step(3, mismatch=m.Mismatch(on_policy=None, all_tokens=figs(5, 0.01, 0.02, 0.1, 0.2))),
        step(4, mismatch=None),  # a trainer that predates the figures
    ]
    out = consistency.mismatch(steps)
    assert out["on_policy"] == {"tokens": 40, "kl_mean": 0.0025, "kl_max": 0.05, "abs_logprob_diff_mean": 0.035,
                                "abs_logprob_diff_max": 0.3}  # fmt: skip
    assert out["all_tokens"]["tokens"] == 55 and out["all_tokens"]["kl_max"] == 0.2
    # version v's figure is the step that started from v
    assert sorted(out["by_version"]) == [0, 1] and out["by_version"][1]["kl_mean"] == 0.003
    assert out["refused_groups"] == 1 and out["steps_measured"] == 3
    assert consistency.mismatch([step(1, mismatch=None)]) is None


def test_canary_cost_is_its_share_of_the_time_from_the_step_end_to_servable():
    steps = [
        step(1, mismatch=None, trained_at=100.0, canary_s=0.01),
        step(2, mismatch=None, trained_at=200.0, canary_s=0.02),
    ]
    # replicas that checked before marking the version loaded, and said how long it took
    loads = [loaded(1, 100.5, 0.015), loaded(2, 201.0, 0.03)]
    out = consistency.canary_cost(steps, loads)
    assert out["trainer_seconds"] == out["trainer_wait_seconds"] == {"n": 2, "mean": 0.015, "max": 0.02}
    assert out["replica_seconds"] == {"n": 2, "mean": 0.0225, "max": 0.03}
    assert out["replica_checks_beside_serving"] == 0
    assert out["time_to_servable_s"] == {"n": 2, "mean": 0.75, "max": 1.0}
    assert out["fraction_of_time_to_servable"] == {"n": 2, "mean": 0.05, "max": 0.05}
    printed = consistency.lines({"canary": out, "train_infer_mismatch": None})
    assert printed == [
        "canary: trainer 15.0 ms (waited 15.0 ms), replica 22.5 ms, 5.0% of time to servable (mean 750 ms; worst 5.0%)"
    ]
    assert consistency.canary_cost([step(1, mismatch=None, canary_s=None)], [loaded(1, 1.0, None)]) is None
    # a trainer that overlapped its canary with the upload: only what the event waited counts
    overlapped = [msgspec.structs.replace(s, canary_wait_seconds=0.0) for s in steps]
    frac = consistency.canary_cost(overlapped, loads)["fraction_of_time_to_servable"]
    assert frac == {"n": 2, "mean": 0.03, "max": 0.03}


def test_a_replica_that_checks_beside_serving_adds_nothing_to_time_to_servable():
    steps = [
        msgspec.structs.replace(step(1, mismatch=None, trained_at=100.0, canary_s=0.04), canary_wait_seconds=0.01),
        msgspec.structs.replace(step(2, mismatch=None, trained_at=200.0, canary_s=0.04), canary_wait_seconds=0.02),
    ]
    loads = [loaded(1, 100.2, None), loaded(2, 200.4, None)]
    out = consistency.canary_cost(steps, loads)
    assert out["replica_seconds"] is None and out["replica_checks_beside_serving"] == 2
    assert out["time_to_servable_s"] == {"n": 2, "mean": 0.3, "max": 0.4}
    # only what the trainer's announcement waited is in the share
    assert out["fraction_of_time_to_servable"] == {"n": 2, "mean": 0.05, "max": 0.05}
    assert consistency.lines({"canary": out}) == [
        "canary: trainer 40.0 ms (waited 15.0 ms), replica checks beside serving (their wait: "
        "lorabus_rollout_canary_wait_seconds), 5.0% of time to servable (mean 300 ms; worst 5.0%)"
    ]
    # a version the trainer computed no canary for: its loads count nowhere
    assert consistency.canary_cost([step(1, mismatch=None, canary_s=None)], [loaded(1, 100.2, None)]) is None


def test_a_replica_serving_in_lower_precision_than_the_trainer_is_judged_by_its_own_dtype():
    canary = m.Canary(
        dtype="float32", sequences=[m.CanarySequence(prompt_token_ids=[1], token_ids=[2], logprobs=[-1.0])]
    )
    assert tolerance(canary) == TOLERANCE["float32"]
    assert tolerance(canary, "bfloat16") == TOLERANCE["bfloat16"]
    assert tolerance(m.Canary(dtype="bfloat16", sequences=canary.sequences), "float32") == TOLERANCE["bfloat16"]
    assert pytest.approx(TOLERANCE["float32"]) == 2e-3


def test_a_canary_that_follows_its_event_costs_nothing_of_time_to_servable():
    """Issue 28's last target: the trainer announces without waiting (canary_wait_seconds 0) and
    the replica checks beside serving; the canary's compute is still reported on its own."""
    steps = [
        msgspec.structs.replace(step(v, mismatch=None, trained_at=100.0 * v, canary_s=0.2), canary_wait_seconds=0.0)
        for v in (1, 2)
    ]
    loads = [loaded(1, 100.25, None), loaded(2, 200.35, None)]
    out = consistency.canary_cost(steps, loads)
    assert out["trainer_seconds"] == {"n": 2, "mean": 0.2, "max": 0.2}
    assert out["trainer_wait_seconds"] == {"n": 2, "mean": 0.0, "max": 0.0}
    assert out["replica_checks_beside_serving"] == 2
    assert out["fraction_of_time_to_servable"] == {"n": 2, "mean": 0.0, "max": 0.0}
    assert consistency.lines({"canary": out})[0].startswith("canary: trainer 200.0 ms (waited 0.0 ms), replica checks")
