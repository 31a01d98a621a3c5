"""Sets of integers that are mostly contiguous, kept as sorted disjoint [lo, hi] ranges.

For "has this numbered thing been seen" over a whole run in memory proportional to the gaps, not
to the count: grant numbers the registry's decided trajectories used, and the ACCEPTED stream
sequences the trainer has trained. Both are handed out in order and used about in order, so
only the few never used leave holes.
"""

from __future__ import annotations

import bisect
import math

Ranges = list[tuple[int, int]]


def contains(ranges: Ranges, n: int) -> bool:
    i = bisect.bisect_right(ranges, (n, math.inf)) - 1
    return i >= 0 and ranges[i][0] <= n <= ranges[i][1]


def add(ranges: Ranges, n: int) -> None:
    """Insert `n` in place, merging with the neighbours it touches."""
    if contains(ranges, n):
        return
    i = bisect.bisect_right(ranges, (n, math.inf))
    left = i > 0 and ranges[i - 1][1] == n - 1
    right = i < len(ranges) and ranges[i][0] == n + 1
    if left and right:
        ranges[i - 1 : i + 1] = [(ranges[i - 1][0], ranges[i][1])]
    elif left:
        ranges[i - 1] = (ranges[i - 1][0], n)
    elif right:
        ranges[i] = (n, ranges[i][1])
    else:
        ranges.insert(i, (n, n))
