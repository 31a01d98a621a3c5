"""Config loading, back-fill and validation (services.config.loader)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.lora_targets import for_backend
from services.config import rules as C
from services.config.loader import (
    ConfigError,
    config_from_dict,
    load_config,
    validate,
)
from services.config.schema import LorabusConfig, RolloutConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# The smallest usable config: everything else is a default.
BASE = {
    "actor": {"path": "examples/tiny/model", "lora_rank": 8},
    "train_dataset": {"path": "builtin:arith"},
}


def build(*overrides: str, tree: dict | None = None) -> LorabusConfig:
    return config_from_dict(BASE if tree is None else tree, list(overrides))


def problems_of(*overrides: str, tree: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build(*overrides, tree=tree)
    return info.value.problems


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# --- defaults ---------------------------------------------------------------------------------


def test_defaults_equal_areal():
    cfg = LorabusConfig()
    assert cfg.actor.lora_rank == 32
    assert cfg.actor.lora_alpha == 16
    assert cfg.actor.peft_type == "lora"
    assert cfg.actor.target_modules == []
    assert cfg.actor.weight_update_mode == "disk"
    assert cfg.gconfig.lora_name == "default_lora"
    assert cfg.vllm.max_lora_rank == 16
    assert cfg.vllm.max_loras == 8
    assert cfg.sglang.max_loaded_loras == 8
    assert cfg.sglang.lora_backend == "triton"
    assert for_backend(cfg.actor.target_modules, cfg.actor.backend) == "all-linear"


def test_minimal_config_gets_derived_defaults():
    cfg = build()
    assert cfg.rollout.lora_name == "default_lora"
    assert cfg.rollout.max_concurrent_rollouts == cfg.rollout.consumer_batch_size == 8
    assert cfg.rollout.lora_keep_versions == cfg.rollout.max_head_offpolicyness + 1 == 3
    assert cfg.vllm.max_cpu_loras == max(8, 3 + 1)
    # defaults that are interpolations get resolved too
    assert cfg.run == "lorabus-trial0"
    assert cfg.run_dir == "./runs/lorabus-trial0"
    assert cfg.actor.checkpoint_dir == "./runs/lorabus-trial0/checkpoints"
    assert cfg.vllm.model == cfg.sglang.model_path == "examples/tiny/model"
    # embedded engine: no server flags are filled
    assert cfg.vllm.lora_modules == [] and cfg.sglang.lora_paths == []


# --- interpolation and overrides -----------------------------------------------------------


def test_interpolation_across_sections_keeps_types(tmp_path):
    path = write(
        tmp_path,
        """
experiment_name: exp
trial_name: t1
run_dir: /data/${run}
actor:
  path: m
  lora_rank: 16
  checkpoint_dir: ${run_dir}/ckpt
  optimizer: {lr: 3e-5}
rollout:
  engine: vllm
  use_lora: ${actor.use_lora}
vllm:
  max_lora_rank: ${actor.lora_rank}
train_dataset: {path: builtin:arith}
""",
    )
    cfg = load_config(path)
    assert cfg.run == "exp-t1"
    assert cfg.actor.checkpoint_dir == "/data/exp-t1/ckpt"
    assert cfg.rollout.adapter_dir == "/data/exp-t1/adapters"
    assert cfg.vllm.max_lora_rank == 16 and isinstance(cfg.vllm.max_lora_rank, int)
    assert cfg.actor.optimizer.lr == pytest.approx(3e-5)  # a float, as in AReaL's files


def test_environment_variables_with_default(tmp_path, monkeypatch):
    text = """
actor: {path: m, lora_rank: "${oc.env:LB_TEST_RANK,8}"}
bus: {url: "${oc.env:LB_TEST_NATS,nats://127.0.0.1:4222}"}
train_dataset: {path: builtin:arith}
"""
    monkeypatch.delenv("LB_TEST_RANK", raising=False)
    monkeypatch.delenv("LB_TEST_NATS", raising=False)
    cfg = load_config(write(tmp_path, text))
    assert cfg.actor.lora_rank == 8
    assert cfg.bus.url == "nats://127.0.0.1:4222"
    monkeypatch.setenv("LB_TEST_RANK", "4")
    monkeypatch.setenv("LB_TEST_NATS", "nats://bus:4222")
    cfg = load_config(write(tmp_path, text))
    assert cfg.actor.lora_rank == 4  # env values are strings; they still become ints
    assert cfg.bus.url == "nats://bus:4222"


def test_missing_environment_variable_names_field(tmp_path, monkeypatch):
    monkeypatch.delenv("LB_TEST_UNSET", raising=False)
    path = write(tmp_path, "actor: {path: '${oc.env:LB_TEST_UNSET}'}\ntrain_dataset: {path: x}\n")
    with pytest.raises(ConfigError, match=r"actor\.path: .*LB_TEST_UNSET"):
        load_config(path)


def test_unresolvable_reference_names_field():
    problems = problems_of("run_dir=${nope.key}")
    assert len(problems) == 1
    assert problems[0].startswith("run_dir:") and "nope.key" in problems[0]


def test_overrides_win_over_file_and_reach_interpolations(tmp_path):
    path = write(tmp_path, "experiment_name: a\nactor: {path: m, lora_rank: 8}\ntrain_dataset: {path: x}\n")
    cfg = load_config(
        path,
        overrides=[
            "experiment_name=b",
            "rollout.replicas=3",
            "actor.target_modules=[q_proj,v_proj]",
            "actor.optimizer.lr=1e-3",
        ],
    )
    assert cfg.run == "b-trial0" and cfg.actor.checkpoint_dir == "./runs/b-trial0/checkpoints"
    assert cfg.rollout.replicas == 3
    assert cfg.actor.target_modules == ["q_proj", "v_proj"]
    assert cfg.actor.optimizer.lr == pytest.approx(1e-3)
    assert cfg.actor.lora_rank == 8  # untouched keys of an overridden section survive


@pytest.mark.parametrize("text", ["685e72", "123456", "0123", "true"])
def test_an_override_of_a_string_field_keeps_its_text(text):
    """YAML would type these as numbers or booleans (a run's random trial name can look like
    685e72); a string field takes the text as written, a number field still the number."""
    cfg = build(f"trial_name={text}", "experiment_name=2024", "rollout.replicas=3")
    assert cfg.trial_name == text and cfg.experiment_name == "2024"
    assert cfg.run == f"2024-{text}"
    assert cfg.rollout.replicas == 3


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match=r"'rollout\.replicas' is not key=value"):
        build("rollout.replicas")


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "actor: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level is a list"):
        load_config(write(tmp_path, "- a\n- b\n"))


# --- unknown keys and types ------------------------------------------------------------------


def test_unknown_keys_are_all_reported_with_did_you_mean():
    problems = problems_of("actor.lora_rnk=8", "rollout.replica=3", "sglng.max_lora_rank=8")
    assert len(problems) == 3
    by_field = {p.split(":")[0]: p for p in problems}
    assert "did you mean actor.lora_rank?" in by_field["actor.lora_rnk"]
    assert "did you mean rollout.replicas?" in by_field["rollout.replica"]
    assert "did you mean sglang?" in by_field["sglng"]


def test_unknown_key_without_close_match_lists_known_keys():
    (problem,) = problems_of("gconfig.zzzz=1")
    assert problem.startswith("gconfig.zzzz:") and "known keys: n_samples" in problem


def test_type_errors_name_field_value_and_type():
    problems = problems_of("actor.lora_rank=abc", "total_train_steps=many", "vllm.lora_modules=[1]")
    assert "total_train_steps: 'many' has type str, expected int" in problems
    assert "actor.lora_rank: 'abc' has type str, expected int" in problems
    assert "vllm.lora_modules[0]: 1 has type int, expected str; quote it in YAML" in problems


def test_shape_type_and_rule_problems_come_in_one_pass():
    problems = problems_of(
        "actor.lora_rnk=8",  # shape
        "gconfig=5",  # shape: a scalar where a section belongs
        "actor.optimizer.lr=x",  # type, nested two deep
        "rollout.replicas=two",  # type, another section
        "actor.lora_alpha=-2",  # rule
        "rollout.engine=vlm",  # enum
    )
    fields = [p.split(":")[0] for p in problems]
    for field in ("actor.lora_rnk", "gconfig", "actor.optimizer.lr", "rollout.replicas", "actor.lora_alpha",
                  "rollout.engine"):  # fmt: skip
        assert fields.count(field) == 1, (field, problems)
    # a value already reported does not also break a rule about it (replicas is back at its default)
    assert not any(p.startswith("rollout.replicas") and "must" in p for p in problems)


def test_literal_error_suggests_choice():
    (problem,) = problems_of("rollout.engine=vlm")
    assert problem.startswith("rollout.engine: 'vlm' is not one of 'embedded', 'vllm', 'sglang'")
    assert "did you mean 'vllm'?" in problem


def test_null_value_says_so_and_shows_where_derived_values_came_from():
    problems = problems_of("actor.path=")
    assert "actor.path: None has type null, expected str; give it a value" in problems[0]
    assert any(p.startswith("vllm.model: None (from '${actor.path}')") for p in problems)


def test_scalar_where_section_belongs():
    (problem,) = problems_of("actor=5")
    assert problem.startswith("actor: 5 has type int; it must be a section")


# --- back-fill ------------------------------------------------------------------------------


def test_lora_name_backfill_and_conflict():
    assert build("gconfig.lora_name=math").rollout.lora_name == "math"
    assert build("gconfig.lora_name=math", "rollout.lora_name=math").rollout.lora_name == "math"
    (problem,) = problems_of("gconfig.lora_name=math", "rollout.lora_name=code")
    assert problem.startswith("rollout.lora_name: 'code' differs from gconfig.lora_name: 'math'")


def test_explicit_values_are_not_backfilled():
    cfg = build("rollout.max_concurrent_rollouts=5", "rollout.lora_keep_versions=6", "vllm.max_cpu_loras=9")
    assert cfg.rollout.max_concurrent_rollouts == 5
    assert cfg.rollout.lora_keep_versions == 6
    assert cfg.vllm.max_cpu_loras == 9


def test_max_cpu_loras_default_covers_keep_window_plus_one():
    cfg = build("rollout.engine=vllm", "vllm.max_loras=2", "rollout.max_head_offpolicyness=1")
    assert cfg.rollout.lora_keep_versions == 2
    assert cfg.vllm.max_cpu_loras == 3
    cfg = build("rollout.engine=vllm", "vllm.max_loras=6", "rollout.max_head_offpolicyness=5")
    assert cfg.vllm.max_cpu_loras == 7
    assert build("rollout.engine=vllm").vllm.max_cpu_loras == 8


def test_server_preload_entries_are_filled_for_the_engine_in_use():
    cfg = build("rollout.engine=vllm", "rollout.adapter_dir=/run/ad", "gconfig.lora_name=m")
    assert cfg.vllm.lora_modules == ["m-v0=/run/ad/m-v0"]
    assert cfg.sglang.lora_paths == []
    cfg = build("rollout.engine=sglang", "rollout.server_adapter_dir=/adapters/")
    assert cfg.sglang.lora_paths == ["default_lora-v0=/adapters/default_lora-v0"]
    assert cfg.vllm.lora_modules == []
    given = build("rollout.engine=vllm", "vllm.lora_modules=[default_lora-v0=/elsewhere]")
    assert given.vllm.lora_modules == ["default_lora-v0=/elsewhere"]


# --- engine matrix -------------------------------------------------------------------------

MEGATRON = ("actor.backend=megatron", "actor.megatron.bridge_type=megatron-bridge")


@pytest.mark.parametrize("backend_overrides", [(), MEGATRON])
@pytest.mark.parametrize("engine", ["embedded", "vllm", "sglang"])
@pytest.mark.parametrize("mode", ["disk", "xccl"])
def test_every_engine_cell_loads(backend_overrides, engine, mode):
    cfg = build(*backend_overrides, f"rollout.engine={engine}", f"actor.weight_update_mode={mode}")
    assert (cfg.rollout.engine, cfg.actor.weight_update_mode) == (engine, mode)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_nccl_group_into_a_gpu_less_server_sidecar_says_why_and_what_to_use(engine):
    (problem,) = problems_of(
        f"rollout.engine={engine}",
        "actor.weight_update_mode=xccl",
        "actor.xccl_backend=nccl",
        "rollout.device=cpu",
    )
    assert problem.startswith("actor.xccl_backend: 'nccl' with rollout.engine")
    assert "GPU memory" in problem and "actor.xccl_backend: gloo" in problem


def test_rules_are_pure_functions_of_a_config():
    cfg = build()
    assert C.check_engine_matrix(cfg) == []
    cfg.rollout.engine = "sglang"
    cfg.actor.weight_update_mode = "xccl"
    assert C.check_engine_matrix(cfg) == []
    cfg.actor.xccl_backend, cfg.rollout.device = "nccl", "cpu"
    assert len(C.check_engine_matrix(cfg)) == 1
    assert any("xccl_backend" in p for p in validate(cfg))


# --- one failing case per rule -------------------------------------------------------------

VLLM = ("rollout.engine=vllm",)
SGLANG = ("rollout.engine=sglang",)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        # LoRA itself
        (
            ("actor.peft_type=ia3",),
            "actor.peft_type: 'ia3' is not supported; lorabus trains LoRA only (peft_type: lora)",
        ),
        (("actor.use_lora=false",), "actor.use_lora: false is not supported"),
        (("rollout.use_lora=false",), "rollout.use_lora: False disagrees with actor.use_lora: True"),
        (("actor.lora_rank=0",), "actor.lora_rank: 0 must be >= 1"),
        (("actor.lora_alpha=0",), "actor.lora_alpha: 0.0 must be > 0"),
        (("gconfig.lora_name=my lora",), "gconfig.lora_name: 'my lora' is not a valid subject token"),
        # Megatron
        (("actor.backend=megatron",), "actor.megatron.bridge_type: 'none' cannot train LoRA"),
        (
            (*MEGATRON, "actor.megatron.use_distributed_optimizer=true"),
            "actor.megatron.use_distributed_optimizer: true is not supported with LoRA",
        ),
        (
            (*MEGATRON, "actor.max_train_infer_kl=0.1"),
            "actor.max_train_infer_kl: 0.1 is not applied by the Megatron engine, which reports the "
            "train/inference mismatch but refuses no group (unset it, or use actor.backend: fsdp2",
        ),
        (
            (*MEGATRON, "actor.megatron.gradient_accumulation_fusion=true"),
            "actor.megatron.gradient_accumulation_fusion: true is not supported with LoRA",
        ),
        # target modules
        (
            ("actor.target_modules=[linear_fc1]",),
            "actor.target_modules: 'linear_fc1' is a Megatron module name, but actor.backend fsdp2 wraps HF "
            "modules; use gate_proj, up_proj instead",
        ),
        (
            (*MEGATRON, "actor.target_modules=[o_proj]"),
            "actor.target_modules: 'o_proj' is not a Megatron linear layer for actor.backend megatron; use "
            "'linear_proj'",
        ),
        (
            (*MEGATRON, "actor.target_modules=[linear_qvk]"),
            "actor.target_modules: 'linear_qvk' is not a Megatron linear layer for actor.backend megatron; did you "
            "mean 'linear_qkv'? allowed: linear_qkv, linear_proj, linear_fc1, linear_fc2 or all-linear",
        ),
        (
            ("actor.target_modules=[all-linear,q_proj]",),
            "actor.target_modules: ['all-linear', 'q_proj'] mixes 'all-linear' with explicit names",
        ),
        (("actor.target_modules=['']",), "actor.target_modules: '' is empty"),
        # staleness and batch sizes
        (("rollout.max_head_offpolicyness=-1",), "rollout.max_head_offpolicyness: -1 must be >= 0"),
        (
            ("rollout.max_head_offpolicyness=-1", "rollout.lora_keep_versions=0"),
            "rollout.lora_keep_versions: 0 must be >= 1",
        ),
        (
            ("rollout.lora_keep_versions=2",),
            "rollout.lora_keep_versions: 2 is below max_head_offpolicyness + 1 = 3; every admissible version must "
            "stay loaded",
        ),
        (("rollout.consumer_batch_size=0",), "rollout.consumer_batch_size: 0 must be >= 1"),
        (("rollout.max_concurrent_rollouts=0",), "rollout.max_concurrent_rollouts: 0 must be >= 1"),
        (("gconfig.n_samples=0",), "gconfig.n_samples: 0 must be >= 1"),
        (
            ("gconfig.n_samples=1",),
            "gconfig.n_samples: 1 with actor.ppo.group_adv_norm: true makes every GRPO advantage zero",
        ),
        # reward normalisation settings that another one makes meaningless
        (
            ("actor.ppo.reward_norm=false", "actor.ppo.leave_one_out=true"),
            "actor.ppo.leave_one_out: true with actor.ppo.reward_norm: false, which leaves rewards uncentred",
        ),
        (
            ("actor.ppo.reward_norm=false", "actor.ppo.batch_std=true"),
            "actor.ppo.batch_std: true with actor.ppo.reward_norm: false",
        ),
        (
            ("actor.ppo.batch_std=true", "actor.ppo.adv_norm_std=false"),
            "actor.ppo.batch_std: true has no effect (adv_norm_std is false); set it false",
        ),
        (
            ("actor.ppo.batch_std=true", "actor.ppo.group_adv_norm=false"),
            "actor.ppo.batch_std: true has no effect (group_adv_norm: false already takes the batch's std)",
        ),
        # DAPO's overlong penalty where it could never apply, or would apply to every completion
        (
            ("actor.ppo.overlong_max_tokens=16",),
            "actor.ppo.overlong_max_tokens: 16 has no effect without actor.ppo.overlong_tokens",
        ),
        (("actor.ppo.overlong_tokens=0",), "actor.ppo.overlong_tokens: 0 must be >= 1"),
        (
            ("actor.ppo.overlong_tokens=20",),
            "actor.ppo.overlong_tokens: 20 exceeds overlong_max_tokens 16, so even an empty completion is penalised",
        ),
        (
            ("actor.ppo.overlong_tokens=4", "actor.ppo.overlong_max_tokens=20"),
            "actor.ppo.overlong_max_tokens: 20 less overlong_tokens 4 is not below gconfig.max_new_tokens 16",
        ),
        (
            ("actor.ppo.overlong_tokens=4", "actor.ppo.overlong_penalty_factor=0"),
            "actor.ppo.overlong_penalty_factor: 0.0 must be > 0",
        ),
        # SAPO's gate beside what it replaces
        (
            ("actor.ppo.use_sapo_loss=true",),
            "actor.ppo.use_sapo_loss: true with actor.ppo.use_decoupled_loss: true, which AReaL refuses",
        ),
        (
            ("actor.ppo.use_sapo_loss=true", "actor.ppo.use_decoupled_loss=false", "actor.ppo.sapo_tau_neg=0"),
            "actor.ppo.sapo_tau_neg: 0.0 must be > 0",
        ),
        (
            ("actor.ppo.use_sapo_loss=true", "actor.ppo.use_decoupled_loss=false", "actor.ppo.eps_clip_higher=0.28"),
            "actor.ppo.eps_clip_higher: 0.28 has no effect with actor.ppo.use_sapo_loss",
        ),
        # how long a replica waits for a canary that follows its event
        (("rollout.canary_wait_s=0",), "rollout.canary_wait_s: 0.0 must be in (0, 3600] seconds"),
        (("rollout.canary_wait_s=7200",), "rollout.canary_wait_s: 7200.0 must be in (0, 3600] seconds"),
        # the embedded engine's slab
        (("rollout.slab_rows=-1",), "rollout.slab_rows: -1 must be >= 0"),
        (("rollout.prefill_chunk=-4",), "rollout.prefill_chunk: -4 must be >= 0"),
        (("rollout.slab_rows=2",), "rollout.slab_rows: 2 is below gconfig.n_samples 4"),
        (
            ("rollout.slab_rows=8", "rollout.slab_length=16"),
            "rollout.slab_length: 16 leaves no room for a prompt beside gconfig.max_new_tokens 16",
        ),
        # vLLM slots
        ((*VLLM, "vllm.enable_lora=false"), "vllm.enable_lora: false"),
        (
            (*VLLM, "vllm.max_lora_rank=24"),
            "vllm.max_lora_rank: 24 is not a rank vLLM accepts (1, 8, 16, 32, 64, 128, 256, 320, 512); use 32",
        ),
        ((*VLLM, "actor.lora_rank=32"), "vllm.max_lora_rank: 16 is below actor.lora_rank 32"),
        ((*VLLM, "vllm.max_loras=2"), "vllm.max_loras: 2 is below rollout.lora_keep_versions 3"),
        (
            (*VLLM, "vllm.max_cpu_loras=3", "vllm.max_loras=3"),
            "vllm.max_cpu_loras: 3 is below lora_keep_versions + 1 = 4",
        ),
        ((*VLLM, "vllm.max_cpu_loras=5"), "vllm.max_cpu_loras: 5 is below vllm.max_loras 8"),
        ((*VLLM, "vllm.lora_modules=[nopath]"), "vllm.lora_modules: 'nopath' is not name=path"),
        # SGLang slots
        ((*SGLANG, "sglang.enable_lora=false"), "sglang.enable_lora: false"),
        ((*SGLANG, "sglang.max_lora_rank=4"), "sglang.max_lora_rank: 4 is below actor.lora_rank 8"),
        (
            (*SGLANG, "sglang.max_loaded_loras=3", "sglang.max_loras_per_batch=3"),
            "sglang.max_loaded_loras: 3 is below lora_keep_versions + 1 = 4",
        ),
        (
            (*SGLANG, "sglang.max_loras_per_batch=2"),
            "sglang.max_loras_per_batch: 2 is below rollout.lora_keep_versions 3",
        ),
        ((*SGLANG, "sglang.max_loaded_loras=6"), "sglang.max_loaded_loras: 6 is below sglang.max_loras_per_batch 8"),
        (
            (*SGLANG, "actor.target_modules=[q_proj,v_proj]", "sglang.lora_target_modules=[q_proj]"),
            "sglang.lora_target_modules: ['q_proj'] lacks ['v_proj']",
        ),
        ((*SGLANG, "sglang.lora_paths=[=x]"), "sglang.lora_paths: '=x' is not name=path"),
        # run, store, data
        (("total_train_steps=0",), "total_train_steps: 0 must be >= 1"),
        (("store.uri=http://minio/bucket",), "store.uri: 'http://minio/bucket' is not a file:// or s3:// URI"),
        (("store.uri=s3://bucket/prefix",), "store.endpoint: not set, but store.uri is 's3://bucket/prefix'"),
        (("exporter.uri=/plain/dir",), "exporter.uri: '/plain/dir' is not a file:// or s3:// URI"),
        (("experiment_name=my.exp",), "run: 'my.exp-trial0' is not a valid subject token"),
        (("train_dataset.path=''",), "train_dataset.path: empty"),
        (("actor.path=''",), "actor.path: empty"),
    ],
)
def test_each_rule_rejects_with_field_named(overrides, expected):
    problems = problems_of(*overrides)
    assert any(expected in p for p in problems), problems
    field = expected.split(":")[0]
    assert any(p.startswith(field) for p in problems), problems


def test_slot_rules_only_apply_to_the_engine_in_use():
    cfg = build("sglang.max_loaded_loras=1", "vllm.max_lora_rank=24", "rollout.engine=embedded")
    assert cfg.sglang.max_loaded_loras == 1
    build("sglang.max_loaded_loras=1", "rollout.engine=vllm")
    build("vllm.max_lora_rank=24", "vllm.max_loras=1", "rollout.engine=sglang")


def test_single_sample_is_fine_without_group_normalisation():
    assert build("gconfig.n_samples=1", "actor.ppo.group_adv_norm=false").gconfig.n_samples == 1


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        build(
            "actor.peft_type=ia3",
            "rollout.lora_keep_versions=1",
            "rollout.engine=vllm",
            "actor.weight_update_mode=xccl",
            "actor.xccl_backend=nccl",
            "rollout.device=cpu",
            "total_train_steps=0",
        )
    err = info.value
    fields = {p.split(":")[0] for p in err.problems}
    assert {"actor.peft_type", "rollout.lora_keep_versions", "actor.xccl_backend", "total_train_steps"} <= fields
    assert f"has {len(err.problems)} problems" in str(err)
    assert all(f"  - {p}" in str(err) for p in err.problems)


def test_validate_lists_problems_of_an_unloaded_struct():
    # a bare Struct still holds its unresolved `${experiment_name}-${trial_name}` run name
    problems = validate(LorabusConfig())
    assert [p.split(":")[0] for p in problems] == ["run", "actor.path", "train_dataset.path"]


def test_error_message_names_source_file(tmp_path):
    path = write(tmp_path, "actor: {path: m, peft_type: ia3}\ntrain_dataset: {path: x}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"config {path}: actor.peft_type: 'ia3' is not supported; lorabus trains LoRA only (peft_type: lora)"
    )


# --- shipped examples ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,backend,engine,mode",
    [
        ("tiny.yaml", "fsdp2", "embedded", "disk"),
        ("areal_gsm8k_fsdp2_sglang.yaml", "fsdp2", "sglang", "disk"),
        ("areal_gsm8k_megatron_vllm.yaml", "megatron", "vllm", "xccl"),
        ("areal_qwen3moe_megatron_vllm.yaml", "megatron", "vllm", "xccl"),
    ],
)
def test_examples_load_and_validate(name, backend, engine, mode, monkeypatch, tmp_path):
    for var in ("LORABUS_RUN_ROOT", "LORABUS_NATS_URL", "LORABUS_S3_ENDPOINT", "GSM8K_DIR", "LORABUS_TRAINER_HOST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LORABUS_AREAL_REPORTED", "1")
    # validation reads no data (the epochs of the AReaL files stay epochs; tests/unit/test_areal.py
    # counts them from a local GSM8K copy)
    cfg = load_config(EXAMPLES / name, read_data=False)
    assert (cfg.actor.backend, cfg.rollout.engine, cfg.actor.weight_update_mode) == (backend, engine, mode)
    assert validate(cfg) == []
    v0 = f"{cfg.gconfig.lora_name}-v0"
    if engine == "vllm":
        assert cfg.vllm.lora_modules == [f"{v0}=/adapters/{v0}"]
        assert cfg.vllm.max_lora_rank == cfg.actor.lora_rank
    if engine == "sglang":
        assert cfg.sglang.lora_paths == [f"{v0}=/adapters/{v0}"]


def test_tiny_is_the_embedded_task():
    cfg = load_config(EXAMPLES / "tiny.yaml")
    assert cfg.actor.path == "examples/tiny/model"
    assert cfg.train_dataset.path == "builtin:arith"
    assert cfg.store.uri.startswith("file://")


def test_derived_values_need_no_loader():
    # a section built by hand (tests, benchmarks) answers as a loaded one does
    ro = RolloutConfig(max_head_offpolicyness=4, consumer_batch_size=3)
    assert (ro.keep_versions, ro.max_concurrent) == (5, 3)
    ro = RolloutConfig(max_head_offpolicyness=4, lora_keep_versions=7, max_concurrent_rollouts=2)
    assert (ro.keep_versions, ro.max_concurrent) == (7, 2)
    cfg = build("rollout.max_head_offpolicyness=1")
    assert cfg.rollout.keep_versions == cfg.rollout.lora_keep_versions == 2


# --- evaluator ---------------------------------------------------------------------------------


def test_evaluator_defaults_to_the_gpu_when_present_and_every_version():
    cfg = build()
    assert (cfg.evaluator.device, cfg.evaluator.dtype, cfg.evaluator.versions) == ("auto", "auto", "every")
    assert build("evaluator.device=cuda:1").evaluator.device == "cuda:1"


def test_evaluator_problems_name_field_value_and_fix():
    problems = problems_of(
        "evaluator.device=gpu",
        "evaluator.batch_size=0",
        "evaluator.max_prompts=0",
        "evaluator.nth=0",
        "evaluator.max_wait_s=-1",
        "evaluator.score=nocolon",
        "evaluator.versions=latest",
    )
    assert problems == [
        "evaluator.versions: 'latest' is not one of 'every', 'every_nth', 'newest'; did you mean 'newest'?",
        "evaluator.device: 'gpu' is not a device; use auto, cpu, cuda or cuda:N",
        "evaluator.batch_size: 0 must be >= 1 (prompts per generate call)",
        "evaluator.max_prompts: 0 must be >= 1 (or null: every held-out prompt)",
        "evaluator.nth: 0 must be >= 1 (versions: every_nth scores multiples of it)",
        "evaluator.max_wait_s: -1.0 must be >= 0 (seconds `lorabus up` waits for missing scores once "
        "training has ended)",
        "evaluator.score: 'nocolon' is not package.module:function; e.g. services.clients.evaluate:heldout_reward",
    ]


def test_a_group_of_one_is_refused_only_where_its_advantage_would_be_zero():
    """n_samples 1 zeroes a group-centred advantage; uncentred (REINFORCE, AReaL's reward_norm:
    null) or leave-one-out (RLOO: a lone sample's baseline is 0) rewards still train."""
    for override in ("actor.ppo.reward_norm=false", "actor.ppo.leave_one_out=true"):
        assert build("gconfig.n_samples=1", override).gconfig.n_samples == 1


def test_overlong_penalty_ends_at_gconfig_s_cap_unless_told_otherwise():
    # the window's end is the cap the completions were sampled under, filled in by the loader
    assert build("actor.ppo.overlong_tokens=4").actor.ppo.overlong_max_tokens == 16
    assert build("actor.ppo.overlong_tokens=4", "actor.ppo.overlong_max_tokens=12").actor.ppo.overlong_max_tokens == 12
    assert build().actor.ppo.overlong_max_tokens is None
