"""Generate the wire contract for non-Python peers from the Structs in `proto.messages`.

    python -m proto.generate           # (re)write proto/schema/*.json and proto/asyncapi.yaml
    python -m proto.generate --check   # exit 1 and name every stale file

One JSON Schema (2020-12, from `msgspec.json.schema`) per top-level message and per tagged
union a subscriber decodes as one type, and an AsyncAPI 3.0 document with one channel per
subject family of `proto.subjects`, who sends and who receives on it, and an example of every
message. Channel addresses are derived by calling the subject builders themselves, so they
cannot drift from what services actually publish. Output is deterministic (sorted keys).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml

from proto import codec, subjects
from proto import messages as m

PROTO_DIR = Path(__file__).resolve().parent
SCHEMA_DIR = "schema"
ASYNCAPI = "asyncapi.yaml"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

UNIONS: dict[str, Any] = {"AdmissionReply": m.AdmissionReply, "RolloutReport": m.RolloutReport}
"""tagged unions a receiver decodes as one type: they get a schema file of their own"""


def schema_types() -> dict[str, Any]:
    return {**{t.__name__: t for t in m.TOP_LEVEL}, **UNIONS}


def json_schema(type_: Any, name: str) -> dict:
    schema = msgspec.json.schema(type_)
    # `schema_version` has a default in the Struct, but the codec refuses a message without it
    for definition in schema.get("$defs", {}).values():
        if "schema_version" in definition.get("properties", {}):
            required = definition.setdefault("required", [])
            if "schema_version" not in required:
                required.insert(0, "schema_version")
    return {"$schema": JSON_SCHEMA_DIALECT, "$id": f"{name}.json", "title": name, **schema}


# --- examples: one valid message of every type (also used by the tests) ---------------------

_T0 = 1_764_000_000.0
_SHA = "3b" * 32


def example_messages() -> dict[str, msgspec.Struct]:
    lora = m.LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"], base_model="tiny")
    completion = m.Completion(token_ids=[5, 9, 2], logprobs=[-0.5, -1.25, -0.125], versions=[3, 3, 4], reward=1.0)
    examples: list[msgspec.Struct] = [
        m.AdapterReady(
            run="demo-trial0",
            trainer_epoch="e0",
            lora_name="default_lora",
            version=4,
            parent_version=3,
            trainer_step=4,
            created_at=_T0,
            lora=lora,
            payloads=[
                m.ObjectPayload(
                    uri="s3://lorabus/demo-trial0/adapters/v4/adapter_model.safetensors",
                    bytes=65536,
                    sha256=_SHA,
                ),
                m.XcclPayload(
                    backend="gloo",
                    master_address="10.0.0.5",
                    master_port=29500,
                    world_size=3,
                    group_name="lorabus-demo-trial0-v4",
                    tensors=[
                        m.TensorSpec(
                            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                            [8, 64],
                            "float32",
                        )
                    ],
                    bucket_bytes=64 * 1024 * 1024,
                    ranks={"rollout-0": 1, "rollout-1": 2},
                ),
            ],
            canary_follows=True,
        ),
        m.AdapterCanary(
            run="demo-trial0",
            trainer_epoch="e0",
            version=4,
            adapter_sha256=_SHA,
            canary=m.Canary(
                dtype="bfloat16",
                sequences=[m.CanarySequence(prompt_token_ids=[17, 4, 93], token_ids=[12, 7], logprobs=[-0.25, -1.5])],
            ),
            created_at=_T0 + 0.2,
        ),
        m.AdapterLoaded(
            run="demo-trial0",
            replica="rollout-0",
            version=4,
            via="object",
            load_seconds=0.025,
            loaded_at=_T0 + 1,
        ),
        m.AdapterUnloaded(
            run="demo-trial0",
            replica="rollout-0",
            version=1,
            reason="outside keep window",
            unloaded_at=_T0 + 1,
        ),
        m.AdapterFailed(
            run="demo-trial0",
            replica="rollout-1",
            version=4,
            reason="sha256 mismatch",
            attempt=1,
            will_retry=True,
            failed_at=_T0 + 1,
        ),
        m.ReplicaHeartbeat(
            run="demo-trial0",
            replica="rollout-0",
            engine="embedded",
            loaded_versions=[2, 3, 4],
            in_flight=2,
            sent_at=_T0 + 2,
            started_at=_T0 - 60,
            incarnation="3f9c2a7be1d04c58",
        ),
        m.AdmissionRequest(
            run="demo-trial0",
            replica="rollout-0",
            request_id="rollout-0-17",
            loaded_versions=[3, 4],
        ),
        m.AdmissionGrant(request_id="rollout-0-17", grant_id="g-17", version=4, lease_expires_at=_T0 + 60),
        m.FleetAdmissionRequest(
            fleet="demo-trial0",
            replica="rollout-0",
            request_id="rollout-0-19",
            loaded={"demo-trial0": [3, 4], "demo-r16": [1]},
        ),
        m.AdmissionDeny(
            request_id="rollout-0-18",
            reason="staleness capacity (k + H + 1) * B reached",
            retry_after_s=0.5,
        ),
        m.Trajectory(
            run="demo-trial0",
            trajectory_id="t-17",
            grant_id="g-17",
            replica="rollout-0",
            prompt_id="p-3",
            prompt_token_ids=[1, 7, 7],
            completions=[completion],
            started_at=_T0 + 2,
            finished_at=_T0 + 3,
        ),
        m.TrajectoryDecision(
            run="demo-trial0",
            trajectory_id="t-17",
            grant_id="g-17",
            replica="rollout-0",
            verdict="accepted",
            head_version=4,
            oldest_version=3,
            decided_at=_T0 + 3,
        ),
        m.ExportDone(
            run="demo-trial0",
            lora_name="default_lora",
            version=4,
            uri="file:///runs/demo-trial0/export/v4",
            files=["adapter_config.json", "adapter_model.safetensors"],
            bytes=65536,
            sha256=_SHA,
            exported_at=_T0 + 4,
        ),
        m.EvalResult(
            run="demo-trial0",
            evaluator="heldout",
            version=4,
            metric="accuracy",
            score=0.75,
            n=64,
            evaluated_at=_T0 + 5,
        ),
        m.TrainerStep(
            run="demo-trial0",
            step=4,
            version=5,
            loss=0.0123,
            reward_mean=0.5,
            groups=8,
            tokens=1024,
            step_seconds=0.3,
            mean_staleness=0.5,
            finished_at=_T0 + 6,
        ),
        m.DeadLetter(
            run="demo-trial0",
            service="registry",
            subject="lorabus.demo-trial0.trajectory.rollout-0",
            reason="decode",
            error="not valid JSON",
            raw=b"{not json",
            received_at=_T0 + 7,
        ),
        m.RunSubmit(
            fleet="demo-trial0",
            run="demo-r16",
            config={"run": "demo-r16", "gconfig": {"lora_name": "r16"}, "actor": {"lora_rank": 16}},
        ),
        m.RunStop(fleet="demo-trial0", run="demo-r16", reason="enough"),
        m.RunList(fleet="demo-trial0"),
        m.RunResume(fleet="demo-trial0", run="demo-r16"),
        m.RunReply(
            fleet="demo-trial0",
            ok=True,
            runs=[
                m.RunInfo(
                    run="demo-r16",
                    lora_name="r16",
                    state="active",
                    share=1.0,
                    lora_rank=16,
                    total_train_steps=20,
                    head_version=3,
                    running=2,
                    accepted=30,
                    adapter_memory_bytes=70_778_880,
                )
            ],
        ),
        m.RunRecord(
            fleet="demo-trial0",
            run="demo-r16",
            state="active",
            share=1.0,
            config={"run": "demo-r16", "actor": {"lora_rank": 16}},
            submitted_at=_T0,
            changed_at=_T0,
        ),
    ]
    return {type(e).__name__: e for e in examples}


# --- subject families -------------------------------------------------------------------------

PARAMETERS: dict[str, str] = {
    "run": "the run id (`{experiment_name}-{trial_name}`); a subject token of 1-64 [A-Za-z0-9_-]",
    "version": "adapter version N, a non-negative integer (served as `{lora_name}-v{N}`)",
    "replica": "rollout replica id; a subject token of 1-64 [A-Za-z0-9_-]",
    "evaluator": "evaluator name; a subject token of 1-64 [A-Za-z0-9_-]",
    "service": "the service that gave up on the message; a subject token of 1-64 [A-Za-z0-9_-]",
    "fleet": "the fleet's name (the run of the config `lorabus up` started it with); a subject token",
}
_INT_PARAMS = {"version"}


@dataclass(frozen=True)
class Family:
    channel: str
    builder: Callable[..., str]
    messages: tuple[str, ...]
    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    description: str
    fixed: dict[str, str] = field(default_factory=dict)
    """builder arguments that are part of the channel (the rollout report kind)"""
    reply: tuple[str, ...] = ()
    """for request/reply: the reply message types (sent to the requester's inbox)"""


_ALL_SERVICES = ("trainer", "rollout", "registry", "exporter")

FAMILIES: tuple[Family, ...] = (
    Family(
        "adapterReady",
        subjects.adapter_ready,
        ("AdapterReady",),
        ("trainer",),
        ("rollout", "registry", "exporter", "evaluator", "watch"),
        "A new adapter version exists: fetch it (object payload) or join the broadcast (xccl "
        "payload). JetStream-persisted for the run's lifetime; late joiners replay it.",
    ),
    Family(
        "adapterCanary",
        subjects.adapter_canary,
        ("AdapterCanary",),
        ("trainer",),
        ("rollout",),
        "The canary of an adapter version whose AdapterReady says `canary_follows`: published "
        "once the trainer computed it, after the event; a replica holds the version's output until "
        "it arrived and passed. JetStream-persisted (the newest per version).",
    ),
    *(
        Family(
            f"rollout{kind.capitalize()}",
            subjects.rollout_report,
            (message,),
            ("rollout",),
            ("registry", "watch"),
            f"A rollout replica reports `{kind}`. JetStream-persisted.",
            fixed={"kind": kind},
        )
        for kind, message in zip(
            subjects.ROLLOUT_KINDS,
            ("AdapterLoaded", "AdapterUnloaded", "AdapterFailed", "ReplicaHeartbeat"),
        )
    ),
    Family(
        "admission",
        subjects.admission,
        ("AdmissionRequest",),
        ("rollout",),
        ("registry",),
        "A rollout asks for one group's admission; the registry replies with a grant or a "
        "deny on the request's reply inbox. Core NATS request/reply, never persisted.",
        reply=("AdmissionGrant", "AdmissionDeny"),
    ),
    Family(
        "fleetAdmission",
        subjects.fleet_admission,
        ("FleetAdmissionRequest",),
        ("rollout",),
        ("registry",),
        "A replica asks for one group of work for any run of the fleet; the registry picks the "
        "run by weighted fair share and replies with a grant naming run and version, or a deny. "
        "Core NATS request/reply, never persisted.",
        reply=("AdmissionGrant", "AdmissionDeny"),
    ),
    *(
        Family(
            f"run{op.capitalize()}",
            subjects.run_control,
            (message,),
            senders,
            ("registry",),
            f"`lorabus run {op}`: {what} Core NATS request/reply; the run table itself is the KV "
            "bucket `lorabus_<fleet>_runs` (one RunRecord per run, written by the registry only).",
            fixed={"op": op},
            reply=("RunReply",),
        )
        for op, message, senders, what in (
            ("submit", "RunSubmit", ("operator",), "add a run to the fleet (its config validated by the registry)."),
            ("list", "RunList", ("operator",), "the fleet's runs with their state, share and progress."),
            (
                "stop",
                "RunStop",
                ("operator", "trainer", "rollout"),
                "stop granting work to a run; its versions and exports stay. The trainer and the "
                "rollouts send it too, for a submitted run that failed on its own (reason `failed in "
                "<service>: ...`, services/common/run_faults.py).",
            ),
            (
                "resume",
                "RunResume",
                ("operator",),
                "serve a stopped run again from its last checkpoint, under its own name.",
            ),
        )
    ),
    Family(
        "registryStatus",
        subjects.registry_status,
        (),
        ("watch",),
        ("registry",),
        "Ask the registry for its current state (head version, capacity, replicas); core NATS "
        "request/reply. The reply is a JSON object not yet typed in proto.messages.",
    ),
    Family(
        "trajectory",
        subjects.trajectory,
        ("Trajectory",),
        ("rollout",),
        ("registry",),
        "One prompt's group of completions with behaviour logprobs and per-token versions, "
        "awaiting the registry's staleness check. JetStream-persisted.",
    ),
    Family(
        "accepted",
        subjects.accepted,
        ("Trajectory",),
        ("registry",),
        ("trainer",),
        "Trajectories the registry accepted: the trainer's input. JetStream-persisted.",
    ),
    Family(
        "decision",
        subjects.decision,
        ("TrajectoryDecision",),
        ("registry",),
        ("rollout", "watch"),
        "The registry's verdict on one trajectory. JetStream-persisted.",
    ),
    Family(
        "exportDone",
        subjects.export_done,
        ("ExportDone",),
        ("exporter",),
        ("evaluator", "watch"),
        "A loadable HF PEFT directory for version N exists. JetStream-persisted.",
    ),
    Family(
        "evalResult",
        subjects.eval_result,
        ("EvalResult",),
        ("evaluator",),
        ("watch",),
        "An outside evaluator's score for one version. JetStream-persisted.",
    ),
    Family(
        "trainerStep",
        subjects.trainer_step,
        ("TrainerStep",),
        ("trainer",),
        ("watch",),
        "Trainer progress after each optimiser step. JetStream-persisted.",
    ),
    Family(
        "deadLetter",
        subjects.dead_letter,
        ("DeadLetter",),
        _ALL_SERVICES,
        ("watch",),
        "A message a service could not use, with the reason and the original bytes. JetStream-persisted for a week.",
    ),
)


def _sentinel(name: str, index: int) -> str | int:
    return 900_000_000 + index if name in _INT_PARAMS else f"P{index}x{name}"


def channel_address(family: Family) -> tuple[str, list[str]]:
    """The builder's subject with every free argument as an AsyncAPI `{parameter}`."""
    names = [n for n in inspect.signature(family.builder).parameters if n not in family.fixed]
    unknown = sorted(set(names) - set(PARAMETERS))
    if unknown:
        raise ValueError(f"{family.builder.__name__}: parameters {unknown} need a description")
    sentinels = {n: _sentinel(n, i) for i, n in enumerate(names)}
    address = family.builder(**sentinels, **family.fixed)
    tokens = address.split(".")
    for n, value in sentinels.items():
        matches = [i for i, t in enumerate(tokens) if str(value) in t]
        if len(matches) != 1:
            raise ValueError(f"{family.builder.__name__}: cannot place {{{n}}} in {address!r}")
        tokens[matches[0]] = tokens[matches[0]].replace(str(value), f"{{{n}}}")
    return ".".join(tokens), names


def _summary(type_: Any) -> str:
    doc = inspect.getdoc(type_) or type_.__name__
    return doc.split("\n\n")[0].replace("\n", " ")


def asyncapi() -> dict:
    examples = example_messages()
    types = schema_types()
    components: dict[str, dict] = {}

    def message_ref(name: str) -> dict:
        if name not in components:
            components[name] = {
                "name": name,
                "title": name,
                "summary": _summary(types[name]),
                "contentType": "application/json",
                "payload": {
                    "schemaFormat": "application/schema+json;version=2020-12",
                    "schema": {"$ref": f"{SCHEMA_DIR}/{name}.json"},
                },
                "examples": [{"name": f"{name}-example", "payload": json.loads(codec.encode(examples[name]))}],
            }
        return {"$ref": f"#/components/messages/{name}"}

    channels: dict[str, dict] = {}
    operations: dict[str, dict] = {}
    for family in FAMILIES:
        address, params = channel_address(family)
        channels[family.channel] = {
            "address": address,
            "description": family.description,
            "parameters": {p: {"description": PARAMETERS[p]} for p in params},
            "messages": {name: message_ref(name) for name in family.messages},
        }
        channel_messages = [{"$ref": f"#/channels/{family.channel}/messages/{name}"} for name in family.messages]
        reply = None
        if family.reply:
            reply_channel = f"{family.channel}Reply"
            channels[reply_channel] = {
                "address": None,
                "description": f"The requester's NATS reply inbox for `{family.channel}`.",
                "messages": {name: message_ref(name) for name in family.reply},
            }
            reply = {
                "channel": {"$ref": f"#/channels/{reply_channel}"},
                "messages": [{"$ref": f"#/channels/{reply_channel}/messages/{name}"} for name in family.reply],
            }
        for action, actors in (("send", family.senders), ("receive", family.receivers)):
            for service in actors:
                op: dict[str, Any] = {
                    "action": action,
                    "channel": {"$ref": f"#/channels/{family.channel}"},
                    "summary": f"{service} {action}s on {family.channel}",
                    "tags": [{"name": service}],
                    "x-lorabus-service": service,
                }
                if channel_messages:
                    op["messages"] = channel_messages
                if reply is not None and action == "receive":
                    op["reply"] = reply
                operations[f"{service}_{action}_{family.channel}"] = op

    services = sorted({s for f in FAMILIES for s in (*f.senders, *f.receivers)})
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "lorabus",
            "version": m.SCHEMA_VERSION,
            "description": (
                "Events of a lorabus run on NATS (JetStream). Payloads are JSON; every "
                "top-level message carries `schema_version` (MAJOR.MINOR) and a receiver "
                "rejects an unknown major version. Generated by `python -m proto.generate` "
                "from proto/messages.py and proto/subjects.py: do not edit by hand."
            ),
            "tags": [{"name": s} for s in services],
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "nats-server -js as started by `lorabus up`",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": components},
    }


# --- files ------------------------------------------------------------------------------------


def render() -> dict[str, str]:
    """Every generated file, relative to proto/, with its exact content."""
    files = {
        f"{SCHEMA_DIR}/{name}.json": json.dumps(json_schema(t, name), indent=2, sort_keys=True) + "\n"
        for name, t in schema_types().items()
    }
    files[ASYNCAPI] = "# Generated by `python -m proto.generate`; do not edit.\n" + yaml.safe_dump(
        asyncapi(), sort_keys=True, allow_unicode=True, width=100
    )
    return files


def stale_files(root: Path = PROTO_DIR) -> list[str]:
    """Paths (relative to root) that differ from what `render` gives, are missing, or are
    schema files no message produces any more."""
    files = render()
    stale = [p for p, text in files.items() if not (root / p).is_file() or (root / p).read_text() != text]
    stale += [
        f"{SCHEMA_DIR}/{p.name}"
        for p in sorted((root / SCHEMA_DIR).glob("*.json"))
        if f"{SCHEMA_DIR}/{p.name}" not in files
    ]
    return sorted(stale)


def write(root: Path = PROTO_DIR) -> list[str]:
    """Write every file that changed and remove orphaned schemas; returns what changed."""
    changed = stale_files(root)
    files = render()
    (root / SCHEMA_DIR).mkdir(parents=True, exist_ok=True)
    for p in changed:
        if p in files:
            (root / p).write_text(files[p])
        else:
            (root / p).unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any file is stale")
    parser.add_argument("--root", type=Path, default=PROTO_DIR, help="output directory (proto/)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.root)
        generated = render()
        for p in stale:
            if p not in generated:
                why = "no message produces it any more"
            else:
                why = "stale" if (args.root / p).exists() else "missing"
            print(f"{args.root / p}: {why}; run `python -m proto.generate`", file=sys.stderr)
        return 1 if stale else 0
    for p in write(args.root):
        print(f"wrote {args.root / p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
