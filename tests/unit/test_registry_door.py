"""The journal as the registry's one door into its policy: its questions agree with what the
policy would do, and what it leaves out of the journal is only what changes nothing."""

from __future__ import annotations

import copy
import random

from proto.messages import AdmissionGrant, ExportDone
from services.registry import persistence as j
from services.registry import policy as p
from tests.unit.test_registry_policy import RUN, cfg, ready, request, traj


def in_memory(c: p.PolicyConfig) -> j.Journal:
    """A journal whose ops are applied and batched but never written (no bus is touched)."""
    return j.Journal(None, "ledger", p.new_ledger(RUN), c, seq=0, revision=0)  # type: ignore[arg-type]


def test_can_grant_is_what_admit_would_do_for_a_new_request():
    rng = random.Random(7)
    c = cfg(k=1, b=2, max_concurrent=3)
    journal = in_memory(c)
    seen = {True: 0, False: 0}
    for step in range(300):
        roll = rng.random()
        if roll < 0.1 and journal.ledger.head is not None and journal.ledger.head < 6:
            journal.adapter_ready(ready(journal.ledger.head + 1))
        elif roll < 0.15 and journal.ledger.head is None:
            journal.adapter_ready(ready(0))
        elif roll < 0.3 and journal.ledger.grants:
            gid = rng.choice(sorted(journal.ledger.grants))
            grant = journal.ledger.grants[gid]
            journal.decide(traj(gid, [grant.version], tid=f"t{step}"), "r1", 1.0)
        loaded = rng.sample(range(7), rng.randint(0, 3))
        req = request(rid=f"q{step}", loaded=loaded)
        expect = journal.can_grant(req)
        trial = copy.deepcopy(journal.ledger)
        assert isinstance(p.admit(trial, req, 1.0, c), AdmissionGrant) == expect
        seen[expect] += 1
        if rng.random() < 0.5:
            journal.admit(req, 1.0, "tok")
    assert seen[True] and seen[False]  # both answers were exercised


def test_a_remembered_decision_comes_back_without_an_entry():
    journal = in_memory(cfg())
    journal.adapter_ready(ready(0))
    grant = journal.admit(request(), 1.0, "tok")
    assert isinstance(grant, AdmissionGrant)
    t = traj(grant.grant_id, [0])
    first, new = journal.decide(t, "r1", 2.0)
    assert new and first.verdict == "accepted"
    ops = len(journal._batch.ops)
    again, new = journal.decide(t, "r1", 3.0)
    assert not new and again == first
    assert len(journal._batch.ops) == ops  # nothing to replay: nothing journaled


def test_expire_journals_only_when_a_grant_is_due():
    c = p.PolicyConfig(max_head_offpolicyness=1, consumer_batch_size=2, max_concurrent_rollouts=4,
                       lease_seconds=10.0, silent_after_s=5.0)  # fmt: skip
    journal = in_memory(c)
    journal.adapter_ready(ready(0))
    grant = journal.admit(request(), 1.0, "tok")
    assert isinstance(grant, AdmissionGrant)
    ops = len(journal._batch.ops)
    assert not p.expiry_due(journal.ledger, 5.0, c)
    assert journal.expire(5.0) == [] and len(journal._batch.ops) == ops
    assert p.expiry_due(journal.ledger, 6.5, c)  # silent for more than 5 s
    assert journal.expire(6.5) == [grant.grant_id] and len(journal._batch.ops) == ops + 1


def test_an_export_ahead_of_its_version_is_left_to_retry():
    journal = in_memory(cfg())
    journal.adapter_ready(ready(0))
    ahead = ExportDone(run=RUN, lora_name="lora", version=1, uri="file:///e/v1", files=[], bytes=1, sha256="0" * 64,
                       exported_at=1.0)  # fmt: skip
    assert journal.export_done(ahead) is None
    journal.adapter_ready(ready(1))
    assert journal.export_done(ahead) == p.Applied(True)
