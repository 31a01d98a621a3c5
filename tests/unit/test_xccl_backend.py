"""Which backend an XCCL group gets (`xccl.group_backend`) and the join record that tells it.

NCCL takes one rank per GPU, so a group with two ranks on one device fails at its first
collective; on the one-GPU H200 every version then fell back to the object copy. The rule:
nccl only where every rank stages on a GPU of its own, gloo otherwise, with the reason.
"""

from __future__ import annotations

import pytest

from services.common import xccl

A, B = "GPU-aaaa", "GPU-bbbb"


def test_gloo_asked_is_gloo_whatever_the_gpus():
    assert xccl.group_backend("gloo", A, {"r0": B}) == ("gloo", "")


def test_nccl_when_every_rank_has_a_gpu_of_its_own():
    assert xccl.group_backend("nccl", A, {"r0": B, "r1": "GPU-cccc"}) == ("nccl", "")
    assert xccl.group_backend("nccl", A, {}) == ("nccl", "")


@pytest.mark.parametrize(
    ("trainer", "members", "why"),
    [
        (A, {"rollout-0": A}, "replica rollout-0 shares GPU-aaaa with the trainer"),  # one GPU for all
        (A, {"r0": B, "r1": B}, "replica r1 shares GPU-bbbb with replica r0"),
        (A, {"r0": None}, "replica r0 stages on no GPU"),  # a CPU member, or a join that predates the record
        (None, {"r0": B}, "the trainer's buckets are on no GPU"),
    ],
)
def test_gloo_when_nccl_could_not_form_the_group(trainer, members, why):
    backend, reason = xccl.group_backend("nccl", trainer, members)
    assert backend == "gloo" and why in reason


def test_join_record_round_trips_and_a_bare_name_has_no_gpu():
    assert xccl.parse_join(xccl.join_record("rollout-0", A).encode()) == ("rollout-0", A)
    assert xccl.parse_join(xccl.join_record("r1", None)) == ("r1", None)
    assert xccl.parse_join(b"r2") == ("r2", None)


def test_gpu_id_is_none_off_the_gpu():
    assert xccl.gpu_id("cpu") is None
