"""`deploy/nats/nats.conf` against a real nats-server: each service's credential can do its
job through the real `Bus` and nothing more.

One server and one registry process (logged in as `registry`) per module; every test uses
its own run id so that streams and durables never collide.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import msgspec
import nats
import nats.errors
import pytest

from proto import codec, subjects
from proto import messages as m
from services.common import streams
from services.common.bus import Bus
from services.common.run_table import RunTable
from services.config.schema import BusConfig
from tests.deploy.natsauth import (
    REPO,
    password_vars,
    start_cluster_with_deploy_config,
    start_with_deploy_config,
    users,
)
from tests.fixtures.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

ROLLOUT = "vllm-0"  # the replica id of the `rollout-vllm-0` user


@pytest.fixture(scope="module")
def passwords() -> dict[str, str]:
    return {var: f"pw-{uuid.uuid4().hex[:12]}" for var in password_vars()}


@pytest.fixture(scope="module")
def server(tmp_path_factory, passwords):
    with pytest.MonkeyPatch.context() as mp:
        for var, value in passwords.items():
            mp.setenv(var, value)
        srv = start_with_deploy_config(tmp_path_factory.mktemp("nats-auth"), passwords)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def run() -> str:
    return f"auth{uuid.uuid4().hex[:8]}"


def bus_config(server, passwords, user: str) -> BusConfig:
    return BusConfig(url=server.url, user=user, password=passwords[users()[user]], connect_timeout_s=3.0)


@pytest.fixture(scope="module")
def registry(tmp_path_factory, server, passwords, run):
    """The real registry process with the `registry` credential (it creates the streams)."""
    tmp = tmp_path_factory.mktemp("registry")
    config = tmp / "registry.yaml"
    config.write_text(
        f"""
experiment_name: {run}
trial_name: t
run: {run}
bus: {{url: "{server.url}", user: registry, password_env: NATS_REGISTRY_PASSWORD}}
metrics: {{host: 127.0.0.1, port: 0}}
actor: {{path: examples/tiny/model}}
train_dataset: {{path: "builtin:arith"}}
rollout: {{max_head_offpolicyness: 1, consumer_batch_size: 2}}
"""
    )
    log = open(tmp / "registry.log", "wb")
    env = dict(os.environ, NATS_REGISTRY_PASSWORD=passwords["NATS_REGISTRY_PASSWORD"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.registry", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield proc, tmp / "registry.log"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


async def connect(server, passwords, user: str, run: str, service: str) -> Bus:
    return await Bus.connect(bus_config(server, passwords, user), run=run, service=service)


async def raw_connect(server, passwords, user: str):
    """A plain nats-py connection that records the server's async errors (permission
    violations arrive there, not as exceptions of the publish call)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        servers=[server.url],
        user=user,
        password=passwords[users()[user]],
        error_cb=on_error,
        allow_reconnect=False,
    )
    return nc, errors


async def streams_ready(server, passwords, run, registry) -> None:
    """Wait until the registry process has created the run's streams."""
    proc, log = registry
    bus = await connect(server, passwords, "trainer", run, "trainer")

    async def created() -> bool:
        assert proc.poll() is None, f"registry exited:\n{log.read_text()[-3000:]}"
        try:
            await bus.js.stream_info(streams.DEADLETTER(run))
            return True
        except Exception:
            return False

    try:
        await wait_until(created, 30, lambda: f"streams:\n{log.read_text()[-3000:]}", interval=0.2)
    finally:
        await bus.close()


def adapter_event(run: str, version: int) -> m.AdapterReady:
    return m.AdapterReady(
        run=run,
        trainer_epoch="e0",
        lora_name="tiny_lora",
        version=version,
        trainer_step=max(version - 1, 0),
        created_at=time.time(),
        lora=m.LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj"], base_model="tiny"),
        payloads=[
            m.ObjectPayload(
                uri=f"s3://lorabus/{run}/adapters/v{version}/adapter_model.safetensors", bytes=10, sha256="0" * 64
            )
        ],
    )


def trajectory(run: str, replica: str, version: int) -> m.Trajectory:
    now = time.time()
    return m.Trajectory(
        run=run,
        trajectory_id=f"t-{uuid.uuid4().hex[:8]}",
        grant_id="g",
        replica=replica,
        prompt_id="p0",
        prompt_token_ids=[1, 2],
        completions=[m.Completion(token_ids=[3], logprobs=[-0.5], versions=[version], reward=1.0)],
        started_at=now,
        finished_at=now,
    )


async def stream_count(bus: Bus, stream: str) -> int:
    return (await bus.js.stream_info(stream)).state.messages


async def subject_count(bus: Bus, stream: str, subject: str) -> int:
    """Messages stored under one subject (STREAM.INFO with a filter: every service may ask)."""
    info = await bus.js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


def test_config_declares_every_service_user():
    assert set(users()) >= {
        "registry",
        "trainer",
        "exporter",
        "rollout-vllm-0",
        "rollout-sglang-0",
        "evaluator",
        "watcher",
    }
    # every password is an environment variable, never a literal in the file
    assert len(password_vars()) == len(users())


async def test_trainer_publishes_adapter_event_to_jetstream(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    trainer = await connect(server, passwords, "trainer", run, "trainer")
    try:
        seq = await trainer.publish(subjects.adapter_ready(run, 0), adapter_event(run, 0), msg_id=f"{run}-v0")
        assert seq >= 1
        step = m.TrainerStep(
            run=run,
            step=0,
            version=1,
            loss=0.1,
            reward_mean=0.5,
            groups=2,
            tokens=10,
            step_seconds=0.2,
            finished_at=time.time(),
        )
        assert await trainer.publish(subjects.trainer_step(run), step) >= 1
        assert await subject_count(trainer, streams.ADAPTERS(run), subjects.adapter_ready(run, 0)) == 1
    finally:
        await trainer.close()


async def test_trainer_exporter_and_evaluator_follow_the_run_table(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    for user in ("trainer", "exporter", "evaluator"):
        bus = await connect(server, passwords, user, run, user)
        try:
            records: list[m.RunRecord] = []

            async def on_record(record: m.RunRecord, into: list = records) -> None:
                into.append(record)

            await RunTable(bus, run).watch(on_record)
            await wait_until(lambda: [r.run for r in records] == [run], what=f"the {user} to read the run table")
        finally:
            await bus.close()


async def test_rollout_is_refused_publishing_an_adapter_event(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    nc, errors = await raw_connect(server, passwords, "rollout-vllm-0")
    try:
        subject = subjects.adapter_ready(run, 99)
        with pytest.raises(nats.errors.TimeoutError):  # dropped by the server: no PubAck
            await nc.jetstream().publish(subject, codec.encode(adapter_event(run, 99)), timeout=1.0)
        await wait_until(lambda: errors, what="a permissions violation")
        assert any("permissions violation for publish" in e.lower() and subject.lower() in e.lower() for e in errors), (
            errors
        )
    finally:
        await nc.close()
    admin = await connect(server, passwords, "trainer", run, "check")
    try:
        assert await subject_count(admin, streams.ADAPTERS(run), subjects.adapter_ready(run, 99)) == 0
    finally:
        await admin.close()


async def test_rollout_publishes_its_trajectory_and_reports_and_requests_admission(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    bus = await connect(server, passwords, "rollout-vllm-0", run, f"rollout-{ROLLOUT}")
    try:
        assert await bus.publish(subjects.trajectory(run, ROLLOUT), trajectory(run, ROLLOUT, 0)) >= 1
        beat = m.ReplicaHeartbeat(
            run=run, replica=ROLLOUT, engine="vllm", loaded_versions=[0], in_flight=0, sent_at=time.time()
        )
        assert await bus.publish(subjects.rollout_report(run, ROLLOUT, "heartbeat"), beat) >= 1
        # the real registry answers (grant or deny): request and reply both pass the permissions
        reply = await bus.request(
            subjects.admission(run),
            m.AdmissionRequest(run=run, replica=ROLLOUT, request_id="r1", loaded_versions=[0]),
            m.AdmissionReply,
            timeout=10.0,
        )
        assert reply.request_id == "r1"
        # a fleet replica asks the fleet and follows its run table (written by the registry)
        fleet_reply = await bus.request(
            subjects.fleet_admission(run),
            m.FleetAdmissionRequest(fleet=run, replica=ROLLOUT, request_id="f1", loaded={run: [0]}),
            m.AdmissionReply,
            timeout=10.0,
        )
        assert fleet_reply.request_id == "f1"
        records: list[m.RunRecord] = []

        async def on_record(record: m.RunRecord) -> None:
            records.append(record)

        await RunTable(bus, run).watch(on_record)
        await wait_until(lambda: [r.run for r in records] == [run], what="the rollout to read the run table")
        # the durable adapter consumer a rollout runs: create, fetch, ack
        seen: list[int] = []

        async def on_adapter(msg: m.AdapterReady, _meta) -> None:
            seen.append(msg.version)

        trainer = await connect(server, passwords, "trainer", run, "trainer")
        await trainer.publish(subjects.adapter_ready(run, 1), adapter_event(run, 1), msg_id=f"{run}-v1")
        await trainer.close()
        await bus.consume(streams.ADAPTERS(run), f"rollout-{ROLLOUT}", m.AdapterReady, on_adapter)
        await wait_until(lambda: 1 in seen, what="the rollout to consume adapter v1")
    finally:
        await bus.close()


async def test_rollout_is_refused_another_replicas_subjects(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    nc, errors = await raw_connect(server, passwords, "rollout-vllm-0")
    try:
        others = [
            subjects.trajectory(run, "sglang-0"),
            subjects.rollout_report(run, "sglang-0", "loaded"),
            subjects.accepted(run),
            subjects.decision(run, ROLLOUT),
        ]
        for subject in others:
            await nc.publish(subject, b"{}")
        await nc.flush()
        await wait_until(lambda: len(errors) >= len(others), what="one violation per subject")
        for subject in others:
            assert any(subject.lower() in e.lower() for e in errors), (subject, errors)
        # and it may not change the run's streams
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(f"$JS.API.STREAM.DELETE.{streams.ADAPTERS(run)}", b"", timeout=1.0)
    finally:
        await nc.close()


async def test_watcher_is_refused_publishing_anything_but_receives_events(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    nc, errors = await raw_connect(server, passwords, "watcher")
    try:
        received: list[str] = []

        async def on_msg(msg) -> None:
            received.append(msg.subject)

        await nc.subscribe(subjects.adapter_ready_all(run), cb=on_msg)
        await nc.flush()
        attempts = [
            subjects.eval_result(run, "mine"),
            subjects.adapter_ready(run, 5),
            subjects.trajectory(run, ROLLOUT),
            subjects.admission(run),
            "$JS.API.INFO",
            "_INBOX.anything",
            "other.subject",
        ]
        for subject in attempts:
            await nc.publish(subject, b"{}")
        await nc.flush()
        await wait_until(lambda: len(errors) >= len(attempts), what="one violation per publish")
        for subject in attempts:
            assert any("publish" in e.lower() and subject.lower() in e.lower() for e in errors), (subject, errors)
        # subscribing to what it may not read is refused too
        await nc.subscribe(subjects.trajectory_all(run), cb=on_msg)
        await wait_until(lambda: any("subscription" in e.lower() for e in errors), what="a subscription violation")

        trainer = await connect(server, passwords, "trainer", run, "trainer")
        await trainer.publish(subjects.adapter_ready(run, 2), adapter_event(run, 2), msg_id=f"{run}-v2")
        await trainer.close()
        await wait_until(lambda: subjects.adapter_ready(run, 2) in received, what="the live event")
    finally:
        await nc.close()


async def test_evaluator_reads_exports_and_publishes_only_eval_results(server, passwords, run, registry):
    await streams_ready(server, passwords, run, registry)
    exporter = await connect(server, passwords, "exporter", run, "exporter")
    done = m.ExportDone(
        run=run,
        lora_name="tiny_lora",
        version=0,
        uri=f"s3://lorabus/{run}/export/v0",
        files=["adapter_config.json", "adapter_model.safetensors"],
        bytes=10,
        sha256="0" * 64,
        exported_at=time.time(),
    )
    try:
        await exporter.publish(subjects.export_done(run, 0), done, msg_id=f"{run}-export-v0")
    finally:
        await exporter.close()

    evaluator = await connect(server, passwords, "evaluator", run, "heldout")
    try:
        scored: list[int] = []

        async def on_export(msg: m.ExportDone, _meta) -> None:
            result = m.EvalResult(
                run=run,
                evaluator="heldout",
                version=msg.version,
                metric="acc",
                score=0.5,
                n=4,
                evaluated_at=time.time(),
            )
            await evaluator.publish(subjects.eval_result(run, "heldout"), result)
            scored.append(msg.version)

        await evaluator.consume(streams.EXPORTS(run), "eval-heldout", m.ExportDone, on_export)
        await wait_until(lambda: scored == [0], what="the evaluator to score v0")
        assert await stream_count(evaluator, streams.EVALS(run)) == 1
    finally:
        await evaluator.close()

    nc, errors = await raw_connect(server, passwords, "evaluator")
    try:
        for subject in (subjects.adapter_ready(run, 7), subjects.export_done(run, 7), subjects.trainer_step(run)):
            await nc.publish(subject, b"{}")
        await nc.flush()
        await wait_until(lambda: len(errors) >= 3, what="three violations")
    finally:
        await nc.close()


async def violations(nc, errors: list[str], attempts: list[tuple[str, bytes]], *, request: bool) -> None:
    """Send each (subject, payload) and wait for one permission violation per subject."""
    for subject, payload in attempts:
        if request:
            with pytest.raises(nats.errors.TimeoutError):  # dropped by the server: no answer
                await nc.request(subject, payload, timeout=1.0)
        else:
            await nc.publish(subject, payload)
    await nc.flush()
    for subject, _ in attempts:
        await wait_until(
            lambda subject=subject: any("permissions violation" in e.lower() and subject.lower() in e.lower()
                                        for e in errors),
            what=f"a violation for {subject}",
        )  # fmt: skip


async def test_rollout_cannot_change_or_create_streams(server, passwords, run, registry):
    """Issue 17, abuses 1 and 2: a rollout credential updated the ADAPTERS stream to capture a
    subject it may publish on (and injected an adapter event there), and shrank ACCEPTED to one
    message. Only the operator may update a stream; creating one (a stream capturing the
    admission subject or `_INBOX.>` would answer everyone's requests) is the registry's alone."""
    await streams_ready(server, passwords, run, registry)
    admin = await connect(server, passwords, "operator", run, "check")
    adapters = (await admin.js.stream_info(streams.ADAPTERS(run))).config
    accepted = (await admin.js.stream_info(streams.ACCEPTED(run))).config
    capture = adapters.evolve(subjects=[*adapters.subjects, subjects.rollout_report(run, ROLLOUT, "loaded")])
    shrink = accepted.evolve(max_msgs=1)
    evil = streams.stream_configs(run)[0].evolve(name=f"EVIL_{run}", subjects=[subjects.admission(run)])
    nc, errors = await raw_connect(server, passwords, "rollout-vllm-0")
    try:
        attempts = [
            (f"$JS.API.STREAM.UPDATE.{adapters.name}", json_of(capture)),
            (f"$JS.API.STREAM.UPDATE.{accepted.name}", json_of(shrink)),
            (f"$JS.API.STREAM.CREATE.EVIL_{run}", json_of(evil)),
            (f"$JS.API.STREAM.PURGE.{accepted.name}", b""),
            (f"$JS.API.STREAM.DELETE.{adapters.name}", b""),
        ]
        await violations(nc, errors, attempts, request=True)
    finally:
        await nc.close()
    try:
        assert (await admin.js.stream_info(streams.ADAPTERS(run))).config.subjects == adapters.subjects
        assert (await admin.js.stream_info(streams.ACCEPTED(run))).config.max_msgs == accepted.max_msgs
        with pytest.raises(nats.js.errors.NotFoundError):
            await admin.js.stream_info(f"EVIL_{run}")
        # the operator is who changes a stream (`lorabus streams`): same change, it holds
        await admin.js.update_stream(accepted.evolve(max_msgs=accepted.max_msgs))
    finally:
        await admin.close()


def json_of(config) -> bytes:
    import json

    return json.dumps(config.as_dict()).encode()


async def test_rollout_cannot_take_over_the_trainers_durable(server, passwords, run, registry):
    """Issue 17, abuse 3: a rollout credential bound to the trainer's durable on ACCEPTED and
    acked its trajectories (silent loss of training data). Consumers are per role: creating,
    pulling and acking are allowed on one's own durables only, and replies go to an inbox only
    their user may read."""
    await streams_ready(server, passwords, run, registry)
    trainer = await connect(server, passwords, "trainer", run, "trainer")
    reg = await connect(server, passwords, "registry", run, "registry")
    try:
        reader = await trainer.pull(streams.consumer(run, "trainer"), m.Trajectory, batch=4)
        await reg.publish(subjects.accepted(run), trajectory(run, ROLLOUT, 0), msg_id=f"{run}-acc-1")
        nc, errors = await raw_connect(server, passwords, "rollout-vllm-0")
        stream = streams.ACCEPTED(run)
        try:
            body = msgspec.json.encode(
                {"stream_name": stream, "config": {"durable_name": "trainer", "ack_policy": "explicit"}}
            )
            attempts = [
                (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.trainer", body),
                (f"$JS.API.CONSUMER.CREATE.{stream}.trainer", body),
                (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.trainer", b'{"batch": 1, "no_wait": true}'),
                (f"$JS.API.CONSUMER.DELETE.{stream}.trainer", b""),
            ]
            await violations(nc, errors, attempts, request=True)
            await violations(nc, errors, [(f"$JS.ACK.{stream}.trainer.1.1.1.1700000000000000000.0", b"+ACK")],
                             request=False)  # fmt: skip
            # nor may it read anyone's replies: the trainer's pulls, the registry's answers
            for inbox in ("_INBOX_trainer.>", "_INBOX_registry.>", "_INBOX.>"):
                await nc.subscribe(inbox)
            await nc.flush()
            await wait_until(lambda: sum("subscription" in e.lower() for e in errors) >= 3, what="3 violations")
        finally:
            await nc.close()
        [delivery] = await reader.burst(timeout=10.0)  # still the trainer's, never acked by another
        assert delivery.meta.num_delivered == 1
        await delivery.ack()
    finally:
        await trainer.close()
        await reg.close()


def user_config(tmp_path, server, run: str, user: str, password: str):
    """A lorabus config file for `run` that connects as `user` (what an operator's tool loads)."""
    config = tmp_path / f"{user}.yaml"
    config.write_text(f"""
experiment_name: {run}
trial_name: t
run: {run}
bus: {{url: "{server.url}", user: {user}, password: "{password}"}}
actor: {{path: examples/tiny/model}}
train_dataset: {{path: "builtin:arith"}}
""")
    return config


async def test_a_heartbeat_naming_another_replica_is_refused_by_the_registry(
    server, passwords, run, registry, tmp_path
):
    """Issue 17, abuse 4: NATS sees subjects, not payloads, so a rollout may publish on its own
    heartbeat subject a heartbeat naming another replica: the registry compares the two and
    dead-letters it ("sender"); the other replica's state is untouched."""
    from services.config.loader import load_config
    from services.registry.status import fetch_status

    await streams_ready(server, passwords, run, registry)
    bus = await connect(server, passwords, "rollout-vllm-0", run, f"rollout-{ROLLOUT}")
    try:
        lie = m.ReplicaHeartbeat(run=run, replica="sglang-0", engine="sglang", loaded_versions=[0], in_flight=0,
                                 sent_at=time.time())  # fmt: skip
        await bus.publish(subjects.rollout_report(run, ROLLOUT, "heartbeat"), lie, msg_id=f"{run}-lie")
    finally:
        await bus.close()
    admin = await connect(server, passwords, "operator", run, "check")
    try:

        async def refused() -> bool:
            raw = await admin.last_raw(streams.DEADLETTER(run), subjects.dead_letter(run, "registry"))
            return raw is not None and b"sender" in raw.data

        await wait_until(refused, 30, what="the registry's dead letter")
    finally:
        await admin.close()
    config = user_config(tmp_path, server, run, "operator", passwords["NATS_OPERATOR_PASSWORD"])
    status = await fetch_status(load_config(config), timeout=10.0)
    assert "sglang-0" not in status.ledger.replicas


@pytest.mark.parametrize("compose_file", ["docker-compose.yml", "docker-compose.cpu.yml"])
async def test_the_registry_health_check_is_allowed_to_ask(server, passwords, run, registry, tmp_path, compose_file):
    """The compose files call the registry healthy when `lorabus registry status` answers as
    the user their healthcheck names; under nats.conf that user must be allowed to ask (it was
    not, and the registry container never turned healthy)."""
    import yaml

    from services.config.loader import load_config
    from services.registry.status import fetch_status

    check = yaml.safe_load((REPO / "deploy" / compose_file).read_text())["services"]["registry"]["healthcheck"]["test"]
    assert check[1:4] == ["lorabus", "registry", "status"], check
    user = next(a.split("=", 1)[1] for a in check if a.startswith("bus.user="))
    password_env = next(a.split("=", 1)[1] for a in check if a.startswith("bus.password_env="))
    await streams_ready(server, passwords, run, registry)
    config = user_config(tmp_path, server, run, user, passwords[password_env])
    status = await fetch_status(load_config(config), timeout=10.0)
    assert status.ledger is not None


async def test_wrong_password_is_refused(server, passwords):
    with pytest.raises(Exception) as info:
        await nats.connect(
            servers=[server.url],
            user="trainer",
            password="wrong",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
        )
    assert "authorization" in str(info.value).lower() or isinstance(
        info.value, (nats.errors.NoServersError, nats.errors.AuthorizationError)
    )


async def test_operator_runs_lorabus_watch_and_registry_status_but_publishes_no_event(
    server, passwords, run, registry, tmp_path
):
    """`lorabus watch` (a `lorabus.<run>.>` subscription) and `lorabus registry status` work
    with the operator credential; the operator cannot publish run events."""
    from services.clients.watch import watch
    from services.config.loader import load_config
    from services.registry.status import fetch_status

    await streams_ready(server, passwords, run, registry)
    config = user_config(tmp_path, server, run, "operator", passwords["NATS_OPERATOR_PASSWORD"])
    cfg = load_config(config)
    status = await fetch_status(cfg, timeout=10.0)
    assert status.ledger is not None

    lines: list[str] = []
    stop = asyncio.Event()
    watching = asyncio.create_task(watch(cfg, False, False, out=lines.append, stop=stop))
    await asyncio.sleep(0.5)  # subscription in place
    trainer = await connect(server, passwords, "trainer", run, "trainer")
    await trainer.publish(subjects.adapter_ready(run, 6), adapter_event(run, 6), msg_id=f"{run}-v6")
    await trainer.close()
    try:
        await wait_until(lambda: any("tiny_lora-v6" in line for line in lines), what="watch output")
    finally:
        stop.set()
        await asyncio.wait_for(watching, 10)

    nc, errors = await raw_connect(server, passwords, "operator")
    try:
        await nc.publish(subjects.adapter_ready(run, 8), b"{}")
        await nc.flush()
        await wait_until(lambda: errors, what="a permissions violation")
    finally:
        await nc.close()


async def test_object_store_credentials_never_travel_in_events(s3_store, monkeypatch):
    """A real S3 upload's reference, put in a real AdapterReady, carries neither key; the
    wire contract has no field for credentials; URIs with userinfo are refused."""
    from services.common.store import StoreError, parse_s3_uri

    access = os.environ["LORABUS_S3_ACCESS_KEY"]
    secret = os.environ["LORABUS_S3_SECRET_KEY"]
    ref = s3_store.put_bytes("run/adapters/v1/adapter_model.safetensors", b"weights")
    event = m.AdapterReady(
        run="r",
        trainer_epoch="e0",
        lora_name="l",
        version=1,
        trainer_step=0,
        created_at=time.time(),
        lora=m.LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj"], base_model="tiny"),
        payloads=[m.ObjectPayload(uri=ref.uri, bytes=ref.bytes, sha256=ref.sha256)],
    )
    wire = codec.encode(event)
    assert access.encode() not in wire and secret.encode() not in wire
    assert "@" not in ref.uri.split("//", 1)[1].split("/", 1)[0]

    forbidden = re.compile(r"(secret|password|passwd|credential|access_key|api_key|auth|^token$)", re.I)
    nested = (m.LoraSpec, m.TensorSpec, m.ObjectPayload, m.XcclPayload, m.Completion)
    for struct in m.TOP_LEVEL + nested:
        for f in msgspec.structs.fields(struct):
            assert not forbidden.search(f.name), f"{struct.__name__}.{f.name} looks like a credential"

    with pytest.raises(StoreError):
        parse_s3_uri(f"s3://{access}:{secret}@bucket/key")


def make_certs(directory) -> dict[str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, crt = (
        str(directory / n) for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt")
    )
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            ca_key,
            "-out",
            ca,
            "-days",
            "1",
            "-subj",
            "/CN=lorabus-test-ca",
        ],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            crt,
            "-days",
            "1",
            "-extfile",
            str(ext),
        ],
    ]
    for step in steps:
        subprocess.run(step, check=True, capture_output=True, timeout=60)
    return {"NATS_TLS_CERT": crt, "NATS_TLS_KEY": key, "NATS_TLS_CA": ca}


async def test_tls_switch(tmp_path, passwords, monkeypatch):
    """With tls-on.conf included the server demands TLS: a client trusting the CA gets in
    over tls://, a plain-text client is refused."""
    from tests.deploy.natsauth import NATS_DIR

    if not shutil.which("openssl"):
        pytest.fail("openssl is needed to make test certificates")
    certs = make_certs(tmp_path / "certs")
    for var, value in {**passwords, **certs}.items():
        monkeypatch.setenv(var, value)
    srv = start_with_deploy_config(tmp_path, passwords, tls_conf=NATS_DIR / "tls-on.conf")
    try:
        url = f"tls://127.0.0.1:{srv.port}"
        cfg = BusConfig(
            url=url,
            user="registry",
            password=passwords["NATS_REGISTRY_PASSWORD"],
            tls_ca=certs["NATS_TLS_CA"],
            connect_timeout_s=3.0,
        )
        registry = await Bus.connect(cfg, run="tlsrun", service="registry")
        await registry.ensure_streams()  # the registry creates a run's streams
        await registry.close()
        cfg = msgspec.structs.replace(cfg, user="trainer", password=passwords["NATS_TRAINER_PASSWORD"])
        bus = await Bus.connect(cfg, run="tlsrun", service="trainer")
        try:
            await bus.ensure_streams()  # finds them in place: needs nothing but STREAM.INFO
            assert await bus.publish(subjects.adapter_ready("tlsrun", 0), adapter_event("tlsrun", 0)) >= 1
        finally:
            await bus.close()
        # a plain-text client is turned away (by the TLS handshake or the server's error)
        with pytest.raises((OSError, nats.errors.Error)):
            await nats.connect(
                servers=[srv.url],
                user="trainer",
                password=passwords["NATS_TRAINER_PASSWORD"],
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=2,
            )
    finally:
        srv.close()


async def test_the_cluster_config_gives_the_registry_replicated_streams(tmp_path, passwords, monkeypatch):
    """Issue 30, compose profile `cluster`: three nodes on cluster.conf (nats.conf's users,
    permissions and JetStream, plus routes) form one JetStream cluster; the registry's
    credential creates the run's streams and ledger with 3 replicas, and another service
    finds them through any single node."""
    for var, value in passwords.items():
        monkeypatch.setenv(var, value)
    cluster = start_cluster_with_deploy_config(tmp_path, passwords)
    run = f"cl{uuid.uuid4().hex[:8]}"
    try:
        cfg = BusConfig(url=cluster.url, user="registry", password=passwords["NATS_REGISTRY_PASSWORD"],
                        connect_timeout_s=3.0, stream_replicas=3)  # fmt: skip
        registry = await Bus.connect(cfg, run=run, service="registry")
        try:
            await registry.ensure_streams()
            await registry.key_value(streams.ledger_bucket(run))
            for name in (streams.ACCEPTED(run), streams.kv_stream(streams.ledger_bucket(run))):
                info = await registry.js.stream_info(name)
                assert info.config.num_replicas == 3 and info.cluster is not None, name
                assert len(info.cluster.replicas or []) == 2, (name, info.cluster)
        finally:
            await registry.close()
        one = BusConfig(url=cluster.nodes[2].url, user="trainer", password=passwords["NATS_TRAINER_PASSWORD"],
                        connect_timeout_s=3.0)  # fmt: skip
        trainer = await Bus.connect(one, run=run, service="trainer")
        try:
            await trainer.ensure_streams()  # in place: STREAM.INFO only
            assert await trainer.publish(subjects.adapter_ready(run, 0), adapter_event(run, 0)) == 1
        finally:
            await trainer.close()
    finally:
        cluster.close()


@pytest.mark.parametrize("user", ["trainer", "exporter", "rollout-vllm-0", "rollout-cpu-1"])
async def test_services_read_the_newest_stored_event(server, passwords, run, registry, user):
    """`Bus.last` (is v<N> announced or exported yet; which adapter is the head) is a direct
    message get: the trainer, the exporter and every replica need it (found by bringing
    docker-compose.cpu.yml up: the trainer could not announce v0 without it)."""
    await streams_ready(server, passwords, run, registry)
    trainer = await connect(server, passwords, "trainer", run, "trainer")
    reader = await connect(server, passwords, user, run, user)
    try:
        await trainer.publish(subjects.adapter_ready(run, 7), adapter_event(run, 7), msg_id=f"{run}-v7")
        newest = await reader.last(streams.ADAPTERS(run), m.AdapterReady, subjects.adapter_ready(run, 7))
        assert newest is not None and newest.version == 7
    finally:
        await reader.close()
        await trainer.close()


@pytest.mark.parametrize("user", ["rollout-vllm-0", "rollout-cpu-1"])
async def test_the_trainer_sends_a_versions_canary_and_every_replica_waits_for_it(
    server, passwords, run, registry, user
):
    """Issue 28: the canary follows its event on `canary.v<N>` (stream CANARIES, created by the
    registry with the rest): the trainer may publish it, a replica may wait for it (woken by a
    core subscription, read back by DIRECT.GET) and may not publish one itself."""
    import asyncio

    from services.trainer.publish import publish_canary

    await streams_ready(server, passwords, run, registry)
    version = 20 + (user == "rollout-cpu-1")
    trainer = await connect(server, passwords, "trainer", run, "trainer")
    reader = await connect(server, passwords, user, run, user)
    subject = subjects.adapter_canary(run, version)
    event = msgspec.structs.replace(adapter_event(run, version), canary_follows=True)
    want = m.Canary(dtype="float32", sequences=[m.CanarySequence(prompt_token_ids=[1], token_ids=[2], logprobs=[-0.3])])
    try:
        await trainer.publish(subjects.adapter_ready(run, version), event, msg_id=f"{run}-v{version}")

        async def later() -> None:
            await asyncio.sleep(0.3)
            await publish_canary(trainer, event, want)

        sending = asyncio.create_task(later())
        t0 = time.monotonic()
        got = await reader.wait_last(streams.CANARIES(run), m.AdapterCanary, subject, timeout=10)
        assert got is not None and got.canary == want and got.adapter_sha256 == "0" * 64
        assert time.monotonic() - t0 < 1.5, "read soon after it was stored"
        await sending
    finally:
        await reader.close()
        await trainer.close()
    nc, errors = await raw_connect(server, passwords, user)
    try:
        await nc.subscribe(subject)  # what wakes `wait_last`: allowed
        await nc.flush()
        forged = subjects.adapter_canary(run, version + 10)
        with pytest.raises(nats.errors.TimeoutError):  # dropped by the server: no PubAck
            await nc.jetstream().publish(forged, b"{}", timeout=1.0)
        await wait_until(lambda: errors, what="a permissions violation")
        assert any("permissions violation for publish" in e.lower() and forged.lower() in e.lower() for e in errors)
        assert not any("subscription" in e.lower() and subject.lower() in e.lower() for e in errors), errors
    finally:
        await nc.close()
