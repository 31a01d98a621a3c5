"""Issue 28: the registry admits a trajectory only when each token range names the policy the
ledger published (`services.registry.identity`, through `policy.decide`)."""

from __future__ import annotations

import msgspec
import pytest

from proto.messages import (
    AdapterReady,
    AdmissionGrant,
    AdmissionRequest,
    Completion,
    LoraSpec,
    ObjectPayload,
    TokenRange,
    Trajectory,
)
from services.registry import identity
from services.registry import policy as p

RUN = "run1"
LORA = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"], base_model="tiny")
CFG = p.PolicyConfig(
    max_head_offpolicyness=2, consumer_batch_size=2, max_concurrent_rollouts=8, lease_seconds=10.0, seen_limit=64
)


def sha(version: int) -> str:
    return f"{version:x}" * 64 if version else "a" * 64


def ready(version: int, digest: str | None) -> AdapterReady:
    return AdapterReady(
        run=RUN,
        trainer_epoch="e0",
        lora_name="lora",
        version=version,
        trainer_step=version,
        created_at=1000.0 + version,
        lora=LORA,
        payloads=[ObjectPayload(uri=f"file:///s/v{version}", bytes=1, sha256=digest)],
    )


def ledger_of(*digests: str | None) -> p.Ledger:
    ledger = p.new_ledger(RUN)
    for v, digest in enumerate(digests):
        assert p.on_adapter_ready(ledger, ready(v, digest), CFG) == p.Applied(True)
    return ledger


def grant(ledger: p.Ledger, version: int) -> str:
    g = p.admit(ledger, AdmissionRequest(run=RUN, replica="r1", request_id=f"q{version}{len(ledger.grants)}",
                                         loaded_versions=[version]), 0.0, CFG)  # fmt: skip
    assert isinstance(g, AdmissionGrant) and g.version == version
    return g.grant_id


def completion(version: int, digest: str | None, n: int = 3, ranges: bool = True) -> Completion:
    spans = [TokenRange(start=0, end=n, version=version, adapter_sha256=digest, engine="vllm", engine_id="u")]
    return Completion(token_ids=[5] * n, logprobs=[-0.5] * n, versions=[version] * n, reward=1.0,
                      ranges=spans if ranges else [])  # fmt: skip


def traj(grant_id: str, *completions: Completion, tid: str = "t1") -> Trajectory:
    return Trajectory(run=RUN, trajectory_id=tid, grant_id=grant_id, replica="r1", prompt_id="p",
                      prompt_token_ids=[1], completions=list(completions), started_at=1.0, finished_at=2.0)  # fmt: skip


def test_ranges_naming_the_published_bytes_are_accepted():
    ledger = ledger_of(sha(0), sha(1))
    assert ledger.versions[1].adapter_sha256 == sha(1)
    d = p.decide(ledger, traj(grant(ledger, 1), completion(1, sha(1)), completion(1, sha(1))), 1.0, CFG)
    assert d.verdict == "accepted", d.reason


@pytest.mark.parametrize(
    "served, why",
    [
        (sha(0), "a stale copy (v0's bytes) served under v1's name"),
        ("f" * 64, "a corrupted or swapped object"),
        (None, "a replica that cannot say what it served"),
    ],
)
def test_ranges_naming_other_bytes_are_rejected_and_counted(served, why):
    ledger = ledger_of(sha(0), sha(1))
    g = grant(ledger, 1)
    d = p.decide(ledger, traj(g, completion(1, served)), 1.0, CFG)
    assert d.verdict == "rejected-invalid", why
    assert p.code_of(d.reason) == identity.REJECT_IDENTITY and sha(1) in d.reason
    assert ledger.rejected == {"identity": 1} and ledger.accepted == 0
    assert g not in ledger.grants, "the grant is used up: the group is never trained"
    # a redelivery gets the same answer, counted once
    assert p.decide(ledger, traj(g, completion(1, served)), 1.5, CFG).verdict == "rejected-invalid"
    assert ledger.rejected == {"identity": 1}


def test_one_bad_range_among_good_ones_rejects_the_group():
    ledger = ledger_of(sha(0), sha(1))
    d = p.decide(ledger, traj(grant(ledger, 1), completion(1, sha(1)), completion(1, sha(0))), 1.0, CFG)
    assert d.verdict == "rejected-invalid" and d.reason.startswith("identity: tokens of v1")


def test_an_xccl_version_without_an_announced_digest_is_not_compared():
    ledger = ledger_of(sha(0), None)
    d = p.decide(ledger, traj(grant(ledger, 1), completion(1, None)), 1.0, CFG)
    assert d.verdict == "accepted", d.reason


def test_a_sender_that_names_no_ranges_is_judged_by_the_other_rules():
    ledger = ledger_of(sha(0))
    d = p.decide(ledger, traj(grant(ledger, 0), completion(0, None, ranges=False)), 1.0, CFG)
    assert d.verdict == "accepted", d.reason


def test_a_version_missing_from_the_ledger_is_refused():
    assert identity.problem(((3, sha(3)),), {}) == "identity: tokens name v3, which this run's ledger does not hold"


def test_claims_are_journaled_and_replayed_alike():
    """The journal stores DecisionInput (array-like JSON): the claims survive a round trip, and
    an entry journaled before them decodes with none."""
    ledger = ledger_of(sha(0), sha(1))
    t = traj(grant(ledger, 1), completion(1, sha(0)), completion(1, sha(1)))
    di = p.decision_input(t, "r1")
    assert di.claims == tuple(sorted([(1, sha(0)), (1, sha(1))]))
    again = msgspec.json.decode(msgspec.json.encode(di), type=p.DecisionInput)
    assert again == di
    old = msgspec.json.encode(msgspec.structs.astuple(di)[:-1])
    assert msgspec.json.decode(old, type=p.DecisionInput).claims is None
    facts = p.adapter_facts(ready(2, sha(2)))
    assert msgspec.json.decode(msgspec.json.encode(facts), type=p.AdapterFacts).adapter_sha256 == sha(2)


def test_ranges_must_cover_every_token_of_every_completion():
    with pytest.raises(ValueError, match="cover 3 of 4 tokens"):
        Completion(token_ids=[5] * 4, logprobs=[-0.5] * 4, versions=[1] * 4, reward=0.0,
                   ranges=completion(1, sha(1)).ranges)  # fmt: skip
    with pytest.raises(ValueError, match="version 2 is not the version of each of its tokens"):
        bad = TokenRange(start=0, end=3, version=2, adapter_sha256=None, engine="vllm", engine_id="u")
        Completion(token_ids=[5] * 3, logprobs=[-0.5] * 3, versions=[1] * 3, reward=0.0, ranges=[bad])
    with pytest.raises(ValueError, match="1 of 2 completions name no token ranges"):
        traj("g", completion(1, sha(1)), completion(1, sha(1), ranges=False))
