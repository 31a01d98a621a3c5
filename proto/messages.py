"""Every message lorabus sends over the bus, as msgspec Structs.

Wire format is JSON (see `proto.codec`) so that evaluators written in any language can read
it; the generated JSON Schema and AsyncAPI documents under `proto/` are the contract for them.
Field names are part of the contract: renaming one is a major schema change.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, Struct, field

SCHEMA_VERSION = "1.0"

# Every field is bounded (values, string lengths, list lengths) so that no message can grow the
# state of a receiver beyond what its sender is allowed to send; the codec caps whole messages.
MAX_INT = 2**53
"""the largest integer every JSON reader represents exactly (and far inside int64)"""
MAX_VERSION = 2**31 - 1
MAX_VERSION_STEP = 16
"""the largest step from one published version to the next a receiver accepts: the trainer
steps by one, and a trainer restarted inside an XCCL upload window skips a few at most"""
MAX_LOADED = 256
"""versions one replica may report as loaded (far above any keep window)"""
MAX_ITEMS = 1 << 20
"""list length bound for tokens, logprobs and tensors (the 1 MiB message cap binds first)"""

NonNegInt = Annotated[int, Meta(ge=0, le=MAX_INT)]
PosInt = Annotated[int, Meta(ge=1, le=MAX_INT)]
Version = Annotated[int, Meta(ge=0, le=MAX_VERSION, description="adapter version N of `{lora_name}-v{N}`")]
Short = Annotated[str, Meta(max_length=256)]
Text = Annotated[str, Meta(max_length=2000)]
Uri = Annotated[str, Meta(max_length=2048)]
# `(?!\n)`: Python's `$` (msgspec) also matches before a final newline, ECMA's (JSON Schema
# readers) does not; with it both accept exactly the same strings
Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$(?!\n)", description="subject-safe token")]
Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$(?!\n)")]
GrantId = Annotated[str, Meta(max_length=128, description="opaque, unguessable admission grant")]
UnixTime = Annotated[float, Meta(ge=0, le=1e11, description="seconds since the epoch")]
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

    max_bytes: ClassVar[int] = 4096
    """the largest encoded size a receiver decodes (`proto.codec.decode` refuses more)"""

    schema_version: Annotated[str, Meta(max_length=16)] = SCHEMA_VERSION


# --- adapter versions ------------------------------------------------------------------------


class LoraSpec(Struct, kw_only=True):
    """How the adapter was built; a receiver needs this to allocate or validate slots."""

    peft_type: Literal["lora"] = "lora"
    rank: PosInt
    alpha: float
    target_modules: Annotated[list[Short], Meta(max_length=1024)]
    dtype: Dtype = "float32"
    base_model: Annotated[str, Meta(max_length=512)]


class TensorSpec(Struct, array_like=False):
    name: Short
    shape: Annotated[list[NonNegInt], Meta(max_length=8)]
    dtype: Dtype


class ObjectPayload(Struct, tag="object", tag_field="kind", kw_only=True):
    """The durable copy: a safetensors file (plus adapter_config.json) under `uri`."""

    uri: Annotated[str, Meta(pattern=r"^(s3|file)://.+", max_length=2048)]
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
    master_address: Short
    master_port: Annotated[int, Meta(ge=1, le=65535)]
    world_size: Annotated[int, Meta(ge=1, le=65536)]
    group_name: Short
    tensors: Annotated[list[TensorSpec], Meta(max_length=MAX_ITEMS)]
    bucket_bytes: PosInt
    ranks: Annotated[dict[Name, PosInt], Meta(max_length=4096)] = field(default_factory=dict)
    """replica id -> rank in the group; a replica not listed falls back to the object copy"""


Payload = ObjectPayload | XcclPayload


class CanarySequence(Struct, kw_only=True):
    """One fixed prompt and the trainer's greedy continuation of it under the version, with the
    log-probability of each continuation token (temperature 1, the serving dtype)."""

    prompt_token_ids: Annotated[list[NonNegInt], Meta(min_length=1, max_length=512)]
    token_ids: Annotated[list[NonNegInt], Meta(min_length=1, max_length=128)]
    logprobs: Annotated[list[Annotated[float, Meta(le=0.0)]], Meta(min_length=1, max_length=128)]

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"canary: token_ids ({len(self.token_ids)}) and logprobs ({len(self.logprobs)}) must have one "
                "entry per continuation token"
            )


class Canary(Struct, kw_only=True):
    """What a replica checks a loaded version against before serving it (`services.rollout.canary`)."""

    dtype: Dtype
    """the dtype the trainer computed in: the tolerance is the dtype's"""
    sequences: Annotated[list[CanarySequence], Meta(min_length=1, max_length=16)]


class AdapterReady(Message, kw_only=True):
    """`lorabus.<run>.adapter.v<N>.ready`: trainer -> everyone."""

    max_bytes: ClassVar[int] = 1024 * 1024

    run: Name
    trainer_epoch: Name
    """the trainer lineage that made this version: drawn once per run by the trainer, kept
    across its restarts; a receiver follows one epoch and refuses events of any other"""
    lora_name: Name
    version: Version
    parent_version: Version | None = None
    trainer_step: NonNegInt
    created_at: UnixTime
    lora: LoraSpec
    payloads: Annotated[list[Payload], Meta(max_length=2)]
    canary: Canary | None = None
    """the version's canary carried on the event itself: from trainers that predate
    `canary_follows`; None from those and from trainers older still (a version with neither is
    served unchecked)"""
    canary_follows: bool = False
    """the version's canary comes as its own message after this event (`AdapterCanary` on
    `lorabus.<run>.canary.v<N>`): the trainer announces without waiting for it, and a replica
    holds the version's output until it arrived and passed (or withdraws the version)"""

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


class AdapterCanary(Message, kw_only=True):
    """`lorabus.<run>.canary.v<N>`: trainer -> rollouts. The canary of the version an
    AdapterReady with `canary_follows` announced, published once the trainer computed it (after
    the event). A replica checks it against the event before scoring: same run, trainer epoch
    and version, and the same adapter sha256 (when the event names one), so that a canary of
    other weights never vouches for these."""

    max_bytes: ClassVar[int] = 256 * 1024
    """16 sequences of 512 prompt and 128 continuation tokens at the widest numbers: ~230 KB"""

    run: Name
    trainer_epoch: Name
    version: Version
    adapter_sha256: Sha256 | None = None
    """the event's object payload sha256; None when the event named none (an XCCL event sent
    before its durable copy was hashed)"""
    canary: Canary
    created_at: UnixTime


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
    canary_seconds: Annotated[float, Meta(ge=0)] | None = None
    """how long this load's canary took (part of load_seconds); None: the event carried none"""


class AdapterUnloaded(Message, tag="unloaded", tag_field="kind", kw_only=True):
    max_bytes: ClassVar[int] = 8 * 1024
    run: Name
    replica: Name
    version: Version
    reason: Text
    unloaded_at: UnixTime


class AdapterFailed(Message, tag="failed", tag_field="kind", kw_only=True):
    max_bytes: ClassVar[int] = 8 * 1024
    run: Name
    replica: Name
    version: Version
    reason: Text
    attempt: PosInt
    will_retry: bool
    failed_at: UnixTime


class ReplicaHeartbeat(Message, tag="heartbeat", tag_field="kind", kw_only=True):
    """Sent periodically; the registry marks a replica gone when heartbeats stop."""

    max_bytes: ClassVar[int] = 16 * 1024

    run: Name
    replica: Name
    engine: EngineKind
    loaded_versions: Annotated[list[Version], Meta(max_length=MAX_LOADED)]
    in_flight: NonNegInt
    sent_at: UnixTime
    started_at: UnixTime | None = None
    """when this replica's process started: a later value than the registry has seen for the
    replica means it restarted, and the grants of the process before it are freed at once (its
    groups will never be reported); None from senders that predate it"""
    incarnation: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{8,64}$(?!\n)")] | None = None
    """drawn at random once per process: an incarnation the registry has not seen for the
    replica is a new process, whose first heartbeat frees every grant not issued to it (admission
    requests name their process by `started_at`) whatever the clocks say; a heartbeat of an
    incarnation it has replaced is a dead process's late message and changes nothing. None from
    senders that predate it (then `started_at` alone tells a restart)"""


RolloutReport = AdapterLoaded | AdapterUnloaded | AdapterFailed | ReplicaHeartbeat


# --- admission (request/reply) ---------------------------------------------------------------


class AdmissionRequest(Message, kw_only=True):
    """A rollout asks to generate one group (one prompt, `group_size` completions)."""

    max_bytes: ClassVar[int] = 8 * 1024

    run: Name
    replica: Name
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    loaded_versions: Annotated[list[Version], Meta(max_length=MAX_LOADED)] = field(default_factory=list)
    started_at: UnixTime | None = None
    """the replica's process start, as in ReplicaHeartbeat"""


class AdmissionGrant(Message, tag="grant", tag_field="kind", kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    grant_id: GrantId
    version: Version
    """the version the rollout must generate with"""
    lease_expires_at: UnixTime
    run: Name | None = None
    """the run the grant is for: set on a fleet admission (the registry picked the run), None
    on a run's own admission subject (the run is the subject's)"""


class AdmissionDeny(Message, tag="deny", tag_field="kind", kw_only=True):
    request_id: Annotated[str, Meta(max_length=128)]
    reason: Text
    retry_after_s: Annotated[float, Meta(ge=0)]


AdmissionReply = AdmissionGrant | AdmissionDeny


class FleetAdmissionRequest(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.admission`: a replica asks for one group of work for whichever
    run of the fleet the registry picks (the weighted fair share, `services.common.share`)."""

    max_bytes: ClassVar[int] = 16 * 1024

    fleet: Name
    replica: Name
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    loaded: Annotated[dict[Name, Annotated[list[Version], Meta(max_length=MAX_LOADED)]], Meta(max_length=256)] = field(
        default_factory=dict
    )
    """run -> the versions of that run this replica has loaded"""
    started_at: UnixTime | None = None
    """the replica's process start, as in ReplicaHeartbeat"""


# --- trajectories ----------------------------------------------------------------------------


class TokenRange(Struct, kw_only=True):
    """Which policy generated tokens `[start, end)` of a completion, as the replica that served
    it knows it: the version, the sha256 of the adapter bytes its loader handed the engine
    (hashed by the loader from those bytes, never copied from the event), and the engine."""

    start: NonNegInt
    end: NonNegInt
    version: Version
    adapter_sha256: Sha256 | None
    """None: the version arrived as tensors by XCCL broadcast, with no bytes to hash"""
    engine: EngineKind
    engine_id: Short
    """the engine instance: the replica's id (embedded) or its servers' URLs"""


class Completion(Struct, kw_only=True):
    """One sampled completion. `logprobs` and `versions` are per completion token: the
    behaviour log-probability and the adapter version that produced that token. `ranges`
    covers the tokens in order, one range per run of one version; empty from senders that
    predate it."""

    token_ids: Annotated[list[NonNegInt], Meta(max_length=MAX_ITEMS)]
    logprobs: Annotated[list[float], Meta(max_length=MAX_ITEMS)]
    versions: Annotated[list[Version], Meta(max_length=MAX_ITEMS)]
    reward: float
    finish_reason: FinishReason = "stop"
    ranges: Annotated[list[TokenRange], Meta(max_length=64)] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"completion: token_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have one entry per generated token"
            )
        if self.ranges:
            self._check_ranges(n)

    def _check_ranges(self, n: int) -> None:
        at = 0
        for i, r in enumerate(self.ranges):
            if r.start != at or r.end <= r.start:
                raise ValueError(
                    f"ranges[{i}]: [{r.start}, {r.end}) does not continue at token {at}; "
                    "ranges cover the tokens in order, each non-empty"
                )
            if any(v != r.version for v in self.versions[r.start : r.end]):
                raise ValueError(f"ranges[{i}]: version {r.version} is not the version of each of its tokens")
            at = r.end
        if at != n:
            raise ValueError(f"ranges: cover {at} of {n} tokens; every generated token needs its range")


class Trajectory(Message, kw_only=True):
    """`lorabus.<run>.trajectory.<replica>`: one prompt and its group of completions (the unit
    GRPO normalises advantages over, and the unit of admission)."""

    max_bytes: ClassVar[int] = 1024 * 1024

    run: Name
    trajectory_id: Annotated[str, Meta(min_length=1, max_length=128)]
    grant_id: GrantId
    replica: Name
    prompt_id: Short
    prompt_token_ids: Annotated[list[NonNegInt], Meta(max_length=MAX_ITEMS)]
    completions: Annotated[list[Completion], Meta(max_length=4096)]
    started_at: UnixTime
    finished_at: UnixTime

    def __post_init__(self) -> None:
        if not self.completions:
            raise ValueError("completions: a trajectory needs at least one completion")
        if not any(c.versions for c in self.completions):
            raise ValueError("completions: no completion has a generated token")
        named = [bool(c.ranges) for c in self.completions if c.token_ids]
        if any(named) and not all(named):
            raise ValueError(
                f"completions: {named.count(False)} of {len(named)} completions name no token ranges; "
                "a sender that names the policy names it for every generated token"
            )

    def oldest_version(self) -> int:
        """The version that counts for off-policyness: the oldest token's."""
        return min(min(c.versions) for c in self.completions if c.versions)


class TrajectoryDecision(Message, kw_only=True):
    """`lorabus.<run>.decision.<replica>`: the registry's verdict on one trajectory."""

    max_bytes: ClassVar[int] = 8 * 1024

    run: Name
    trajectory_id: Annotated[str, Meta(max_length=128)]
    grant_id: GrantId
    replica: Name
    verdict: Verdict
    reason: Text = ""
    head_version: Version
    oldest_version: Version | None = None
    decided_at: UnixTime


# --- exporter, evaluators, trainer progress, dead letters -----------------------------------


class ExportDone(Message, kw_only=True):
    """`lorabus.<run>.export.v<N>.done`: a PEFT directory for version N exists at `uri`."""

    max_bytes: ClassVar[int] = 8 * 1024

    run: Name
    lora_name: Name
    version: Version
    uri: Uri
    files: Annotated[list[Short], Meta(max_length=16)]
    bytes: NonNegInt
    sha256: Sha256
    """of adapter_model.safetensors"""
    exported_at: UnixTime


class EvalResult(Message, kw_only=True):
    """`lorabus.<run>.eval.<evaluator>`: an outside evaluator's score for one version."""

    run: Name
    evaluator: Name
    version: Version
    metric: Short
    score: float
    n: NonNegInt
    evaluated_at: UnixTime


Finite = Annotated[float, Meta(ge=0, le=1e30)]


class MismatchFigures(Struct, kw_only=True):
    """Per-token figures over some tokens: r = log pi_trainer - log pi_behave for each, |r| and
    the k3 estimate exp(r) - 1 - r of KL(pi_behave || pi_trainer) (`services.trainer.mismatch`)."""

    tokens: NonNegInt
    kl_mean: Finite
    kl_max: Finite
    abs_mean: Finite
    """mean |delta logprob|"""
    abs_max: Finite


class Mismatch(Struct, kw_only=True):
    """The train/inference mismatch of one step's batch: behaviour logprobs (the rollout's)
    against the trainer's recomputed ones, before the update."""

    estimator: Literal["k3"] = "k3"
    on_policy: MismatchFigures | None = None
    """tokens generated by the version the trainer held (the step's parent version): the pure
    train/inference gap of that version; None when the batch had none"""
    all_tokens: MismatchFigures
    """every token trained; tokens of older versions include the policy's drift since"""
    refused_groups: NonNegInt = 0
    """groups refused beyond actor.max_train_infer_kl (dead-lettered, not trained)"""


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
    trained_at: UnixTime | None = None
    """when the step's update ended, before its canary and its publication: a version's time to
    servable on a replica is that replica's AdapterLoaded.loaded_at minus this"""
    canary_seconds: Annotated[float, Meta(ge=0)] | None = None
    """how long the version's canary took in the trainer; None: no canary computed"""
    canary_wait_seconds: Annotated[float, Meta(ge=0)] | None = None
    """how long the version's announcement waited for it: the trainer's part of its time to
    servable. 0 where the canary follows the event (a one-process trainer computes it beside the
    upload or broadcast and the announcement); its compute where it came before the event (over
    several ranks, in the step; trainers that embedded it in the event overlapped what they
    could)"""
    mismatch: Mismatch | None = None
    """the train/inference mismatch of the step's batch; None from trainers that predate it"""


class DeadLetter(Message, kw_only=True):
    """`lorabus.<run>.deadletter.<service>`: a message a service could not use, and why."""

    max_bytes: ClassVar[int] = 1024 * 1024

    run: Name
    service: Name
    subject: Short
    reason: DeadLetterReason
    error: Annotated[str, Meta(max_length=4000)]
    raw: Annotated[bytes, Meta(max_length=64 * 1024)]
    """the original bytes (base64 in JSON), truncated to 64 KiB"""
    received_at: UnixTime


# --- the fleet's runs (request/reply, and the run table) ------------------------------------

RunStateName = Literal["active", "stopping", "stopped", "finished"]


class RunSubmit(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.run.submit`: add a run to a running fleet."""

    max_bytes: ClassVar[int] = 64 * 1024

    fleet: Name
    run: Name
    config: dict[str, Any]
    """the run file as written: lorabus config keys a run may set (`services.config.runconfig`),
    laid over the fleet's config and validated by the registry with the config loader's rules"""


class RunStop(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.run.stop`: stop granting work to a run, let its grants finish,
    keep its published versions and exports."""

    fleet: Name
    run: Name
    reason: Text = ""


class RunResume(Message, kw_only=True):
    """`lorabus.<fleet>.fleet.run.resume`: serve a stopped run again, from its last checkpoint,
    under its own name (its streams, ledger and versions are where it left them)."""

    fleet: Name
    run: Name


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
    reason: Text = ""
    """why it stopped or finished: the stop request's reason (`failed in <service>: ...` when a
    service stopped it for a fault of its own, `services.common.run_faults`)"""
    adapter_memory_bytes: NonNegInt | None = None
    """trainer memory its adapter holds by the fleet quota's arithmetic (fp32 LoRA parameters,
    gradients, optimizer moments: `services.common.adapter_memory`); null when the fleet sets no
    fleet.max_adapter_memory_gib"""


class RunReply(Message, kw_only=True):
    """The registry's answer to RunSubmit, RunStop, RunResume and RunList. `problems` are the config
    loader's `field: value, problem; fix` lines (or why the request was refused)."""

    max_bytes: ClassVar[int] = 256 * 1024

    fleet: Name
    ok: bool
    problems: Annotated[list[Text], Meta(max_length=256)] = field(default_factory=list)
    runs: Annotated[list[RunInfo], Meta(max_length=1024)] = field(default_factory=list)


class RunRecord(Message, kw_only=True):
    """One run in the fleet's run table (KV bucket `lorabus_<fleet>_runs`, key = run): what
    every service of the fleet watches to start and stop serving the run. Only the registry
    writes it."""

    max_bytes: ClassVar[int] = 64 * 1024

    fleet: Name
    run: Name
    state: RunStateName
    share: Annotated[float, Meta(gt=0)]
    config: dict[str, Any]
    """the run's whole validated config without the fleet's connection sections (bus, store,
    metrics), which every service takes from its own config"""
    submitted_at: UnixTime
    changed_at: UnixTime
    reason: Text = ""


TOP_LEVEL: tuple[type, ...] = (
    AdapterReady,
    AdapterCanary,
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
    RunResume,
    RunList,
    RunReply,
    RunRecord,
)

__all__ = [name for name in dir() if not name.startswith("_") and name not in {"msgspec"}]
