import itertools
import re

import pytest
from nats.js.api import StorageType

from proto import subjects
from services.common import streams

RUN = "exp-trial_0"

# One concrete subject of every persisted family, and the stream that must capture it.
CAPTURED = {
    subjects.adapter_ready(RUN, 7): streams.ADAPTERS(RUN),
    subjects.adapter_canary(RUN, 7): streams.CANARIES(RUN),
    subjects.rollout_report(RUN, "r0", "heartbeat"): streams.REPORTS(RUN),
    subjects.rollout_report(RUN, "r1", "loaded"): streams.REPORTS(RUN),
    subjects.trajectory(RUN, "r0"): streams.TRAJECTORIES(RUN),
    subjects.accepted(RUN): streams.ACCEPTED(RUN),
    subjects.decision(RUN, "r0"): streams.DECISIONS(RUN),
    subjects.export_done(RUN, 3): streams.EXPORTS(RUN),
    subjects.eval_result(RUN, "gsm8k"): streams.EVALS(RUN),
    subjects.trainer_step(RUN): streams.TRAINER(RUN),
    subjects.dead_letter(RUN, "registry"): streams.DEADLETTER(RUN),
}


def test_every_family_lands_in_its_stream():
    for subject, stream in CAPTURED.items():
        assert streams.stream_for_subject(RUN, subject) == stream, subject


def test_request_reply_subjects_are_in_no_stream():
    # a capturing stream would answer the request with a PubAck before the registry does
    assert streams.stream_for_subject(RUN, subjects.admission(RUN)) is None
    assert streams.stream_for_subject(RUN, subjects.registry_status(RUN)) is None


def test_streams_do_not_overlap():
    configs = streams.stream_configs(RUN)
    assert len(configs) == 10
    for a, b in itertools.combinations(configs, 2):
        for pa, pb in itertools.product(a.subjects, b.subjects):
            assert not streams.subjects_overlap(pa, pb), (a.name, pa, b.name, pb)


def test_runs_do_not_share_streams():
    other = streams.stream_configs("other")
    for a, b in itertools.product(streams.stream_configs(RUN), other):
        assert a.name != b.name
        for pa, pb in itertools.product(a.subjects, b.subjects):
            assert not streams.subjects_overlap(pa, pb)


def test_names_are_valid_jetstream_names():
    names = [c.name for c in streams.stream_configs(RUN)]
    assert len(set(names)) == len(names)
    for name in names + [streams.ledger_bucket(RUN)]:
        assert re.fullmatch(r"[A-Za-z0-9_-]+", name), name
    assert streams.ADAPTERS(RUN) == "LORABUS_exp-trial_0_ADAPTERS"


def test_retention_is_durable_and_deduplicating():
    for config in streams.stream_configs(RUN):
        assert config.storage == StorageType.FILE
        assert config.duplicate_window >= 60
        assert config.max_age and config.max_age > 0


def test_bad_run_is_refused_with_the_field_name():
    with pytest.raises(subjects.SubjectError, match="run"):
        streams.ADAPTERS("a.b")
    with pytest.raises(subjects.SubjectError, match="run"):
        streams.ledger_bucket("a*")


@pytest.mark.parametrize(
    "a,b,expected",
    [
        ("a.b", "a.b", True),
        ("a.*", "a.b", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.*.c", "a.b.*", True),
        ("a.*.c", "a.b.d", False),
        ("a.b", "a.c", False),
        (">", "x.y", True),
    ],
)
def test_subjects_overlap(a, b, expected):
    assert streams.subjects_overlap(a, b) is expected
    assert streams.subjects_overlap(b, a) is expected


def test_every_consumer_reads_a_stream_of_the_run():
    names = {c.name for c in streams.stream_configs(RUN)}
    for durable in (
        "trainer",
        "exporter",
        "registry-adapters",
        "registry-reports",
        "registry-exports",
        "registry-trajectories",
        "rollout-r0",
    ):
        consumer = streams.consumer(RUN, durable)
        assert consumer.durable == durable and consumer.stream in names
        if consumer.filter_subject is not None:
            assert streams.stream_for_subject(RUN, consumer.filter_subject.replace("*", "0")) == consumer.stream
    assert streams.consumer(RUN, "rollout-r0").stream == streams.ADAPTERS(RUN)
    assert streams.consumer(RUN, "trainer").max_deliver == -1  # an accepted group is never given up


def test_unknown_consumer_names_the_known_ones():
    for durable in ("rollout-", "nobody"):
        with pytest.raises(ValueError, match="rollout-<replica>"):
            streams.consumer(RUN, durable)
