"""The typed shape of a lorabus config file (AReaL-style YAML).

Only the shape and defaults live here; loading and `${a.b}` interpolation are in
`services.config.loader`, the cross-field validation rules in `services.config.rules`. Every
service reads the same file and uses the sections it needs, so one YAML describes a whole run.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct, field

from services.common.lora_targets import Backend


class Section(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class BusConfig(Section):
    url: str = "nats://127.0.0.1:4222"
    """one server, or every node of a cluster comma-separated (`nats://a:4222,nats://b:4222`)"""
    stream_replicas: int = 1
    """copies of each JetStream stream: 3 on a three-node cluster (one node may be lost)"""
    user: str | None = None
    password: str | None = None
    """prefer `password_env`: the name of an environment variable holding it"""
    password_env: str | None = None
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout_s: float = 5.0
    max_reconnect_attempts: int = -1
    """-1: retry forever, with backoff"""


class StoreConfig(Section):
    uri: str = "file://./runs/store"
    """`file:///abs/dir` (one machine) or `s3://bucket/prefix` (MinIO/S3)"""
    endpoint: str | None = None
    """S3 endpoint `host:port`; required for s3://"""
    access_key_env: str = "LORABUS_S3_ACCESS_KEY"
    secret_key_env: str = "LORABUS_S3_SECRET_KEY"
    secure: bool = False
    region: str | None = None
    max_object_bytes: int = 8 * 1024**3
    """the most bytes a reader fetches for one object (an adapter); an event naming a larger
    size is refused before anything is read"""


class MetricsConfig(Section):
    host: str = "0.0.0.0"
    port: int = 0
    """0: pick a free port (logged at start); set one per service in deployments"""


class GenerationConfig(Section):
    """AReaL's `gconfig`."""

    n_samples: int = 4
    """completions per prompt: the GRPO group size"""
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    lora_name: str = "default_lora"
    """single source of truth for the adapter's name; versions are `{lora_name}-v{N}`"""


class OptimizerConfig(Section):
    type: Literal["adam", "adamw", "sgd"] = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gradient_clipping: float = 1.0
    warmup_steps: int | None = None
    """warm-up length in optimiser steps; when unset, `warmup_steps_proportion` decides"""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """AReaL's schedules over `total_train_steps` (see `services/trainer/schedule.py`)"""
    warmup_steps_proportion: float = 0.001
    """warm-up as a share of `total_train_steps` (AReaL's default), ignored when `warmup_steps`
    is set; the LR rises linearly from 0 (cosine: from `min_lr_ratio`)"""
    min_lr_ratio: float = 0.0
    """cosine only: the LR at the end of the run, as a share of `lr` (AReaL's meaning)"""


class PPOConfig(Section):
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    behav_imp_weight_cap: float | None = 5.0
    """cap on pi_prox/pi_behave; tokens above it are masked (AReaL's default); null: uncapped"""
    behav_imp_weight_mode: Literal["mask", "clamp", "none"] = "mask"
    """above the cap a token is masked or its weight clamped to the cap; none: the decoupled loss
    has no pi_prox/pi_behave weight at all (AReaL without `rejection_sampling`, its default)"""
    use_decoupled_loss: bool = True
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """the ratio pi_theta/pi_prox that is clipped: per token, or per completion (GSPO: the
    geometric mean of its tokens' ratios, with the mean of their advantages), as AReaL's"""
    use_sapo_loss: bool = False
    """SAPO: a soft sigmoid gate on the ratio instead of PPO's clip (AReaL's use_sapo_loss); needs
    use_decoupled_loss false, as AReaL's"""
    sapo_tau_pos: float = 1.0
    """the gate's temperature where the advantage is positive (larger: it closes sooner)"""
    sapo_tau_neg: float = 1.05
    """the gate's temperature where the advantage is negative or zero"""
    kl_ctl: float = 0.0
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_norm: bool = True
    """centre the shaped rewards (within each group or over the batch: group_adv_norm) before
    they become advantages; false: each completion's shaped reward is its advantage as it is, as
    AReaL's `reward_norm: null` has it (with batch_adv_norm, a batch-mean baseline: REINFORCE)"""
    group_adv_norm: bool = True
    """centre each reward within its group (GRPO); false: over the whole batch"""
    adv_norm_std: bool = True
    """then divide by the std at the same level (unbiased)"""
    batch_std: bool = False
    """with group_adv_norm and adv_norm_std: divide by the std of the whole batch's centred
    rewards, not each group's (LitePPO; AReaL's reward_norm std_level: batch beside mean_level: group)"""
    leave_one_out: bool = False
    """centre each reward on the mean of the others of its group (or batch), not on the mean of
    all: RLOO (AReaL's reward_norm mean_leave1out)"""
    ppo_n_minibatches: int = 1
    token_level_loss: bool = True
    reward_clip: float | None = None
    """clip shaped rewards to [-reward_clip, reward_clip] (AReaL's default is 20)"""
    batch_adv_norm: bool = False
    """after the group step, normalise advantages over the whole batch's completion tokens
    (AReaL's `adv_norm` with mean_level/std_level batch)"""
    batch_adv_norm_std: bool = True
    """with batch_adv_norm: divide by the batch std too (false: centre only)"""
    norm_eps: float = 1e-6
    """added to every std before dividing (AReaL's NormConfig.eps is 1e-5)"""
    overlong_tokens: int | None = None
    """DAPO's soft overlong penalty: a completion within the last `overlong_tokens` before
    `overlong_max_tokens` loses reward linearly, up to `overlong_penalty_factor` at the end
    (AReaL's overlong_reward_penalty); null: no penalty"""
    overlong_penalty_factor: float = 1.0
    """the reward a completion of `overlong_max_tokens` tokens loses"""
    overlong_max_tokens: int | None = None
    """the length the penalty window ends at (AReaL's actor.max_new_tokens); null: gconfig.max_new_tokens"""


class MegatronConfig(Section):
    bridge_type: Literal["megatron-bridge", "mbridge", "none"] = "none"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    gradient_accumulation_fusion: bool = False


class ActorConfig(Section):
    path: str = ""
    """HF model id or local directory of the base model"""
    tokenizer_path: str | None = None
    backend: Backend = "fsdp2"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    """auto: cuda if available, else cpu"""
    use_lora: bool = True
    peft_type: str = "lora"
    lora_rank: int = 32
    lora_alpha: float = 16.0
    target_modules: list[str] = field(default_factory=list)
    """empty or ["all-linear"]: every linear layer of the backend"""
    weight_update_mode: Literal["disk", "xccl"] = "disk"
    xccl_backend: Literal["auto", "gloo", "nccl"] = "auto"
    xccl_bucket_mb: float = 64.0
    xccl_timeout_s: float = 30.0
    xccl_master_address: str = "127.0.0.1"
    xccl_master_port: int = 0
    mb_spec_max_tokens: int = 4096
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint_dir: str = "${run_dir}/checkpoints"
    checkpoint_every: int = 1
    seed: int = 1
    nproc_per_node: int = 1
    """trainer processes on this host; > 1 runs the trainer under torchrun (`lorabus up`)"""
    disable_dropout: bool = False
    """train with every dropout of the base model off (AReaL's name; LoRA's own dropout is
    always 0): a model whose config sets attention or hidden dropout trains deterministically"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward pass instead of keeping
    them (AReaL's name): activation memory of one layer instead of all, for about a third
    more compute"""
    max_train_infer_kl: float | None = None
    """refuse (dead-letter, never train) a group whose mean per-token KL between its behaviour
    logprobs and the trainer's exceeds this (k3 estimator, services/trainer/mismatch.py); the
    trainer's logprobs are its current weights', so tokens of older versions carry the policy's
    drift since too; null: measure and report, refuse nothing"""


class RolloutConfig(Section):
    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    use_lora: bool = True
    lora_name: str = ""
    """back-filled from gconfig.lora_name when empty; must equal it otherwise"""
    max_head_offpolicyness: int = 2
    consumer_batch_size: int = 8
    """groups per trainer step (B)"""
    max_concurrent_rollouts: int | None = None
    """defaults to consumer_batch_size"""
    lora_keep_versions: int | None = None
    """versions kept loaded; defaults to max_head_offpolicyness + 1"""
    lease_seconds: float = 60.0
    """a grant not finished within this is presumed dead and its capacity freed"""
    replicas: int = 2
    """how many rollout processes `lorabus up` starts"""
    batch_groups: int = 2
    """groups a replica generates in one engine batch"""
    device: str = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    server_urls: list[str] = field(default_factory=list)
    """vllm/sglang: every data-parallel replica's base URL"""
    adapter_dir: str = "${run_dir}/adapters"
    """where the sidecar writes adapters for the server to read"""
    server_adapter_dir: str | None = None
    """the same directory as the server sees it (shared volume); defaults to adapter_dir"""
    preload_v0: bool = True
    """vllm/sglang: auto-fill `{lora_name}-v0` into vllm.lora_modules / sglang.lora_paths, so the
    server starts serving v0 (AReaL's way; its directory must exist before the server starts,
    as the compose file's wait loop ensures). false: the server starts without adapters and the
    sidecar loads v0 at runtime like every later version (what `lorabus up` does)"""
    request_timeout_s: float = 120.0
    heartbeat_s: float = 2.0
    canary_wait_s: float = 60.0
    """how long a replica's check of a version whose canary follows its event (the trainer
    publishes it once computed, `AdapterCanary`) waits for that canary; the version serves
    meanwhile and its output is held. A canary that does not come within it withdraws the
    version on the replica, as a failed canary does (a trainer that died between the two
    publishes it when it re-announces the version at restart, if it is back within it; one that
    resumed from an older checkpoint announces a later version at an earlier step instead, and
    that event ends the wait at once)"""
    cuda_graphs: bool = True
    """embedded engine on CUDA: decode on a static KV cache with CUDA graphs (false: eager)"""
    slab_rows: int = 0
    """embedded engine: continuous batching over a slab of this many rows (groups join as rows
    free up, and the work loop keeps `batch_groups` groups in flight); 0: each engine batch is
    decoded on its own and waits for its longest row"""
    slab_length: int = 2048
    """with slab_rows: the most tokens (prompt + new tokens) one row holds"""
    prefill_chunk: int = 512
    """with slab_rows: a prompt longer than this is prefilled this many tokens at a time, with
    decode steps of the other rows in between (a long prompt never stalls them for its whole
    prefill); 0: every prompt in one forward"""
    merge_head: bool = True
    """embedded engine: serve the newest version merged into the base weights (the fast path;
    rounded once in the serving dtype); false: every version stays a separate LoRA product, as
    the trainer computes it (the native baseline of the train/inference mismatch)"""

    # Derived values are properties, not back-filled copies: a section built by hand (tests,
    # benchmarks) must give the same answer as one that went through the loader.
    @property
    def keep_versions(self) -> int:
        """Versions kept loaded: lora_keep_versions, or max_head_offpolicyness + 1 when unset."""
        if self.lora_keep_versions is not None:
            return self.lora_keep_versions
        return self.max_head_offpolicyness + 1

    @property
    def continuous(self) -> bool:
        """Whether the engine batches groups as they come (the embedded engine with a slab)."""
        return self.engine == "embedded" and self.slab_rows > 0

    @property
    def max_concurrent(self) -> int:
        """Rollouts admitted at once: max_concurrent_rollouts, or consumer_batch_size when unset."""
        if self.max_concurrent_rollouts is not None:
            return self.max_concurrent_rollouts
        return self.consumer_batch_size


class VllmConfig(Section):
    enable_lora: bool = True
    max_lora_rank: int = 16
    max_loras: int = 8
    max_cpu_loras: int | None = None
    lora_modules: list[str] = field(default_factory=list)
    """`name=path` entries; `{lora_name}-v0` is auto-filled"""
    model: str = "${actor.path}"
    dtype: str = "auto"
    max_model_len: int | None = None
    extra_args: list[str] = field(default_factory=list)


class SglangConfig(Section):
    enable_lora: bool = True
    max_lora_rank: int = 16
    max_loaded_loras: int = 8
    max_loras_per_batch: int = 8
    lora_backend: Literal["csgmv", "triton", "triton_v2", "torch_native"] = "triton"
    lora_paths: list[str] = field(default_factory=list)
    """`name=path` entries; `{lora_name}-v0` is auto-filled"""
    lora_target_modules: list[str] = field(default_factory=list)
    model_path: str = "${actor.path}"
    extra_args: list[str] = field(default_factory=list)


class DatasetConfig(Section):
    path: str = ""
    """JSONL with `prompt` and `answer` fields, or `builtin:<task>` for a shipped task"""
    type: Literal["rl", "sft"] = "rl"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    reward_fn: str = ""
    """`package.module:function` taking (prompt, completion, answer) -> float"""
    max_prompts: int | None = None
    shuffle: bool = True
    split: str = "train"
    """Hugging Face datasets (hub id or saved directory): the split to read"""
    config_name: str | None = None
    """Hugging Face hub datasets: the configuration (e.g. `main` for openai/gsm8k)"""
    instruction: str = ""
    """appended to each prompt's text (AReaL's GSM8K prompt adds
    "\\nPlease put your final answer within \\boxed{}.")"""
    chat_template: bool = False
    """send the prompt as one user message through the tokenizer's chat template, with the
    generation prompt and no thinking block (AReaL's RLVR workflow); false: the text as is"""
    max_length: int | None = None
    """drop prompts whose text (instruction included, before the chat template) is longer than
    this many tokens, as AReaL's `max_length` does; null: keep every prompt"""
    tokenizer_path: str | None = None
    """the tokenizer for chat_template and max_length; unset: actor.tokenizer_path or actor.path"""


class ExporterConfig(Section):
    uri: str = "file://${run_dir}/export"
    """`file:///dir` or `s3://bucket/prefix`; versions land in `<uri>/v<N>/`"""


class EvaluatorConfig(Section):
    """The held-out evaluator that `lorabus up` starts (`lorabus evaluate`)."""

    device: str = "auto"
    """where the base model runs: auto (cuda when present, else cpu), cpu or cuda[:N]"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: rollout.dtype"""
    batch_size: int = 64
    """prompts per greedy `generate` call"""
    max_prompts: int | None = None
    """score on the first N held-out prompts of valid_dataset (null: all of them)"""
    versions: Literal["every", "every_nth", "newest"] = "every"
    """which exported versions to score: every one; every `nth` (v0, vN, v2N, ..., and the
    last); or, when it falls behind, only the newest exported so far (the last always)"""
    nth: int = 5
    """versions: every_nth: score versions that are multiples of this"""
    score: str = "services.clients.evaluate:heldout_reward"
    """the scoring hook, `package.module:function` taking (model, tokenizer, prompts, cfg)"""
    max_wait_s: float = 120.0
    """`lorabus up`: once training has ended and the last version is exported, wait at most this
    long for scores still missing, then stop with the scores it has"""


StepTogether = Literal["auto", "always", "never"]


class FleetConfig(Section):
    """Many runs on one fleet (docs/multi-run.md). `share` is a run's own; the rest is the fleet's."""

    share: float = 1.0
    """this run's weight in the fleet's fair share of rollout concurrency"""
    max_runs: int = 8
    """runs the fleet serves at once (active or stopping); a submit beyond it is refused"""
    max_concurrent_rollouts: int | None = None
    """groups in flight over all runs together; unset: each run's own max_concurrent_rollouts
    is the only bound, and the share decides who gets a replica that asks for work"""
    lora_slots: int | None = None
    """adapter versions an embedded rollout engine holds over all runs (each run needs its
    rollout.keep_versions + 1); unset: room for this config's own run only. vLLM and SGLang
    servers count theirs in vllm.max_cpu_loras and sglang.max_loaded_loras"""
    max_lora_rank: int | None = None
    """the largest rank a run of this fleet may have on an embedded rollout engine (its slots
    have this rank; a run of lower rank is zero-padded, which changes no output); unset: this
    config's actor.lora_rank. vLLM and SGLang servers: vllm/sglang.max_lora_rank"""
    max_adapter_memory_gib: float | None = None
    """trainer memory the live runs' adapters may hold together, in GiB: per run its fp32 LoRA
    parameters (rank x (in + out) per targeted linear layer x layers, sized from the base
    model's config.json), their gradients and the optimizer's moments (two for adam/adamw); a
    submit or resume beyond it is refused. Unset: unbounded"""
    step_together: StepTogether = "auto"
    """whether the runs holding a batch at the same moment train in one joint step on the
    trainer's shared base (one forward and backward over all their rows, each run's update its
    own solo step's): `auto` where the trainer runs on an accelerator, where a small step is
    launch-bound and a larger batch costs little more (on a CPU it is slower per row: 0.85x at 8
    runs, benchmarks/joint_step.py); `always`; `never` (each run steps alone, in fair-share order)"""


class LorabusConfig(Section):
    experiment_name: str = "lorabus"
    trial_name: str = "trial0"
    run: str = "${experiment_name}-${trial_name}"
    """the run id in every subject"""
    run_dir: str = "./runs/${run}"
    seed: int = 1
    total_train_steps: int = 10
    """the run's length in trainer steps (with total_train_epochs: the most it may be)"""
    total_train_epochs: int | None = None
    """the run's length in passes over train_dataset (AReaL's way): when a service loads the
    config it reads the dataset and sets total_train_steps = epochs x (prompts //
    rollout.consumer_batch_size), or the total_train_steps written where that is smaller;
    `lorabus config translate` reads no data and keeps the epochs"""
    bus: BusConfig = field(default_factory=BusConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    sglang: SglangConfig = field(default_factory=SglangConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
