"""The run summary's delivery figures (`services.local.delivery`): step seconds, and each load
path's time from the step end to servable on a replica."""

from __future__ import annotations

from proto import messages as m
from services.local import delivery


def step(version: int, seconds: float, trained_at: float | None) -> m.TrainerStep:
    return m.TrainerStep(run="r", step=version - 1, version=version, loss=0.0, reward_mean=0.0, groups=2, tokens=10,
                         step_seconds=seconds, finished_at=trained_at or 1.0, trained_at=trained_at)  # fmt: skip


def loaded(version: int, at: float, via: m.LoadedVia, load_s: float = 0.05) -> m.AdapterLoaded:
    return m.AdapterLoaded(run="r", replica="a", version=version, via=via, load_seconds=load_s, loaded_at=at)


def test_time_to_servable_is_per_path_from_the_step_end():
    steps = [step(1, 1.0, 100.0), step(2, 3.0, 200.0), step(3, 2.0, None)]
    loads = [
        loaded(1, 100.5, "object"),
        loaded(2, 200.25, "xccl", load_s=0.02),
        loaded(2, 200.75, "xccl", load_s=0.04),
        loaded(3, 300.0, "object"),  # its step predates trained_at: absent, not 0
        loaded(9, 900.0, "object"),  # no step announced it (another trainer epoch)
    ]
    out = delivery.delivery(steps, loads)
    assert out["step_seconds"] == {"n": 3, "median": 2.0, "mean": 2.0, "max": 3.0}
    assert out["time_to_servable_s"] == {
        "object": {"n": 1, "median": 0.5, "mean": 0.5, "max": 0.5},
        "xccl": {"n": 2, "median": 0.5, "mean": 0.5, "max": 0.75},
    }
    assert out["replica_load_s"]["xccl"] == {"n": 2, "median": 0.03, "mean": 0.03, "max": 0.04}
    assert delivery.lines({"delivery": out}) == [
        "time to servable (step end -> loaded on a replica): object median 0.500 s (max 0.500), "
        "xccl median 0.500 s (max 0.750)"
    ]


def test_a_run_without_steps_has_no_figures():
    assert delivery.delivery([], [loaded(1, 1.0, "object")]) is None
    assert delivery.lines({"delivery": None}) == []


def test_a_step_near_the_float_maximum_gives_inf_not_an_error():
    steps = [step(1, 1.7e308, 100.0), step(2, 1.7e308, 200.0)]
    assert delivery.delivery(steps, [])["step_seconds"]["mean"] == float("inf")
