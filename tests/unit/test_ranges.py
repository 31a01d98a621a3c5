"""`common.ranges`: membership is exact, and the ranges stay as few as the gaps."""

from __future__ import annotations

import random

from services.common import ranges


def test_membership_is_exact_and_ranges_merge() -> None:
    rng = random.Random(1)
    numbers = list(range(1000))
    rng.shuffle(numbers)
    held_back = set(numbers[:7])
    r: ranges.Ranges = []
    for n in numbers[7:]:
        ranges.add(r, n)
        ranges.add(r, n)  # twice is once
    assert all(ranges.contains(r, n) == (n not in held_back) for n in range(1000))
    assert not ranges.contains(r, -1) and not ranges.contains(r, 1000)
    assert len(r) <= len(held_back) + 1
    assert r == sorted(r)
    for n in held_back:
        ranges.add(r, n)
    assert r == [(0, 999)]
