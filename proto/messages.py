"""Every message lorabus sends over the bus, as msgspec Structs.

Wire format is JSON (see `proto.codec`) so that evaluators written in any language can read
it; the generated JSON Schema and AsyncAPI documents under `proto/` are the contract for them.
Field names are part of the contract: renaming one is a major schema change.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

SCHEMA_VERSION = "1.0"

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Version = Annotated[int, Meta(ge=0, description="adapter version N of `{lora_name}-v{N}`")]
# `(?!\n)`: Python's `$` (msgspec) also matches before a final newline, ECMA's (JSON Schema
# readers) does not; with it both accept exactly the same strings
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$(?!\n)", description="subject-safe token")]
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$(?!\n)")]
UnixTime = Annotated[float, Meta(ge=0, description="seconds since the epoch")]
# Named so that code building these messages can type what it passes (a bare `str` is not one)
Dtype = Literal["float32", "bfloat16", "float16"]
XcclBackend = Literal["nccl", "gloo"]
LoadedVia = Literal["object", "xccl"]
EngineKind = Literal["embedded", "vllm", "sglang"]
FinishReason = Literal["stop", "length", "abort"]
Verdict = Literal["accepted", "rejected-stale", "rejected-invalid"]
DeadLetterReason = Literal["decode", "schema-version", "validation", "too-large", "handler"]


class Message(Struct, forbid_unknown_fields=False, omit_defaults=False, kw_only=True):
    """Base of every top-level message: carries the schema version."""

    schema_version: str = SCHEMA_VERSION


# --- adapter versions ------------------------------------------------------------------------


class LoraSpec(Struct, kw_only=True):
    """How the adapter was built; a receiver needs this to allocate or validate slots."""

    peft_type: Literal["lora"] = "lora"
    rank: PosInt
    alpha: float
    target_modules: list[str]
    dtype: Dtype = "float32"
    base_model: str


class TensorSpec(Struct, array_like=False):
    name: str
    shape: list[NonNegInt]
    dtype: Dtype


class ObjectPayload(Struct, tag="object", tag_field="kind", kw_only=True):
    """The durable copy: a safetensors file (plus adapter_config.json) under `uri`."""

    uri: Annotated[str, Meta(pattern=r"^(s3|file)://.+")]
    bytes: NonNegInt
    sha256: Sha256 | None = None
    """None: an XCCL event sent as soon as the broadcast was done, before the copy was
    serialised; its sha256 is then the content of `announced.sha256` beside the object, written
    once the object is stored (readers: `services.common.durable.read`)"""
    layout: Literal["hf-peft", "megatron-bridge"] = "hf-peft"


class XcclPayload(Struct, tag="xccl", tag_field="kind", kw_only=True):
    """The fast path: join a torch.distributed group hosted by the trainer (rank 0) and receive
    the tensors by broadcast, in manifest order, packed into flat buckets."""

    backend: XcclBackend
    master_address: str
    master_port: Annotated[int, Meta(ge=1, le=65535)]
    world_size: PosInt
    group_name: str
    tensors: list[TensorSpec]
    bucket_bytes: PosInt
    ranks: dict[str, PosInt] = field(default_factory=dict)
    """replica id -> rank in the group; a replica not listed falls back to the object copy"""


Payload = ObjectPayload | XcclPayload


class AdapterReady(Message, kw_only=True):
    """`lorabus.<run>.adapter.v<N>.ready`: trainer -> everyone."""

    run: Name
    lora_name: Name
    version: Version
    parent_version: Version | None = None
    trainer_step: NonNegInt
    created_at: UnixTime
    lora: LoraSpec
    payloads: list[Payload]

    def __post_init__(self) -> None:
        kinds = [type(p).__name__ for p in self.payloads]
        if not kinds:
            raise ValueError("payloads: an adapter event needs an object and/or an xccl payload")
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"payloads: at most one of each kind, got {kinds}")
        if self.parent_version is not None and self.parent_version >= self.version:
            raise ValueError(f"parent_version: {self.parent_version} must be below version {self.version}")

    def object_payload(self) -> ObjectPayload | None:
        return next((p for p in self.payloads if isinstance(p, ObjectPayload)), None)

    def xccl_payload(self) -> XcclPayload | None:
        return next((p for p in self.payloads if isinstance(p, XcclPayload)), None)

    @property
    def adapter_name(self) -> str:
        return adapter_name(self.lora_name, self.version)


def adapter_name(lora_name: str, version: int) -> str:
    """The name an engine serves version N under (AReaL's convention)."""
    return f"{lora_name}-v{version}"


# --- rollout reports -------------------------------------------------------------------------


class AdapterLoaded(Message, tag="loaded", tag_field="kind", kw_only=True):
    run: Name
    replica: Name
    version: Version
    via: LoadedVia
    load_seconds: Annotated[float, Meta(ge=0)]
    loaded_at: UnixTime


class AdapterUnloaded(Message, tag="unloaded", tag_field="kind", kw_only=True):
    run: Name
    replica: Name
    version: Version
    reason: str
    unloaded_at: UnixTime


class AdapterFailed(Message, tag="failed", tag_field="kind", kw_only=True):
    run: Name
    replica: Name
    version: Version
    reason: str
    attempt: PosInt
    will_retry: bool
    failed_at: UnixTime


class ReplicaHeartbeat(Message, tag="heartbeat", tag_field="kind", kw_only=True):
    """Sent periodically; the registry marks a replica gone when heartbeats stop."""

    run: Name
    replica: Name
    engine: EngineKind
    loaded_versions: list[Version]
    in_flight: NonNegInt
    sent_at: UnixTime


RolloutReport = AdapterLoaded | AdapterUnloaded | AdapterFailed | ReplicaHeartbeat


# --- admission (request/reply) ---------------------------------------------------------------


class AdmissionRequest(Message, kw_only=True):
    """A rollout asks to generate one group (one prompt, `group_size` completions)."""

    run: Name
    replica: Name
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    loaded_versions: list[Version] = field(default_factory=list)


class AdmissionGrant(Message, tag="grant", tag_field="kind", kw_only=True):
    request_id: str
    grant_id: str
    version: Version
    """the version the rollout must generate with"""
    lease_expires_at: UnixTime
    run: Name | None = None
    """the run the grant is for: set on a fleet admission (the registry picked the run), None
    on a run's own admission subject (the run is the subject's)"""


class AdmissionDeny(Message, tag="deny", tag_field="kind", kw_only=True):
    request_id: str
    reason: str
    retry_after_s: Annotated[float, Meta(ge=0)]


AdmissionReply = AdmissionGrant | AdmissionDeny


class FleetAdmissionRequest(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.admission`: a replica asks for one group of work for whichever
    run of the fleet the registry picks (the weighted fair share, `services.fleet.share`)."""

    fleet: Name
    replica: Name
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    loaded: dict[Name, list[Version]] = field(default_factory=dict)
    """run -> the versions of that run this replica has loaded"""


# --- trajectories ----------------------------------------------------------------------------


class Completion(Struct, kw_only=True):
    """One sampled completion. `logprobs` and `versions` are per completion token: the
    behaviour log-probability and the adapter version that produced that token."""

    token_ids: list[NonNegInt]
    logprobs: list[float]
    versions: list[Version]
    reward: float
    finish_reason: FinishReason = "stop"

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"completion: token_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have one entry per generated token"
            )


class Trajectory(Message, kw_only=True):
    """`lorabus.<run>.trajectory.<replica>`: one prompt and its group of completions (the unit
    GRPO normalises advantages over, and the unit of admission)."""

    run: Name
    trajectory_id: Annotated[str, Meta(min_length=1, max_length=128)]
    grant_id: str
    replica: Name
    prompt_id: str
    prompt_token_ids: list[NonNegInt]
    completions: list[Completion]
    started_at: UnixTime
    finished_at: UnixTime

    def __post_init__(self) -> None:
        if not self.completions:
            raise ValueError("completions: a trajectory needs at least one completion")
        if not any(c.versions for c in self.completions):
            raise ValueError("completions: no completion has a generated token")

    def oldest_version(self) -> int:
        """The version that counts for off-policyness: the oldest token's."""
        return min(min(c.versions) for c in self.completions if c.versions)


class TrajectoryDecision(Message, kw_only=True):
    """`lorabus.<run>.decision.<replica>`: the registry's verdict on one trajectory."""

    run: Name
    trajectory_id: str
    grant_id: str
    replica: Name
    verdict: Verdict
    reason: str = ""
    head_version: Version
    oldest_version: Version | None = None
    decided_at: UnixTime


# --- exporter, evaluators, trainer progress, dead letters -----------------------------------


class ExportDone(Message, kw_only=True):
    """`lorabus.<run>.export.v<N>.done`: a PEFT directory for version N exists at `uri`."""

    run: Name
    lora_name: Name
    version: Version
    uri: str
    files: list[str]
    bytes: NonNegInt
    sha256: Sha256
    """of adapter_model.safetensors"""
    exported_at: UnixTime


class EvalResult(Message, kw_only=True):
    """`lorabus.<run>.eval.<evaluator>`: an outside evaluator's score for one version."""

    run: Name
    evaluator: Name
    version: Version
    metric: str
    score: float
    n: NonNegInt
    evaluated_at: UnixTime


class TrainerStep(Message, kw_only=True):
    """`lorabus.<run>.trainer.step`: progress after each optimiser step."""

    run: Name
    step: NonNegInt
    version: Version
    """the version published after this step"""
    loss: float
    reward_mean: float
    groups: NonNegInt
    tokens: NonNegInt
    step_seconds: Annotated[float, Meta(ge=0)]
    mean_staleness: Annotated[float, Meta(ge=0)] = 0.0
    finished_at: UnixTime


class DeadLetter(Message, kw_only=True):
    """`lorabus.<run>.deadletter.<service>`: a message a service could not use, and why."""

    run: Name
    service: Name
    subject: str
    reason: DeadLetterReason
    error: str
    raw: bytes
    """the original bytes (base64 in JSON), truncated to 64 KiB"""
    received_at: UnixTime


# --- the fleet's runs (request/reply, and the run table) ------------------------------------

RunStateName = Literal["active", "stopping", "stopped", "finished"]


class RunSubmit(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.run.submit`: add a run to a running fleet."""

    fleet: Name
    run: Name
    config: dict[str, Any]
    """the run file as written: lorabus config keys a run may set (`services.fleet.runconfig`),
    laid over the fleet's config and validated by the registry with the config loader's rules"""


class RunStop(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.run.stop`: stop granting work to a run, let its grants finish,
    keep its published versions and exports."""

    fleet: Name
    run: Name
    reason: str = ""


class RunList(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.run.list`: ask for the fleet's runs."""

    fleet: Name


class RunInfo(Struct, kw_only=True):
    """One run as `lorabus run list` shows it."""

    run: Name
    lora_name: Name
    state: RunStateName
    share: Annotated[float, Meta(gt=0)]
    lora_rank: PosInt
    total_train_steps: PosInt
    head_version: Version | None = None
    running: NonNegInt = 0
    """grants issued and not yet finished"""
    accepted: NonNegInt = 0


class RunReply(Message, kw_only=True):
    """The registry's answer to RunSubmit, RunStop and RunList. `problems` are the config
    loader's `field: value, problem; fix` lines (or why the request was refused)."""

    fleet: Name
    ok: bool
    problems: list[str] = field(default_factory=list)
    runs: list[RunInfo] = field(default_factory=list)


class RunRecord(Message, kw_only=True):
    """One run in the fleet's run table (KV bucket `lorabus_<fleet>_runs`, key = run): what
    every service of the fleet watches to start and stop serving the run. Only the registry
    writes it."""

    fleet: Name
    run: Name
    state: RunStateName
    share: Annotated[float, Meta(gt=0)]
    config: dict[str, Any]
    """the run's whole validated config without the fleet's connection sections (bus, store,
    metrics), which every service takes from its own config"""
    submitted_at: UnixTime
    changed_at: UnixTime
    reason: str = ""


TOP_LEVEL: tuple[type, ...] = (
    AdapterReady,
    AdapterLoaded,
    AdapterUnloaded,
    AdapterFailed,
    ReplicaHeartbeat,
    AdmissionRequest,
    AdmissionGrant,
    AdmissionDeny,
    Trajectory,
    TrajectoryDecision,
    ExportDone,
    EvalResult,
    TrainerStep,
    DeadLetter,
    FleetAdmissionRequest,
    RunSubmit,
    RunStop,
    RunList,
    RunReply,
    RunRecord,
)

__all__ = [name for name in dir() if not name.startswith("_") and name not in {"msgspec"}]
