"""AReaL experiment files: translated field by field, reported once, refused where lorabus
cannot honour a field, all problems in one pass (services/config/areal.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
import yaml

from services.common.data import DataError, load_prompts
from services.config import areal
from services.config.loader import ConfigError, load_config
from services.config.schema import DatasetConfig
from services.trainer.loss import batch_normalise, group_advantages
from services.trainer.schedule import warmup_steps
from tests.fixtures import gsm8k as gsm8k_data

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "areal"
TRAIN_ROWS = 600  # 600 // 256 = 2 steps per epoch; 600 // 16 = 37


@pytest.fixture
def gsm8k(tmp_path, monkeypatch):
    """`openai/gsm8k` as a user's HF cache holds it (TRAIN_ROWS train rows), offline."""
    import huggingface_hub.constants

    home = tmp_path / "hf"
    hub = home / "hub" / "datasets--openai--gsm8k" / "snapshots" / gsm8k_data.REVISION / "main"
    hub.mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    fixture_rows = gsm8k_data.rows("train")
    train = [fixture_rows[i % len(fixture_rows)] for i in range(TRAIN_ROWS)]
    pq.write_table(pa.Table.from_pylist(train), hub / "train-00000-of-00001.parquet")
    gsm8k_data.write_parquet(hub / "test-00000-of-00001.parquet", "test")
    (home / "hub" / "datasets--openai--gsm8k" / "refs").mkdir()
    (home / "hub" / "datasets--openai--gsm8k" / "refs" / "main").write_text(gsm8k_data.REVISION)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(areal.REPORTED_ENV, "1")
    return home


@pytest.fixture
def chat_tok(tmp_path):
    """An instruct tokenizer (chat template), given as AReaL's `tokenizer_path=` override."""
    return gsm8k_data.chat_tokenizer(tmp_path / "tok")


def test_fsdp_sglang_example_shape(gsm8k, chat_tok):
    # AReaL's file as it is; the tokenizer given as AReaL's own override (the hub is unreachable)
    cfg = load_config(FIXTURES / "gsm8k_grpo_lora.yaml", [f"tokenizer_path={chat_tok}"])
    a, p, o, g, r = cfg.actor, cfg.actor.ppo, cfg.actor.optimizer, cfg.gconfig, cfg.rollout
    assert (cfg.experiment_name, cfg.trial_name, cfg.seed) == ("gsm8k-grpo", "trial0", 1)
    assert cfg.total_train_steps == 10 * (TRAIN_ROWS // 256)
    assert (a.backend, a.nproc_per_node, a.path, a.dtype) == ("fsdp2", 4, "Qwen/Qwen2.5-1.5B-Instruct", "bfloat16")
    assert (a.use_lora, a.peft_type, a.lora_rank, a.lora_alpha, a.target_modules) == (
        True,
        "lora",
        16,
        16,
        ["all-linear"],
    )
    assert a.weight_update_mode == "disk" and a.mb_spec_max_tokens == 10240
    assert (o.type, o.lr, o.weight_decay, o.beta1, o.beta2, o.eps) == ("adamw", 1.7e-4, 0.017, 0.9, 0.999, 1e-8)
    assert (o.gradient_clipping, o.lr_scheduler_type, o.warmup_steps, o.min_lr_ratio) == (1.0, "constant", None, 0.0)
    assert warmup_steps(o, cfg.total_train_steps) == 0  # int(0.001 x 20), as AReaL
    assert (p.eps_clip, p.eps_clip_higher, p.reward_scaling, p.reward_bias, p.reward_clip) == (
        0.4,
        None,
        10.0,
        -0.5,
        20.0,
    )
    assert (p.kl_ctl, p.ppo_n_minibatches, p.use_decoupled_loss) == (0.0, 1, True)
    assert (p.behav_imp_weight_cap, p.behav_imp_weight_mode) == (5.0, "mask")
    assert (p.group_adv_norm, p.adv_norm_std, p.batch_adv_norm, p.batch_adv_norm_std, p.norm_eps) == (
        True,
        True,
        True,
        True,
        1e-5,
    )
    assert (g.n_samples, g.min_new_tokens, g.max_new_tokens, g.greedy, g.temperature) == (4, 0, 1024, False, 1.0)
    assert (g.top_p, g.top_k, g.lora_name) == (1.0, 0, "lora-gsm8k")
    assert (r.engine, r.replicas, r.max_concurrent_rollouts, r.consumer_batch_size) == ("sglang", 4, 256, 256)
    assert (r.max_head_offpolicyness, r.use_lora, r.lora_name) == (2, True, "lora-gsm8k")
    s = cfg.sglang
    assert (s.model_path, s.enable_lora, s.max_lora_rank, s.max_loaded_loras, s.lora_backend) == (
        "Qwen/Qwen2.5-1.5B-Instruct",
        True,
        16,
        8,
        "triton",
    )
    assert s.extra_args == [
        "--random-seed=1",
        "--dtype=bfloat16",
        "--context-length=32768",
        "--mem-fraction-static=0.8",
    ]
    t, v = cfg.train_dataset, cfg.valid_dataset
    assert (t.path, t.split, t.shuffle, t.prompt_field, t.answer_field) == (
        "openai/gsm8k",
        "train",
        True,
        "question",
        "answer",
    )
    assert t.reward_fn == "services.common.rewards:math_answer"
    assert (t.config_name, t.instruction, t.chat_template, t.max_length) == (
        "main",
        areal.GSM8K_INSTRUCTION,
        True,
        1024,
    )
    assert (v.split, v.shuffle, v.max_length, v.tokenizer_path) == ("test", False, None, str(chat_tok))


def test_megatron_vllm_example_shape(gsm8k, chat_tok):
    cfg = load_config(FIXTURES / "gsm8k_grpo_megatron_lora.yaml", [f"tokenizer_path={chat_tok}"])
    a, m = cfg.actor, cfg.actor.megatron
    assert (a.backend, a.nproc_per_node, a.path) == ("megatron", 4, "Qwen/Qwen3-0.6B")
    assert (
        m.bridge_type,
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.expert_model_parallel_size,
    ) == ("megatron-bridge", 1, 1, 1)
    assert a.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert (a.lora_rank, a.lora_alpha, a.optimizer.lr, a.optimizer.weight_decay) == (16, 16, 3e-5, 0.003)
    assert a.weight_update_mode == "xccl"  # kept: the vLLM sidecar joins the broadcast group
    assert (cfg.rollout.engine, cfg.rollout.replicas) == ("vllm", 4)
    v = cfg.vllm
    assert (v.model, v.dtype, v.max_model_len, v.enable_lora, v.max_lora_rank, v.max_loras) == (
        "Qwen/Qwen3-0.6B",
        "bfloat16",
        32768,
        True,
        16,
        8,
    )
    assert v.extra_args == ["--seed=1", "--gpu-memory-utilization=0.9", "--enforce-eager"]
    assert (cfg.total_train_epochs, cfg.total_train_steps) == (10, 20)
    # AReaL 1.0.4 refuses its own file (behave_imp_weight_cap was removed); read by its mapping
    assert (a.ppo.behav_imp_weight_cap, a.ppo.behav_imp_weight_mode) == (5.0, "mask")


def test_moe_example_loads_as_written(gsm8k, chat_tok):
    # megatron:(attn:d1p6t1c1|ffn:d1p6t1e1): six pipeline stages, one rank each, experts unsplit
    cfg = load_config(FIXTURES / "gsm8k_grpo_megatron_lora_moe.yaml", [f"tokenizer_path={chat_tok}"])
    a, m, o = cfg.actor, cfg.actor.megatron, cfg.actor.optimizer
    assert (a.backend, a.nproc_per_node) == ("megatron", 6)
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size) == (1, 6, 1)
    assert (a.lora_rank, a.lora_alpha, a.path) == (32, 32, "Qwen/Qwen3-30B-A3B-Base")
    assert (o.lr, o.lr_scheduler_type, o.warmup_steps, o.warmup_steps_proportion) == (3e-6, "cosine", None, 0.001)
    assert cfg.total_train_steps == 10 * (TRAIN_ROWS // 16)
    assert (cfg.rollout.replicas, cfg.rollout.consumer_batch_size) == (1, 16)
    assert cfg.vllm.extra_args[0] == "--tensor-parallel-size=2"


def test_megatron_layouts_the_engine_cannot_run_are_refused(gsm8k, chat_tok):
    path = FIXTURES / "gsm8k_grpo_megatron_lora_moe.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, ["actor.backend=megatron:(attn:d1p6t1c1|ffn:d1p6t2e1)"])
    assert any("expert tensor parallelism t2" in p for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["actor.backend=megatron:(attn:d1p4t1c1|ffn:d1p4t1e3)"])
    assert any("attn d*t*p*c = 4 ranks but ffn d*t*p*e = 12" in p for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        load_config(path, ["actor.nproc_per_node=4", f"tokenizer_path={chat_tok}"])
    assert info.value.problems[0].startswith(
        "actor.nproc_per_node: 4 is not a multiple of tensor x pipeline size 1 x 6 = 6"
    )


def test_startup_table_is_printed_once(gsm8k, chat_tok, monkeypatch, capsys):
    monkeypatch.delenv(areal.REPORTED_ENV)
    load_config(FIXTURES / "gsm8k_grpo_lora.yaml", [f"tokenizer_path={chat_tok}"])
    err = capsys.readouterr().err
    assert "is an AReaL experiment file" in err
    lines = err.splitlines()

    def row(field: str) -> str:
        return "\n".join(line for line in lines if line.startswith(field + " "))

    assert "counted when the run starts and loads the data" in row("total_train_epochs")
    assert "total_train_steps = 20 (10 x (600 prompts // batch 256) = 20)" in row("total_train_epochs")
    assert "never binds: train_dataset.max_length 1024 + max_new_tokens 1024 <= 32768" in row("gconfig.max_tokens")
    assert "actor.ppo.reward_scaling = 10.0" in row("actor.reward_scaling")
    assert "actor.optimizer.type = 'adamw'" in row("actor.optimizer.type")
    assert "actor.ppo.reward_clip = 20.0" in row("actor.reward_clip") and "(AReaL default)" in row("actor.reward_clip")
    assert "actor.gradient_checkpointing = True" in row("actor.gradient_checkpointing")
    assert "no effect: lorabus writes under run_dir" in row("cluster.fileroot")
    assert "no effect: the trainer checkpoints" in row("saver.*")
    assert "no effect: metrics are Prometheus" in row("stats_logger.*")
    assert "rollout.engine = 'sglang', rollout.replicas = 4" in row("rollout.backend")
    load_config(FIXTURES / "gsm8k_grpo_lora.yaml", [f"tokenizer_path={chat_tok}"])
    assert capsys.readouterr().err == ""


def test_every_key_lands_in_one_row(gsm8k):
    src = yaml.safe_load((FIXTURES / "gsm8k_grpo_lora.yaml").read_text())
    from omegaconf import OmegaConf

    t = areal.translate(src)
    assert t.problems == []
    resolved = OmegaConf.to_container(OmegaConf.create({k: v for k, v in src.items() if k != "lorabus"}), resolve=True)
    keys = set(areal.flatten(resolved))
    reported = {r.areal for r in t.rows}
    assert keys - reported == set()


def test_malformed_file_reports_every_problem_at_once(gsm8k, tmp_path):
    src = yaml.safe_load((FIXTURES / "gsm8k_grpo_lora.yaml").read_text())
    src["actor"]["backend"] = "fsdp:d4t2"
    src["actor"]["kl_ctl"] = 0.05
    src["actor"]["c_clip"] = 3.0
    src["actor"]["adv_norm"] = {"mean_level": "group", "std_level": "group"}
    src["actor"]["gradient_checkpoint"] = True
    src["gconfig"]["min_new_tokens"] = 8
    src["gconfig"]["top_k"] = "many"
    src["rollout"]["backend"] = "sglang:d4e2"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(src))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = "\n".join(info.value.problems)
    for needle in (
        "actor.backend: 'fsdp:d4t2': lorabus's FSDP2 engine shards data-parallel only",
        "rollout.backend: 'sglang:d4e2'",
        "actor.c_clip: 3.0 is not supported",
        "actor.adv_norm.mean_level: 'group' with std_level 'group' is not supported",
        "actor.gradient_checkpoint: True is not translated; did you mean actor.gradient_checkpointing?",
        "actor.ppo.kl_ctl: 0.05 is not supported",
        "gconfig.min_new_tokens: 8 is not supported",
    ):
        assert needle in text, (needle, text)
    assert len(info.value.problems) >= 7


def test_uncountable_dataset_is_an_error_that_says_what_to_do(gsm8k, chat_tok, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as info:
        load_config(FIXTURES / "gsm8k_grpo_lora.yaml", [f"tokenizer_path={chat_tok}", f"train_dataset.path={missing}"])
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("total_train_epochs: 10 cannot become steps")
    assert info.value.problems[0].endswith("make it readable, or set total_train_steps instead")


def test_translating_reads_no_data_and_needs_no_network(monkeypatch, tmp_path, capsys):
    """No HF cache, no tokenizer, no network: `config translate` still works, in well under the
    ~24 s that `datasets` spends retrying the hub offline."""
    import time

    import huggingface_hub.constants

    from services.config.cli import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    started = time.monotonic()
    assert main(["translate", str(FIXTURES / "gsm8k_grpo_lora.yaml")]) == 0
    assert time.monotonic() - started < 5
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["total_train_epochs"] == 10 and "total_train_steps" not in out


def test_native_file_with_areal_keys_gets_same_meaning_hints(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text(
        "total_train_epochs: 3\nactor: {path: m, recompute_logprob: true, eps_clip: 0.4}\n"
        "train_dataset: {path: builtin:arith}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = "\n".join(info.value.problems)
    assert "total_train_epochs" not in text  # lorabus's own key too
    assert "AReaL's actor.recompute_logprob has no lorabus equivalent" in text
    assert "AReaL's actor.eps_clip is lorabus's actor.ppo.eps_clip" in text
    assert "checkpoint_dir" not in text


@pytest.mark.parametrize(
    "text,backend,dims,ffn",
    [
        ("fsdp:d4", "fsdp", {"d": 4}, None),
        ("vllm:d4p1t1", "vllm", {"d": 4, "p": 1, "t": 1}, None),
        (
            "megatron:(attn:d1p6t1c1|ffn:d1p6t1e1)",
            "megatron",
            {"d": 1, "p": 6, "t": 1, "c": 1},
            {"d": 1, "p": 6, "t": 1, "e": 1},
        ),
        ("megatron[actor]:d2t2", "megatron", {"d": 2, "t": 2}, None),
    ],
)
def test_parse_alloc(text, backend, dims, ffn):
    a = areal.parse_alloc(text)
    assert (a.backend, a.dims, a.ffn) == (backend, dims, ffn)


@pytest.mark.parametrize("text", ["fsdp", "fsdp:", "fsdp:x4", "vllm:d4q2", "megatron:(attn:d1e2|ffn:d1)"])
def test_parse_alloc_rejects(text):
    with pytest.raises(ValueError):
        areal.parse_alloc(text)


def test_config_translate_round_trips(gsm8k, chat_tok, tmp_path, capsys):
    from services.config.cli import main

    areal_file = FIXTURES / "gsm8k_grpo_megatron_lora.yaml"
    assert main(["translate", str(areal_file), f"tokenizer_path={chat_tok}"]) == 0
    out, err = capsys.readouterr()
    assert "AReaL field" in err and "lorabus config translated from" in out
    native = tmp_path / "native.yaml"
    native.write_text(out)
    assert load_config(native) == load_config(areal_file, [f"tokenizer_path={chat_tok}"])
    assert load_config(native).total_train_steps == 20


# --- the semantics behind the translated fields -----------------------------------------------


def test_reward_clip_and_eps():
    adv = group_advantages([torch.tensor([0.0, 100.0])], reward_scaling=1.0, reward_clip=20.0, eps=0.0)
    assert torch.allclose(adv[0], torch.tensor([-0.7071, 0.7071]), atol=1e-4)


def test_batch_normalise_weights_completions_by_tokens():
    adv = torch.tensor([1.0, -1.0])
    tokens = torch.tensor([3, 1])
    # per token: [1, 1, 1, -1]: mean 0.5, unbiased std 1
    out = batch_normalise(adv, tokens, eps=0.0)
    assert torch.allclose(out, torch.tensor([0.5, -1.5]))
    assert torch.allclose(batch_normalise(adv, tokens, use_std=False), torch.tensor([0.5, -1.5]))


# --- datasets as users name them ---------------------------------------------------------------


def test_parquet_file_and_directory(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    d = tmp_path / "ds" / "main"
    d.mkdir(parents=True)
    pq.write_table(
        pa.table({"question": ["a?", "b?"], "answer": ["#### 1", "#### 2"]}), d / "train-00000-of-00001.parquet"
    )
    for path in (d / "train-00000-of-00001.parquet", tmp_path / "ds"):
        prompts = load_prompts(DatasetConfig(path=str(path), prompt_field="question"))
        assert [(p.text, p.answer) for p in prompts] == [("a?", "1"), ("b?", "2")]


def test_directory_of_jsonl_splits(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"prompt": "x", "answer": "1"}\n')
    (tmp_path / "train.jsonl").write_text('{"prompt": "y", "answer": "2"}\n')
    prompts = load_prompts(DatasetConfig(path=str(tmp_path), split="test"))
    assert [p.text for p in prompts] == ["x"]


def test_saved_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["p"], "answer": ["3"]})}).save_to_disk(
        str(tmp_path / "saved")
    )
    assert [p.answer for p in load_prompts(DatasetConfig(path=str(tmp_path / "saved")))] == ["3"]


def test_hub_id_without_datasets_library_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(
        DataError, match=r"'openai/gsm8k' is a Hugging Face dataset, which needs the `datasets` library"
    ):
        load_prompts(DatasetConfig(path="openai/gsm8k"))


def test_areal_tiny_example_is_the_tiny_task(monkeypatch):
    """examples/areal_tiny.yaml (AReaL's schema) runs the same job as examples/tiny.yaml, but for
    the AReaL defaults an AReaL user would get there too."""
    monkeypatch.setenv(areal.REPORTED_ENV, "1")
    examples = Path(__file__).resolve().parents[2] / "examples"
    translated = msgspec.to_builtins(load_config(examples / "areal_tiny.yaml"))
    native = msgspec.to_builtins(load_config(examples / "tiny.yaml"))

    def leaves(tree: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, n = leaves(translated), leaves(native)
    differ = {k: (a.get(k), n.get(k)) for k in a.keys() | n.keys() if a.get(k) != n.get(k)}
    assert differ == {
        "actor.ppo.reward_clip": (20.0, None),  # AReaL's default clip
        "actor.ppo.norm_eps": (1e-5, 1e-6),  # AReaL's default epsilon
        "valid_dataset.split": ("test", "train"),  # AReaL's default; builtin:arith:valid names its own
        "total_train_epochs": (1, None),  # kept, and counted into the same total_train_steps
    }


def test_megatron_options_follow_the_translated_backend():
    """actor.backend: null is reported as missing (it raised AttributeError), and a Megatron
    trainer named only by the deprecated allocation_mode still gets its actor.megatron keys."""
    common = {"experiment_name": "e", "trial_name": "t", "actor": {"path": "m"}}
    missing = areal.translate({**common, "actor": {"path": "m", "backend": None}})
    assert any(p.startswith("actor.backend: missing") for p in missing.problems), missing.problems

    by_mode = areal.translate(
        {
            **common,
            "allocation_mode": "vllm:d2+megatron:d2t2",
            "actor": {"path": "m", "megatron": {"bridge_type": "megatron-bridge"}},
        }
    )
    assert by_mode.tree["actor"]["backend"] == "megatron"
    assert by_mode.tree["actor"]["megatron"]["bridge_type"] == "megatron-bridge"


def test_what_areals_own_examples_write_reads_as_areal_reads_it(gsm8k):
    """Three shapes from AReaL's examples/ (2026-12): an explicit `total_train_steps: null`
    (inference_service/tau2_rollout.yaml), a reference to a key the file leaves to AReaL's
    default (openai_agents/config.yaml's `${gconfig.max_new_tokens}`), and the deprecated
    `allocation_mode` with a bare training part (scaffolding/*.yaml), which AReaL refuses too."""
    src = yaml.safe_load((FIXTURES / "gsm8k_grpo_lora.yaml").read_text())
    src["total_train_steps"] = None
    t = areal.translate(src)
    assert t.problems == []
    assert any(r.areal == "total_train_steps" and r.became == "-" for r in t.rows)

    src = yaml.safe_load((FIXTURES / "gsm8k_grpo_lora.yaml").read_text())
    del src["gconfig"]["max_new_tokens"]
    src["actor"]["max_new_tokens"] = "${gconfig.max_new_tokens}"
    t = areal.translate(src)
    assert t.problems == []
    assert "gconfig.max_new_tokens" not in {r.areal for r in t.rows if not str(r.value).endswith("(AReaL default)")}
    assert t.tree["gconfig"]["max_new_tokens"] == 16384  # AReaL's default, as the reference read it
    assert next(r for r in t.rows if r.areal == "actor.max_new_tokens").value == 16384

    src = yaml.safe_load((FIXTURES / "gsm8k_grpo_lora.yaml").read_text())
    del src["actor"]["backend"]
    src.pop("ref", None)  # it names ${actor.backend}
    src["allocation_mode"] = "sglang:d1+d1"
    t = areal.translate(src)
    assert "allocation_mode: 'sglang:d1+d1': its part 'd1' is not <backend>:<dims>" in " ".join(t.problems)


def test_a_field_read_at_a_value_it_cannot_take_is_not_told_to_be_itself():
    from services.config.areal.renames import unknown

    message = unknown("total_train_steps", "many", {"total_train_steps"})
    assert "did you mean" not in message and message.startswith("total_train_steps: 'many' is not translated")
