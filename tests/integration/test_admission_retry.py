"""A grant whose reply is lost costs no second slot: against the real registry process and a
real nats-server, a rollout's admission request that times out after the registry granted it is
asked again under its own id (`services.rollout.work.RequestIds`) and gets the same grant back,
so the ledger holds one running grant, not two until the first one's lease passes. A fresh id
after an answer is a new request."""

from __future__ import annotations

from proto import subjects
from proto.messages import AdmissionGrant, AdmissionRequest
from services.rollout.work import RequestIds, request_admission
from tests.integration.test_registry_service import bus, ready, registry, run, wait_status  # noqa: F401


async def test_a_request_whose_reply_was_lost_gets_its_grant_back(bus, registry, run):
    await bus.publish(subjects.adapter_ready(run, 0), ready(run, 0), msg_id="v0")
    await wait_status(bus, registry, lambda s: s.ledger.head == 0)
    ids = RequestIds()

    async def ask(timeout_s: float):
        request = AdmissionRequest(run=run, replica="r1", request_id=ids.next(), loaded_versions=[0])
        return await request_admission(bus, subjects.admission(run), request, ids, timeout_s)

    # gone before the registry can answer: it grants, and the reply finds nobody waiting
    assert await ask(1e-6) is None
    await wait_status(bus, registry, lambda s: s.ledger.running == 1)
    first = await ask(5.0)
    assert isinstance(first, AdmissionGrant), first
    status = await wait_status(bus, registry, lambda s: True)
    assert status.ledger.running == 1, f"the retried request took a second slot: {status.ledger.grants}"
    # answered: the next request is a new one
    second = await ask(5.0)
    assert isinstance(second, AdmissionGrant), second
    assert second.grant_id != first.grant_id
    await wait_status(bus, registry, lambda s: s.ledger.running == 2)
