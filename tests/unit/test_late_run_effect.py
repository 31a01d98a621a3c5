"""What a run added to a busy fleet cost the others (`benchmarks/multi_run.py`'s
`late_run_effect`, issue 33's second target): each run's version interval after the late run's
first trajectory against before, beside the fair-share bound n / (n - 1)."""

from __future__ import annotations

import pytest

from benchmarks.multi_run import late_run_effect

pytestmark = pytest.mark.unit


def test_a_run_slowed_by_its_share_is_within_it_and_one_slowed_more_is_named():
    before, after = [0.0, 1.0, 2.0, 3.0], [4.2, 5.4, 6.6]  # 1.0 s apart, then 1.2 s
    versions = {
        "fleet": before + after,
        "fleet-2": [0.5, 1.5, 2.5, 3.5, 5.5, 7.5],  # 1.0 s apart, then 2.0 s
        "fleet-3": [0.0, 3.0],  # one interval before, none after: left out
        "late": [4.0, 5.0],
    }
    effect = late_run_effect(versions, "late", joined_at=3.9)
    assert effect["bound"] == round(4 / 3, 3)
    assert effect["ratios"] == {"fleet": 1.2, "fleet-2": 2.0}
    assert effect["left_out"] == ["fleet-3"] and effect["max_ratio"] == 2.0
    assert effect["within_share"] is False
    del versions["fleet-2"]
    assert late_run_effect(versions, "late", joined_at=3.9)["within_share"] is True


def test_only_the_last_k_intervals_before_and_first_k_after_count():
    slow_start = [0.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]  # start-up is not the steady state
    effect = late_run_effect({"a": slow_start + [16.0, 17.0], "late": [15.5]}, "late", joined_at=15.2, k=5)
    assert effect["ratios"] == {"a": 1.0}
