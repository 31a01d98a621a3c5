"""The fleet's weighted fair share (services/common/share.py): each pick, and what many picks
add up to in a simulated fleet whose grants finish at random."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from services.common.share import RunLoad, in_flight, pick, targets


def load(run, share=1.0, running=0, ready=True, last=-1) -> RunLoad:
    return RunLoad(run=run, share=share, running=running, ready=ready, last_grant=last)


def test_least_running_per_share_wins():
    assert pick([load("a", 1, 2), load("b", 2, 3)]) == "b"  # 1.5 per share < 2
    assert pick([load("a", 1, 1), load("b", 2, 3)]) == "a"  # 1 < 1.5


def test_a_run_with_nothing_to_do_gives_its_share_away():
    loads = [load("busy", 1, running=10), load("idle", 100, running=0, ready=False)]
    assert pick(loads) == "busy"
    assert pick([load("x", ready=False)]) is None
    assert targets(loads, 12) == {"busy": 12.0}


def test_fleet_limit_counts_every_run():
    loads = [load("a", running=3), load("b", running=1, ready=False)]
    assert in_flight(loads) == 4
    assert pick(loads, limit=4) is None
    assert pick(loads, limit=5) == "a"
    assert pick(loads, limit=None) == "a"


def test_ties_rotate_by_last_grant_then_name():
    assert pick([load("a", last=5), load("b", last=3)]) == "b"
    assert pick([load("b"), load("a")]) == "a"


@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.01, max_value=100),
            st.integers(min_value=0, max_value=50),
            st.booleans(),
            st.integers(min_value=-1, max_value=1000),
        ),
        min_size=1,
        max_size=8,
    ),
    st.none() | st.integers(min_value=0, max_value=200),
)
def test_pick_is_a_ready_run_with_the_least_running_per_share(rows, limit):
    loads = [load(f"r{i}", s, n, ok, last) for i, (s, n, ok, last) in enumerate(rows)]
    chosen = pick(loads, limit=limit)
    ready = [x for x in loads if x.ready]
    if not ready or (limit is not None and in_flight(loads) >= limit):
        assert chosen is None
        return
    best = next(x for x in loads if x.run == chosen)
    assert best.ready
    assert all(best.running / best.share <= x.running / x.share for x in ready)


def simulate(shares: dict[str, float], ticks: int, *, slots: int, ready=lambda run, t: True, seed=0):
    """A fleet of `slots` concurrent groups; every free slot asks each tick, each grant
    finishes with probability 0.3 per tick. Returns per-tick running counts and grants."""
    rng = random.Random(seed)
    running = dict.fromkeys(shares, 0)
    last = dict.fromkeys(shares, -1)
    history, grants, counter = [], dict.fromkeys(shares, 0), 0
    for t in range(ticks):
        for run in shares:
            running[run] -= sum(rng.random() < 0.3 for _ in range(running[run]))
        while True:
            loads = [load(r, s, running[r], ready(r, t), last[r]) for r, s in shares.items()]
            chosen = pick(loads, limit=slots)
            if chosen is None:
                break
            running[chosen] += 1
            grants[chosen] += 1
            last[chosen] = counter
            counter += 1
        history.append(dict(running))
    return history, grants


def test_busy_runs_hold_concurrency_in_proportion_to_their_shares():
    shares = {"a": 1.0, "b": 2.0, "c": 1.0}
    history, grants = simulate(shares, 2000, slots=16)
    mean = {r: sum(h[r] for h in history[100:]) / len(history[100:]) for r in shares}
    total = sum(mean.values())
    for r, s in shares.items():
        assert abs(mean[r] / total - s / 4.0) < 0.03, mean
    assert abs(grants["b"] / (grants["a"] + grants["c"]) - 1.0) < 0.1, grants


def test_a_run_that_becomes_busy_gets_its_share_back_without_preemption():
    shares = {"a": 1.0, "b": 1.0}
    history, _ = simulate(shares, 400, slots=10, ready=lambda run, t: run == "a" or t >= 200)
    assert all(h["b"] == 0 for h in history[:200]) and all(h["a"] == 10 for h in history[50:200])
    # freed slots go to b first: it holds half within a few grant lifetimes
    assert all(h["b"] == 5 for h in history[220:])


def test_a_small_share_is_not_starved():
    history, grants = simulate({"big": 100.0, "small": 1.0}, 300, slots=8)
    assert grants["small"] > 0
    assert max(h["small"] for h in history) >= 1
