"""Issue 28 end to end on real events: the trainer as its own process (real nats-server, local
store) and an embedded replica in this process.

The trainer computes each version's canary in its step and publishes it as its own message
(AdapterCanary) after the version's AdapterReady, which says it follows and never waits for it,
on either path (object store; XCCL by a gloo broadcast); the replica serves every load at once
and checks it against its canary, as it comes, while its output waits. Its trajectories,
forwarded as the registry would accept them, come back to the trainer, which reports the
train/inference mismatch of each step on TrainerStep (near zero here: both sides compute in
float32). A copy of one trajectory whose behaviour logprobs are 1 nat off (k3 KL e - 2 per
token) is refused beyond actor.max_train_infer_kl: dead-lettered with its reason, counted on
the step, never trained, and the run goes on.
"""

from __future__ import annotations

import asyncio
import copy
import signal
import subprocess
import time
import uuid

import msgspec
import pytest
import yaml

from proto import codec, subjects
from proto.messages import (
    AdapterCanary,
    AdapterFailed,
    AdapterLoaded,
    AdapterReady,
    AdmissionGrant,
    AdmissionRequest,
    DeadLetter,
    RolloutReport,
    TrainerStep,
    Trajectory,
)
from services.common import streams
from services.common.bus import Bus
from services.common.models import load_base_model
from services.config.loader import load_config
from services.config.schema import StoreConfig
from services.rollout import metrics as rollout_metrics
from services.rollout.__main__ import fetcher
from services.rollout.canary import TOLERANCE
from services.rollout.engines.embedded import EmbeddedEngine
from services.rollout.service import RolloutService
from services.trainer import canary as trainer_canary
from tests.fixtures.waiting import wait_until
from tests.integration.test_rollout_service import PROMPTS, Recorder
from tests.integration.test_trainer_service import (  # noqa: F401 - tiny_model_dir is a fixture
    start_trainer,
    tiny_model_dir,
    wait_event,
    write_config,
)

THRESHOLD = 0.05
STEPS = 3


@pytest.mark.parametrize("mode", ["disk", "xccl"])
async def test_canary_and_mismatch_ride_real_events_and_a_bad_group_is_refused(
    mode, tmp_path, nats_url, tiny_model_dir
):
    run = f"pc{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path, run, nats_url, StoreConfig(uri=f"file://{tmp_path / 'store'}"), tiny_model_dir)
    doc = yaml.safe_load(config.read_text())
    doc["total_train_steps"] = STEPS
    doc["gconfig"]["max_new_tokens"] = 4
    doc["actor"].update({"max_train_infer_kl": THRESHOLD, "weight_update_mode": mode, "xccl_backend": "gloo"})
    doc["rollout"].update({"heartbeat_s": 0.2, "batch_groups": 1})
    config.write_text(yaml.safe_dump(doc))
    cfg = load_config(config)
    log = tmp_path / "trainer.log"
    bus = await Bus.connect(cfg.bus, run=run, service="tester")
    await bus.ensure_streams()
    rec = Recorder()
    await bus.subscribe(subjects.rollout_report_all(run), RolloutReport, rec.on_report)
    bad: list[str] = []

    async def admission(req: AdmissionRequest) -> AdmissionGrant:
        return AdmissionGrant(request_id=req.request_id, grant_id=uuid.uuid4().hex, version=max(req.loaded_versions),
                              lease_expires_at=time.time() + 60)  # fmt: skip

    async def accept(traj: Trajectory, meta) -> None:
        """The registry's part: every trajectory accepted; the first one also as a bad copy."""
        if not bad:
            wrong = [msgspec.structs.replace(c, logprobs=[lp - 1.0 for lp in c.logprobs]) for c in traj.completions]
            copy_ = msgspec.structs.replace(traj, trajectory_id=f"bad-{traj.trajectory_id}", completions=wrong)
            bad.append(copy_.trajectory_id)
            await bus.publish(subjects.accepted(run), copy_, msg_id=copy_.trajectory_id)
        await bus.publish(subjects.accepted(run), traj, msg_id=traj.trajectory_id)

    await bus.serve(subjects.admission(run), AdmissionRequest, admission)
    await bus.subscribe(subjects.trajectory_all(run), Trajectory, accept)
    proc = start_trainer(config, log)
    engine = EmbeddedEngine(load_base_model(tiny_model_dir, "float32", "cpu"), eos_ids=[1], pad_id=0,
                            slots=cfg.rollout.keep_versions + 1)  # fmt: skip
    service = RolloutService(cfg, "pc", engine, bus, fetch=fetcher(cfg), encode=lambda t: [2 + ord(c) % 60 for c in t],
                             decode_text=lambda ids: "".join(chr(48 + i % 10) for i in ids),
                             reward_fn=lambda prompt, completion, answer: float(len(completion) % 2),
                             prompts=copy.copy(PROMPTS), load_attempts=2, retry_base_s=0.05)  # fmt: skip
    stop = asyncio.Event()
    task = None
    try:
        v0 = await wait_event(bus, run, 0, proc, log)
        assert v0.canary is None and v0.canary_follows
        task = asyncio.create_task(service.run(stop))
        await wait_event(bus, run, STEPS, proc, log, timeout=240)
        events = [await wait_event(bus, run, v, proc, log) for v in range(STEPS + 1)]
        assert all(isinstance(e, AdapterReady) and e.canary is None and e.canary_follows for e in events)
        # each version's canary followed its event, bound to it (epoch, version, the object's sha256)
        for e in events:
            sent = await bus.wait_last(streams.CANARIES(run), AdapterCanary, subjects.adapter_canary(run, e.version),
                                       timeout=30)  # fmt: skip
            assert sent is not None and sent.created_at >= e.created_at
            obj = e.object_payload()
            assert (sent.trainer_epoch, sent.version) == (e.trainer_epoch, e.version)
            assert sent.adapter_sha256 == (obj.sha256 if obj is not None else None)
            assert sent.canary.dtype == "float32" and len(sent.canary.sequences) == trainer_canary.N_PROMPTS

        # every version the replica loaded passed its canary, checked after it was reported loaded
        await wait_until(lambda: rec.of(AdapterLoaded, "pc", version=STEPS), 60, what=f"v{STEPS} loaded")
        loads = rec.of(AdapterLoaded, "pc")
        assert {ld.version for ld in loads} >= set(range(1, STEPS + 1))
        assert all(ld.canary_seconds is None for ld in loads)
        checked = rollout_metrics.CANARY_SECONDS.labels(run, "pc")
        await wait_until(lambda: sum(b.get() for b in checked._buckets) >= len(loads), 30, what="every canary")
        assert not [f for f in rec.of(AdapterFailed, "pc") if "canary" in f.reason]
        if mode == "xccl":  # the canary follows the broadcast's event too
            assert any(ld.via == "xccl" for ld in loads), [ld.via for ld in loads]
        gaps = rollout_metrics.CANARY_GAP.labels(run, "pc")
        assert gaps._sum.get() <= TOLERANCE["float32"] * len(loads)

        steps = {s.step: s for s in await bus.read_all(streams.TRAINER(run), TrainerStep)}
        assert sorted(steps) == list(range(STEPS))
        for s in steps.values():
            assert s.mismatch is not None and s.trained_at is not None and s.canary_seconds is not None
            # one process: computed beside the upload or broadcast; the event never waited for it
            assert s.canary_wait_seconds == 0.0
            assert s.trained_at <= s.finished_at
            assert s.mismatch.all_tokens.tokens > 0
            on = s.mismatch.on_policy
            if on is not None and s.mismatch.refused_groups == 0:
                # float32 on both sides: the replica's logprobs are the trainer's to rounding
                assert on.kl_mean < 1e-6 and on.abs_max < 1e-3, on
        # the bad copy: refused once, dead-lettered with its reason, never trained
        assert sum(s.mismatch.refused_groups for s in steps.values()) == 1
        refusing = next(s for s in steps.values() if s.mismatch.refused_groups)
        assert refusing.mismatch.all_tokens.kl_max > 0.5

        async def letter() -> DeadLetter | None:
            raw = await bus.last_raw(streams.DEADLETTER(run))
            return None if raw is None else codec.decode(raw.data, DeadLetter)

        dead = await wait_until(letter, 30, lambda: log.read_text()[-3000:])
        assert dead.reason == "validation" and dead.service == "trainer"
        assert f"trajectory {bad[0]}: train_infer_kl: mean per-token KL" in dead.error
        assert f"exceeds actor.max_train_infer_kl {THRESHOLD:g}" in dead.error
        assert "refused 1" in log.read_text()  # the step log line
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 30)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        await bus.close()
