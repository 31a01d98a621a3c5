"""The generated JSON Schemas and AsyncAPI document: current, valid, and true to the code."""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from proto import codec, generate, subjects
from proto import messages as m

PROTO = Path(generate.__file__).parent
EXAMPLES = generate.example_messages()


def load_schema(name: str) -> dict:
    return json.loads((PROTO / "schema" / f"{name}.json").read_text())


def encoded(msg) -> dict:
    return json.loads(codec.encode(msg))


def test_generated_files_are_current():
    assert generate.stale_files() == [], "run `python -m proto.generate` and commit the result"
    result = subprocess.run([sys.executable, "-m", "proto.generate", "--check"], cwd=PROTO.parent, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()


def test_check_names_stale_missing_and_orphaned_files(tmp_path):
    root = tmp_path / "proto"
    generate.write(root)
    assert generate.stale_files(root) == []
    (root / "schema" / "Trajectory.json").write_text("{}\n")
    (root / "schema" / "EvalResult.json").unlink()
    (root / "schema" / "Removed.json").write_text("{}\n")
    result = subprocess.run(
        [sys.executable, "-m", "proto.generate", "--check", "--root", str(root)],
        cwd=PROTO.parent,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "Trajectory.json: stale" in result.stderr
    assert "EvalResult.json: missing" in result.stderr
    assert "Removed.json: no message produces it" in result.stderr
    assert "AdapterReady.json" not in result.stderr
    generate.write(root)
    assert generate.stale_files(root) == []
    assert not (root / "schema" / "Removed.json").exists()


def test_output_is_deterministic():
    assert generate.render() == generate.render()


def test_one_schema_per_top_level_message_and_union():
    names = {p.stem for p in (PROTO / "schema").glob("*.json")}
    assert names == {t.__name__ for t in m.TOP_LEVEL} | {"AdmissionReply", "RolloutReport"}


def test_every_top_level_message_has_an_example():
    assert set(EXAMPLES) == {t.__name__ for t in m.TOP_LEVEL}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_schema_validates_real_example(name):
    schema = load_schema(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    instance = encoded(EXAMPLES[name])
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)
    # and the example is a message the codec accepts as that type
    assert codec.decode(codec.encode(EXAMPLES[name]), type(EXAMPLES[name])) == EXAMPLES[name]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_schema_rejects_broken_example(name):
    """The schemas have teeth: a missing schema_version or a wrongly typed field fails."""
    schema = load_schema(name)
    instance = encoded(EXAMPLES[name])
    no_version = {k: v for k, v in instance.items() if k != "schema_version"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(no_version, schema, cls=jsonschema.Draft202012Validator)
    field = next(k for k, v in instance.items() if isinstance(v, str) and k != "schema_version")
    wrong = {**instance, field: 12345}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize(
    "union, members",
    [
        ("AdmissionReply", ["AdmissionGrant", "AdmissionDeny"]),
        ("RolloutReport", ["AdapterLoaded", "AdapterUnloaded", "AdapterFailed", "ReplicaHeartbeat"]),
    ],
)
def test_union_schema_validates_each_member(union, members):
    schema = load_schema(union)
    for name in members:
        instance = encoded(EXAMPLES[name])
        jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)
        untagged = {k: v for k, v in instance.items() if k != "kind"}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(untagged, schema, cls=jsonschema.Draft202012Validator)


def test_adapter_ready_schema_enforces_patterns():
    schema = load_schema("AdapterReady")
    instance = encoded(EXAMPLES["AdapterReady"])
    bad = copy.deepcopy(instance)
    bad["payloads"][0]["sha256"] = "not-a-sha"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)
    bad = copy.deepcopy(instance)
    bad["run"] = "has.dot"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft202012Validator)


# --- AsyncAPI -------------------------------------------------------------------------------

DOC = yaml.safe_load((PROTO / "asyncapi.yaml").read_text())
EXAMPLE_ARGS = {
    "run": "demo-trial0",
    "version": 7,
    "replica": "rollout-1",
    "evaluator": "heldout",
    "service": "registry",
    "fleet": "demo-trial0",
}


def resolve(ref: str):
    node = DOC
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def test_asyncapi_document_shape():
    assert DOC["asyncapi"] == "3.0.0"
    assert DOC["info"]["version"] == m.SCHEMA_VERSION
    assert DOC["servers"]["local"]["protocol"] == "nats"
    for op_id, op in DOC["operations"].items():
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", op_id)
        assert op["action"] in ("send", "receive")
        channel = resolve(op["channel"]["$ref"])
        for msg in op.get("messages", []):
            assert msg["$ref"].startswith(op["channel"]["$ref"] + "/messages/")
            resolve(msg["$ref"])
        if "reply" in op:
            resolve(op["reply"]["channel"]["$ref"])
            for msg in op["reply"]["messages"]:
                resolve(msg["$ref"])
        assert channel["address"] is not None


def test_every_message_references_an_existing_schema_and_its_example_validates():
    for name, message in DOC["components"]["messages"].items():
        ref = message["payload"]["schema"]["$ref"]
        schema = json.loads((PROTO / ref).read_text())
        assert schema["title"] == name
        for example in message["examples"]:
            jsonschema.validate(example["payload"], schema, cls=jsonschema.Draft202012Validator)
    for channel in DOC["channels"].values():
        for msg in channel["messages"].values():
            resolve(msg["$ref"])


def _concrete(address: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda g: str(EXAMPLE_ARGS[g.group(1)]), address)


def _builders():
    """Every function of proto.subjects that builds one concrete subject."""
    return {
        name: fn
        for name, fn in inspect.getmembers(subjects, inspect.isfunction)
        if fn.__module__ == subjects.__name__
        and not name.startswith(("parse_", "_"))
        and not name.endswith("_all")
        and name not in ("token", "run_prefix")
    }


def test_every_channel_address_is_a_subject_builder():
    builders = _builders()
    covered = set()
    for channel_id, channel in DOC["channels"].items():
        address = channel["address"]
        if address is None:  # the reply inbox of a request/reply channel
            assert channel_id.endswith("Reply")
            continue
        params = re.findall(r"\{(\w+)\}", address)
        assert sorted(params) == sorted(channel.get("parameters", {})), channel_id
        concrete = _concrete(address)
        matches = []
        for name, fn in builders.items():
            sig = inspect.signature(fn).parameters
            if set(params) - set(sig):
                continue
            kwargs = {p: EXAMPLE_ARGS[p] for p in params}
            for fixed in ("kind", "op"):  # a family per value: the channel's last token
                if fixed in sig:
                    kwargs[fixed] = address.rsplit(".", 1)[1]
            if set(sig) != set(kwargs):
                continue
            try:
                built = fn(**kwargs)
            except subjects.SubjectError:
                continue
            if built == concrete:
                matches.append(name)
        assert len(matches) == 1, f"{channel_id}: {address} matches builders {matches}"
        covered.add(matches[0])
    assert covered == set(builders), f"subject builders without a channel: {set(builders) - covered}"


def test_rollout_channels_cover_every_kind():
    addresses = {c["address"] for c in DOC["channels"].values() if c["address"]}
    for kind in subjects.ROLLOUT_KINDS:
        assert f"lorabus.{{run}}.rollout.{{replica}}.{kind}" in addresses


def test_every_channel_has_a_sender_and_a_receiver():
    for channel_id, channel in DOC["channels"].items():
        if channel["address"] is None:
            continue
        ops = [o for o in DOC["operations"].values() if o["channel"]["$ref"] == f"#/channels/{channel_id}"]
        actions = {o["action"] for o in ops}
        assert actions == {"send", "receive"}, channel_id
        assert all(o["x-lorabus-service"] == o["tags"][0]["name"] for o in ops)


def test_generation_into_fresh_dir_matches_checked_in(tmp_path):
    shutil.copytree(PROTO / "schema", tmp_path / "schema")
    shutil.copy(PROTO / "asyncapi.yaml", tmp_path / "asyncapi.yaml")
    assert generate.write(tmp_path) == []
