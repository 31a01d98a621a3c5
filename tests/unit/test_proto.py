"""The wire contract: every message round-trips; every bad input is refused with the right
dead-letter reason; subject builders and parsers agree and refuse unsafe tokens."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto import codec, subjects
from proto import messages as m
from proto.codec import DecodeError
from proto.generate import example_messages

EXAMPLES = example_messages()


def as_dict(msg) -> dict:
    return json.loads(codec.encode(msg))


def raw(d: dict) -> bytes:
    return json.dumps(d).encode()


def reason_of(data: bytes, type_) -> DecodeError:
    with pytest.raises(DecodeError) as err:
        codec.decode(data, type_)
    return err.value


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip(name):
    msg = EXAMPLES[name]
    data = codec.encode(msg)
    back = codec.decode(data, type(msg))
    assert back == msg
    assert codec.encode(back) == data
    assert as_dict(msg)["schema_version"] == m.SCHEMA_VERSION


@pytest.mark.parametrize(
    "union, names",
    [
        (m.AdmissionReply, ["AdmissionGrant", "AdmissionDeny"]),
        (m.RolloutReport, ["AdapterLoaded", "AdapterUnloaded", "AdapterFailed", "ReplicaHeartbeat"]),
    ],
)
def test_union_decodes_to_the_tagged_member(union, names):
    for name in names:
        decoded = codec.decode(codec.encode(EXAMPLES[name]), union)
        assert type(decoded) is type(EXAMPLES[name]) and decoded == EXAMPLES[name]


def test_adapter_ready_payloads_keep_their_kind():
    ready = codec.decode(codec.encode(EXAMPLES["AdapterReady"]), m.AdapterReady)
    assert [p["kind"] for p in as_dict(ready)["payloads"]] == ["object", "xccl"]
    assert ready.object_payload().sha256 == "3b" * 32
    assert ready.xccl_payload().ranks == {"rollout-0": 1, "rollout-1": 2}
    assert ready.adapter_name == "default_lora-v4" == m.adapter_name("default_lora", 4)


def test_dead_letter_raw_bytes_survive_as_base64():
    letter = EXAMPLES["DeadLetter"]
    assert isinstance(as_dict(letter)["raw"], str)
    assert codec.decode(codec.encode(letter), m.DeadLetter).raw == b"{not json"


def test_newer_minor_version_with_unknown_fields_is_accepted():
    d = as_dict(EXAMPLES["TrainerStep"]) | {"schema_version": "1.9", "added_in_1_9": [1, 2]}
    assert codec.decode(raw(d), m.TrainerStep).step == EXAMPLES["TrainerStep"].step


def test_trajectory_oldest_version():
    assert EXAMPLES["Trajectory"].oldest_version() == 3


# --- decode: malformed and schema version -----------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"{not json", b"\xff\xfe", b'{"schema_version": "1.0"', b"nul"])
def test_malformed_bytes_reason_decode(data):
    assert reason_of(data, m.TrainerStep).reason == "decode"


def test_missing_schema_version_says_what_to_do():
    d = as_dict(EXAMPLES["EvalResult"])
    del d["schema_version"]
    err = reason_of(raw(d), m.EvalResult)
    assert err.reason == "schema-version"
    assert "schema_version: missing" in str(err) and '"schema_version": "1.0"' in str(err)


@pytest.mark.parametrize("version", ["2.0", "0.9", "17"])
def test_unknown_major_version_rejected(version):
    d = as_dict(EXAMPLES["EvalResult"]) | {"schema_version": version}
    err = reason_of(raw(d), m.EvalResult)
    assert err.reason == "schema-version"
    assert "upgrade the receiver or the sender" in str(err)


@pytest.mark.parametrize("version", ["one.zero", ".1", "v1.0"])
def test_unparseable_schema_version_rejected(version):
    d = as_dict(EXAMPLES["EvalResult"]) | {"schema_version": version}
    err = reason_of(raw(d), m.EvalResult)
    assert err.reason == "schema-version" and "MAJOR.MINOR" in str(err)


# --- decode: types, constraints and cross-field rules -----------------------------------------


@pytest.mark.parametrize(
    "name, field, value, where",
    [
        ("EvalResult", "score", "high", "$.score"),
        ("EvalResult", "version", -1, "$.version"),
        ("EvalResult", "run", "has.dot", "$.run"),
        ("EvalResult", "run", "trailing-newline\n", "$.run"),
        ("EvalResult", "evaluator", "", "$.evaluator"),
        ("TrainerStep", "step", 1.5, "$.step"),
        ("AdmissionRequest", "request_id", "", "$.request_id"),
        ("AdmissionRequest", "loaded_versions", "3", "$.loaded_versions"),
        ("ReplicaHeartbeat", "engine", "tgi", "$.engine"),
        ("ReplicaHeartbeat", "incarnation", "a.b", "$.incarnation"),
        ("ReplicaHeartbeat", "incarnation", "short", "$.incarnation"),
        ("TrajectoryDecision", "verdict", "maybe", "$.verdict"),
        ("ExportDone", "sha256", "ABC", "$.sha256"),
        ("AdapterLoaded", "via", "carrier-pigeon", "$.via"),
    ],
)
def test_wrong_field_reason_validation_names_field(name, field, value, where):
    d = as_dict(EXAMPLES[name]) | {field: value}
    err = reason_of(raw(d), type(EXAMPLES[name]))
    assert err.reason == "validation"
    assert where in str(err)


def test_missing_required_field_named():
    d = as_dict(EXAMPLES["TrainerStep"])
    del d["loss"]
    err = reason_of(raw(d), m.TrainerStep)
    assert err.reason == "validation" and "loss" in str(err)


def test_not_an_object_reason_validation():
    assert reason_of(b"[1, 2]", m.TrainerStep).reason == "validation"


def test_wrong_tag_for_type_rejected():
    err = reason_of(codec.encode(EXAMPLES["AdmissionGrant"]), m.AdmissionDeny)
    assert err.reason == "validation"
    d = as_dict(EXAMPLES["AdapterLoaded"]) | {"kind": "exploded"}
    assert reason_of(raw(d), m.RolloutReport).reason == "validation"


def _adapter_ready(**changes) -> dict:
    return as_dict(EXAMPLES["AdapterReady"]) | changes


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"payloads": []}, "payloads: an adapter event needs"),
        ({"parent_version": 4}, "parent_version: 4 must be below version 4"),
        ({"parent_version": 9}, "parent_version: 9 must be below version 4"),
    ],
)
def test_adapter_ready_cross_field_rules(changes, message):
    err = reason_of(raw(_adapter_ready(**changes)), m.AdapterReady)
    assert err.reason == "validation" and message in str(err)


def test_adapter_ready_duplicate_payload_kind():
    d = _adapter_ready()
    d["payloads"] = [d["payloads"][0], d["payloads"][0]]
    err = reason_of(raw(d), m.AdapterReady)
    assert err.reason == "validation" and "at most one of each kind" in str(err)


def test_adapter_ready_bad_payload_fields():
    d = _adapter_ready()
    d["payloads"][0]["uri"] = "http://example/x"
    assert "$.payloads[0].uri" in str(reason_of(raw(d), m.AdapterReady))
    d = _adapter_ready()
    d["payloads"][1]["master_port"] = 70000
    assert "$.payloads[1].master_port" in str(reason_of(raw(d), m.AdapterReady))


def test_completion_lengths_must_agree():
    d = as_dict(EXAMPLES["Trajectory"])
    d["completions"][0]["logprobs"] = [-0.5]
    err = reason_of(raw(d), m.Trajectory)
    assert err.reason == "validation"
    assert "one entry per generated token" in str(err) and "$.completions[0]" in str(err)


def test_trajectory_needs_completions_with_tokens():
    d = as_dict(EXAMPLES["Trajectory"]) | {"completions": []}
    assert "at least one completion" in str(reason_of(raw(d), m.Trajectory))
    d = as_dict(EXAMPLES["Trajectory"])
    empty = {"token_ids": [], "logprobs": [], "versions": [], "reward": 0.0}
    d["completions"] = [empty, empty]
    assert "no completion has a generated token" in str(reason_of(raw(d), m.Trajectory))


def test_cross_field_rules_also_apply_when_constructing():
    with pytest.raises(ValueError, match="one entry per generated token"):
        m.Completion(token_ids=[1, 2], logprobs=[0.0], versions=[0, 0], reward=0.0)
    with pytest.raises(ValueError, match="parent_version"):
        msgspec.structs.replace(EXAMPLES["AdapterReady"], parent_version=5)


# --- the one-pass decode of what `encode` made ------------------------------------------------


def compact(d: dict) -> bytes:
    return msgspec.json.encode(d)  # as `encode` writes: no spaces, so the one-pass path reads it


def _outcome(data: bytes, type_) -> object:
    try:
        return codec.decode(data, type_)
    except DecodeError as exc:
        return exc.reason, str(exc)


_EVAL = as_dict(EXAMPLES["EvalResult"])
ONE_PASS_CASES = [
    *((codec.encode(msg), type(msg)) for _, msg in sorted(EXAMPLES.items())),
    (codec.encode(EXAMPLES["AdmissionGrant"]), m.AdmissionReply),
    (codec.encode(EXAMPLES["AdmissionGrant"]), m.AdmissionDeny),  # the wrong member
    *((compact(_EVAL | {"schema_version": v}), m.EvalResult) for v in ["2.0", "17", "", "v1.0", "1." + "0" * 20]),
    (compact(_EVAL | {"score": "high"}), m.EvalResult),
    (compact({k: v for k, v in _EVAL.items() if k != "run"}), m.EvalResult),
    (codec.encode(EXAMPLES["EvalResult"])[:-1], m.EvalResult),  # cut short
    (codec.encode(EXAMPLES["EvalResult"])[:-1] + b',"schema_version":"2.0"}', m.EvalResult),  # said twice
    (b'{"schema_version":"1.0","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", m.Trajectory),  # too deep
    (b'{"kind":"grant","schema_version":"2.0","request_id":"r"}', m.AdmissionReply),
]


@pytest.mark.parametrize("data, type_", ONE_PASS_CASES)
def test_one_pass_decode_agrees_with_the_envelope_first_reading(data, type_):
    """A message that begins as `encode` writes it is decoded in one pass and its version
    checked after; the same bytes after a space take the envelope-first reading. Both give
    the same message, or the same error."""
    assert codec.VERSION_FIRST.match(data)
    assert _outcome(data, type_) == _outcome(b" " + data, type_)


# --- size -------------------------------------------------------------------------------------


def test_oversized_message_reason_too_large():
    d = as_dict(EXAMPLES["DeadLetter"]) | {"error": "x" * codec.MAX_MESSAGE_BYTES}
    err = reason_of(raw(d), m.DeadLetter)
    assert err.reason == "too-large"
    small = codec.encode(EXAMPLES["DeadLetter"])
    with pytest.raises(DecodeError) as e:
        codec.decode(small, m.DeadLetter, max_bytes=len(small) - 1)
    assert e.value.reason == "too-large"
    assert codec.decode(small, m.DeadLetter, max_bytes=len(small)) == EXAMPLES["DeadLetter"]


def test_encode_refuses_a_message_the_server_would_refuse():
    big = msgspec.structs.replace(EXAMPLES["DeadLetter"], raw=b"\0" * codec.MAX_MESSAGE_BYTES)
    with pytest.raises(ValueError, match="object store"):
        codec.encode(big)


# --- subjects ---------------------------------------------------------------------------------

tokens = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
versions = st.integers(min_value=0, max_value=2**63)
BAD_TOKENS = ["", "a.b", "a*", ">", "a b", "a\n", "x" * 65, "ünï", "a\tb", "$SYS"]


def nats_match(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))


@given(run=tokens, version=versions)
def test_adapter_ready_round_trip(run, version):
    subject = subjects.adapter_ready(run, version)
    assert subjects.parse_adapter_ready(subject) == (run, version)
    assert nats_match(subjects.adapter_ready_all(run), subject)
    assert subject.startswith(subjects.run_prefix(run) + ".")


@given(run=tokens, version=versions)
def test_export_done_round_trip(run, version):
    subject = subjects.export_done(run, version)
    assert subjects.parse_export_done(subject) == (run, version)
    assert nats_match(subjects.export_done_all(run), subject)


@given(run=tokens, replica=tokens, kind=st.sampled_from(subjects.ROLLOUT_KINDS))
def test_rollout_report_round_trip(run, replica, kind):
    subject = subjects.rollout_report(run, replica, kind)
    assert subjects.parse_rollout_report(subject) == (run, replica, kind)
    assert nats_match(subjects.rollout_report_all(run), subject)


@given(run=tokens, name=tokens)
def test_per_name_subjects_match_their_wildcards(run, name):
    for one, every in [
        (subjects.trajectory, subjects.trajectory_all),
        (subjects.decision, subjects.decision_all),
        (subjects.eval_result, subjects.eval_result_all),
        (subjects.dead_letter, subjects.dead_letter_all),
    ]:
        subject = one(run, name)
        assert nats_match(every(run), subject)
        assert subject.split(".")[-1] == name
    other = "x" + run[:63] if run[:1] != "x" else "y" + run[:63]
    assert not nats_match(subjects.trajectory_all(other), subjects.trajectory(run, name))


@given(text=st.text(max_size=120))
def test_parsers_accept_only_what_builders_produce(text):
    for parse, build in [
        (subjects.parse_adapter_ready, subjects.adapter_ready),
        (subjects.parse_export_done, subjects.export_done),
        (subjects.parse_rollout_report, subjects.rollout_report),
    ]:
        try:
            parts = parse(text)
        except subjects.SubjectError:
            continue
        assert build(*parts) == text


@pytest.mark.parametrize(
    "subject",
    [
        "lorabus.r.adapter.v01.ready",
        "lorabus.r.adapter.v-1.ready",
        "lorabus.r.adapter.v1.ready\n",
        "lorabus.r.adapter.vx.ready",
        "lorabus.r.s.adapter.v1.ready",
        f"lorabus.{'r' * 65}.adapter.v1.ready",
        "other.r.adapter.v1.ready",
    ],
)
def test_parse_adapter_ready_rejects(subject):
    with pytest.raises(subjects.SubjectError, match="not an adapter-ready subject"):
        subjects.parse_adapter_ready(subject)


def test_parse_rollout_report_rejects_unknown_kind():
    with pytest.raises(subjects.SubjectError):
        subjects.parse_rollout_report("lorabus.r.rollout.rep.exploded")


@pytest.mark.parametrize("bad", BAD_TOKENS)
def test_builders_reject_bad_tokens_naming_the_field(bad):
    cases = [
        (lambda: subjects.adapter_ready(bad, 1), "run"),
        (lambda: subjects.trajectory("r", bad), "replica"),
        (lambda: subjects.decision("r", bad), "replica"),
        (lambda: subjects.rollout_report("r", bad, "loaded"), "replica"),
        (lambda: subjects.eval_result("r", bad), "evaluator"),
        (lambda: subjects.dead_letter("r", bad), "service"),
        (lambda: subjects.accepted(bad), "run"),
    ]
    for build, field in cases:
        with pytest.raises(subjects.SubjectError, match=f"^{field}: .*use 1-64 of"):
            build()


@pytest.mark.parametrize("version", [-1, 1.5, "3", True, None])
def test_builders_reject_bad_versions(version):
    for build in (subjects.adapter_ready, subjects.export_done):
        with pytest.raises(subjects.SubjectError, match="version"):
            build("r", version)


def test_rollout_report_rejects_unknown_kind():
    with pytest.raises(subjects.SubjectError, match="kind"):
        subjects.rollout_report("r", "rep", "exploded")


def test_token_rejects_non_strings():
    with pytest.raises(subjects.SubjectError, match="replica"):
        subjects.token(5, "replica")
