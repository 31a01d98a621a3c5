"""The Megatron engine's parts that need no Megatron: target names, bridge-named adapter state
(TP slices, the hand-off to the HF converter), the fp32-master optimizer, per-rank
checkpoints and the GRPO step on a CPU model with megatron-bridge's LoRA structure.

The engine itself (megatron-bridge + CUDA) is exercised by `benchmarks/megatron_lora_step.py`
on a GPU; here it is only checked that it fails clearly without Megatron.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import msgspec
import pytest
import torch
from torch import nn

from benchmarks import megatron_lora_step as bench  # its --cpu-check is a test below
from proto.messages import Completion, Trajectory
from services.common import adapter_io, lora_targets
from services.common.megatron_to_hf import ModelShape
from services.config.schema import ActorConfig, PPOConfig
from services.trainer.engines.megatron import MegatronNotInstalled
from services.trainer.engines.megatron import checkpoint as shards
from services.trainer.engines.megatron.optim import MasterAdapterOptimizer
from services.trainer.engines.megatron.state import (
    AdapterStateError,
    adapter_named_parameters,
    megatron_targets,
    merge_tp,
    to_hf,
    tp_split,
)
from services.trainer.engines.megatron.step import train_step
from tests.fixtures.megatron_ref import attach_lora

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
SHAPE = ModelShape(num_layers=2, hidden=64, num_attention_heads=4, num_query_groups=2, head_dim=16, ffn_hidden=48)
R = 4


def fake_adapter(shape: ModelShape = SHAPE, rank: int = R, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hd, h = shape.head_dim, shape.hidden
    qkv = (shape.q_per_group + 2) * shape.num_query_groups * hd
    dims = {
        "self_attention.linear_qkv": (h, qkv),
        "self_attention.linear_proj": (shape.num_attention_heads * hd, h),
        "mlp.linear_fc1": (h, 2 * shape.ffn_hidden),
        "mlp.linear_fc2": (shape.ffn_hidden, h),
    }
    out = {}
    for L in range(shape.num_layers):
        for module, (i, o) in dims.items():
            p = f"decoder.layers.{L}.{module}.adapter."
            out[p + "linear_in.weight"] = torch.randn(rank, i, generator=g)
            out[p + "linear_out.weight"] = torch.randn(o, rank, generator=g)
    return out


# --- optional import -------------------------------------------------------------------------


@pytest.mark.skipif(HAVE_MEGATRON, reason="megatron is installed here: the missing-extra path cannot run")
def test_engine_without_megatron_names_the_extra():
    import services.trainer.engines.megatron as pkg

    with pytest.raises(MegatronNotInstalled, match=r"lorabus\[megatron\]"):
        pkg.MegatronEngine  # noqa: B018
    with pytest.raises(ImportError, match=r"megatron\.core"):
        importlib.import_module("services.trainer.engines.megatron.engine")


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core and megatron-bridge (lorabus[megatron])")
def test_engine_imports_with_megatron():
    from services.trainer.engines.megatron import MegatronEngine

    assert callable(MegatronEngine)


# --- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,expected",
    [
        ([], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
        (["all-linear"], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
        (["linear_qkv", "linear_fc2"], ["linear_qkv", "linear_fc2"]),
    ],
)
def test_megatron_targets(given, expected):
    assert megatron_targets(ActorConfig(backend="megatron", target_modules=given)) == expected
    # the backend field does not matter: the engine always asks for Megatron names
    assert megatron_targets(ActorConfig(backend="fsdp2", target_modules=given)) == expected


def test_megatron_targets_rejects_hf_names():
    with pytest.raises(AdapterStateError, match="q_proj.*linear_qkv"):
        megatron_targets(ActorConfig(backend="megatron", target_modules=["q_proj"]))


def test_adapter_named_parameters():
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    a = nn.Parameter(torch.zeros(R, 8))
    named = [
        ("module.decoder.layers.0.mlp.linear_fc1.to_wrap.weight", frozen),
        ("module.module.decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight", a),
    ]
    assert adapter_named_parameters(named) == [("decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight", a)]
    trainable_base = [("decoder.layers.0.mlp.linear_fc1.to_wrap.weight", nn.Parameter(torch.zeros(2)))]
    with pytest.raises(AdapterStateError, match="must be frozen"):
        adapter_named_parameters(trainable_base + named)
    with pytest.raises(AdapterStateError, match="no `.adapter"):
        adapter_named_parameters([named[0]])


# --- tensor parallel slices ------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_merge_reproduces_megatron_sharded_forward(tp):
    """Each rank computes what ParallelLinearAdapter computes on its slices; the merged
    (tp=1) adapter must give the outputs the ranks together produce."""
    state = fake_adapter(SHAPE)
    ranks = [{} for _ in range(tp)]
    for name, t in state.items():
        for r, part in enumerate(tp_split(name, t, tp)):
            ranks[r][name] = part
    merged = merge_tp(ranks)
    assert all(torch.equal(merged[n], state[n]) for n in state)
    p = "decoder.layers.1."
    x = torch.randn(3, SHAPE.hidden)
    # column-parallel fc1: linear_in gathers the full rank-r activation; each rank emits
    # [its gate rows; its up rows]; the model's gate output is all ranks' gate rows in order
    z = x @ torch.cat([rk[p + "mlp.linear_fc1.adapter.linear_in.weight"] for rk in ranks]).T
    per_rank = [z @ rk[p + "mlp.linear_fc1.adapter.linear_out.weight"].T for rk in ranks]
    gate = torch.cat([y.chunk(2, dim=-1)[0] for y in per_rank], dim=-1)
    up = torch.cat([y.chunk(2, dim=-1)[1] for y in per_rank], dim=-1)
    full = z @ merged[p + "mlp.linear_fc1.adapter.linear_out.weight"].T
    torch.testing.assert_close(full, torch.cat([gate, up], dim=-1))
    # row-parallel fc2: each rank holds input columns; A x is the sum of rank partials
    h = torch.randn(3, SHAPE.ffn_hidden)
    parts = h.chunk(tp, dim=-1)
    z2 = sum(part @ rk[p + "mlp.linear_fc2.adapter.linear_in.weight"].T for part, rk in zip(parts, ranks))
    torch.testing.assert_close(z2, h @ merged[p + "mlp.linear_fc2.adapter.linear_in.weight"].T)


def test_merge_tp_rejects_mismatched_ranks():
    state = fake_adapter(SHAPE)
    other = dict(state)
    other.pop(next(iter(other)))
    with pytest.raises(AdapterStateError, match="TP rank 1"):
        merge_tp([state, other])
    with pytest.raises(AdapterStateError, match="not a megatron-bridge adapter"):
        merge_tp([{"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(1)}] * 2)


def test_to_hf_hand_off_is_fp32_peft_and_serializes():
    state = {k: v.bfloat16() for k, v in fake_adapter(SHAPE).items()}
    hf = to_hf(state, SHAPE)
    assert all(v.dtype == torch.float32 for v in hf.values())
    modules = {adapter_io.parse_peft_key(k)[0].rsplit(".", 1)[-1] for k in hf}
    assert sorted(modules) == lora_targets.to_hf(["all-linear"])
    # qkv's A is shared by q, k and v; fc1's B splits into gate and up
    a = state["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"].float()
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(hf[adapter_io.peft_key(f"model.layers.0.self_attn.{proj}", "A")], a)
    b = state["decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"].float()
    assert torch.equal(hf[adapter_io.peft_key("model.layers.0.mlp.up_proj", "B")], b[SHAPE.ffn_hidden :])
    assert adapter_io.from_bytes(adapter_io.to_bytes(hf)).keys() == hf.keys()


# --- optimizer ---------------------------------------------------------------------------------


def _adam(params):
    return torch.optim.Adam(params, lr=1e-4)


def test_master_optimizer_keeps_updates_bf16_would_lose():
    w = nn.Parameter(torch.full((4, 4), 1.0, dtype=torch.bfloat16))
    opt = MasterAdapterOptimizer([("x.adapter.linear_in.weight", w)], _adam)
    for _ in range(3):
        opt.zero_grad()
        (w.float().sum()).backward()
        opt.step(max_norm=0.0)
    master = opt.masters[0]
    # three Adam steps of 1e-4 are below bf16's resolution at 1.0 (2**-7): the master moved,
    # the bf16 copy is its rounding
    assert float(master.detach()[0, 0]) == pytest.approx(1.0 - 3e-4, abs=1e-6)
    assert torch.equal(w.detach(), master.detach().bfloat16())


def test_master_optimizer_clips_and_round_trips():
    w = nn.Parameter(torch.zeros(3))
    opt = MasterAdapterOptimizer([("x.adapter.linear_out.weight", w)], _adam)
    opt.zero_grad()
    w.grad = torch.tensor([3.0, 4.0, 0.0])
    assert opt.step(max_norm=1.0) == pytest.approx(5.0)
    assert opt.masters[0] is w  # fp32 params are their own masters
    saved = opt.state_dict()
    w2 = nn.Parameter(torch.ones(3))
    opt2 = MasterAdapterOptimizer([("x.adapter.linear_out.weight", w2)], _adam)
    opt2.load_state_dict(saved)
    assert torch.equal(w2.detach(), w.detach())
    other = MasterAdapterOptimizer([("y.adapter.linear_out.weight", nn.Parameter(torch.zeros(3)))], _adam)
    with pytest.raises(ValueError, match="does not fit"):
        other.load_state_dict(saved)


# --- per-rank checkpoints --------------------------------------------------------------------


LAYOUT = {"world_size": 2, "rank": 1, "tp": 2, "pp": 1, "dp": 1}


def test_checkpoint_shard_round_trip(tmp_path):
    state = {"names": ["a"], "masters": {"a": torch.arange(6.0).view(2, 3)}, "optimizer": {"x": 1}}
    path = shards.save_shard(tmp_path, 7, LAYOUT, state)
    assert path == tmp_path / "megatron-ranks" / "step-00000007" / "rank-00001.pt"
    loaded = shards.load_shard(tmp_path, 7, LAYOUT)
    assert torch.equal(loaded["masters"]["a"], state["masters"]["a"])
    assert not list(path.parent.glob(".*tmp*"))
    with pytest.raises(RuntimeError, match="parallel layout"):
        shards.load_shard(tmp_path, 7, {**LAYOUT, "tp": 1, "dp": 2})
    with pytest.raises(FileNotFoundError, match="rank 0"):
        shards.load_shard(tmp_path, 7, {**LAYOUT, "rank": 0})
    path.write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match="cannot be read"):
        shards.load_shard(tmp_path, 7, LAYOUT)


def test_checkpoint_prune_keeps_newest(tmp_path):
    for step in range(1, 6):
        shards.save_shard(tmp_path, step, LAYOUT, {})
    shards.prune(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "megatron-ranks").iterdir())
    assert left == ["step-00000004", "step-00000005"]


# --- the GRPO step on a CPU model with bridge's LoRA structure -------------------------------


class TupleLinear(nn.Linear):
    """A Megatron linear: returns (output, bias)."""

    def forward(self, x):
        return super().forward(x), None


class TinyMegatronLM(nn.Module):
    """Called like GPTModel; one causal mixing step, then fc1/fc2 wrapped like bridge's LoRA."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.decoder = nn.Module()
        layer = nn.Module()
        layer.layer_number = 1  # megatron-core's 1-based global layer number
        layer.mlp = nn.Module()
        layer.mlp.linear_fc1 = TupleLinear(hidden, 2 * hidden, bias=False)
        layer.mlp.linear_fc2 = TupleLinear(hidden, hidden, bias=False)
        self.decoder.layers = nn.ModuleList([layer])
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, attention_mask):
        assert attention_mask.dtype == torch.bool and attention_mask.shape[-1] == input_ids.shape[1]
        h = self.embedding(input_ids)
        n = torch.arange(1, h.shape[1] + 1).view(1, -1, 1)
        h = h.cumsum(1) / n  # causal: position t sees tokens <= t only
        mlp = self.decoder.layers[0].mlp
        gate, up = mlp.linear_fc1(h)[0].chunk(2, dim=-1)
        h = h + mlp.linear_fc2(torch.nn.functional.silu(gate) * up)[0]
        return self.output_layer(h)


def _groups(vocab=32):
    g = torch.Generator().manual_seed(3)

    def completion(reward):
        n = int(torch.randint(3, 7, (1,), generator=g))
        return Completion(
            token_ids=torch.randint(0, vocab, (n,), generator=g).tolist(),
            logprobs=[-3.4] * n,
            versions=[1] * n,
            reward=reward,
        )

    return [
        Trajectory(
            run="r",
            trajectory_id=f"t{i}",
            grant_id="g",
            replica="x",
            prompt_id="p",
            prompt_token_ids=[1, 2, 3],
            completions=[completion(1.0), completion(0.0), completion(1.0), completion(0.0)],
            started_at=0.0,
            finished_at=1.0,
        )
        for i in range(2)
    ]


@pytest.mark.parametrize(
    "variant",
    [{}, {"importance_sampling_level": "sequence"}, {"use_sapo_loss": True, "use_decoupled_loss": False}],
    ids=["ppo", "gspo", "sapo"],
)
def test_train_step_takes_a_real_gradient_step_on_adapter_only(variant):
    torch.manual_seed(0)
    model = TinyMegatronLM()
    attach_lora(model, rank=4, alpha=8.0, targets=("linear_fc1", "linear_fc2"))
    named = adapter_named_parameters(model.named_parameters())
    assert {n.rsplit(".", 2)[-2] for n, _ in named} == {"linear_in", "linear_out"}
    base_before = {n: p.clone() for n, p in model.named_parameters() if ".adapter." not in n}
    out_before = {n: p.clone() for n, p in named if "linear_out" in n}
    assert all(float(p.abs().max()) == 0.0 for p in out_before.values())  # B starts at zero
    opt = MasterAdapterOptimizer(named, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    ppo = msgspec.structs.replace(PPOConfig(), ppo_n_minibatches=2, **variant)
    stats = train_step(model, opt, _groups(), head_version=2, ppo=ppo, max_tokens=16)
    assert stats.tokens == sum(len(c.token_ids) for g in _groups() for c in g.completions)
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
    assert stats.loss_stats["mean_staleness"] == pytest.approx(1.0)
    for n, p in model.named_parameters():
        if ".adapter." not in n:
            assert torch.equal(p, base_before[n]), f"{n} (frozen base) changed"
    assert any(float(p.abs().max()) > 0 for n, p in named if "linear_out" in n)


def test_train_step_reports_the_train_inference_mismatch():
    """Every trained token counted once, k3 of the model's own logprobs before the update
    against the behaviour's, as the FSDP2 engine reports it (services/trainer/mismatch.py)."""
    from services.trainer.engines.megatron.step import causal_mask

    torch.manual_seed(0)
    model = TinyMegatronLM()
    attach_lora(model, rank=4, alpha=8.0, targets=("linear_fc1", "linear_fc2"))
    opt = MasterAdapterOptimizer(adapter_named_parameters(model.named_parameters()), _adam)
    groups, k3 = _groups(), []
    with torch.no_grad():
        for g in groups:
            for c in g.completions:
                ids = torch.tensor([g.prompt_token_ids + c.token_ids])
                logits = model(ids, torch.arange(ids.shape[1])[None], causal_mask(ids.shape[1], "cpu"))
                lp = torch.log_softmax(logits[0, len(g.prompt_token_ids) - 1 : -1].double(), -1)
                r = lp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0] - torch.tensor(c.logprobs).double()
                k3 += (torch.expm1(r) - r).tolist()
    stats = train_step(model, opt, groups, head_version=1, ppo=PPOConfig(), max_tokens=16)
    m = stats.mismatch
    assert m is not None and m.on_policy is not None and m.refused_groups == 0
    assert m.all_tokens.tokens == m.on_policy.tokens == len(k3) == stats.tokens
    assert m.all_tokens.kl_mean == pytest.approx(sum(k3) / len(k3), rel=1e-6)
    assert m.all_tokens.kl_max == pytest.approx(max(k3), rel=1e-6)
    assert len(stats.group_kl) == len(groups) and all(kl > 0 for kl in stats.group_kl)
    # tokens of an older version are no longer on-policy
    later = train_step(model, opt, groups, head_version=2, ppo=PPOConfig(), max_tokens=16).mismatch
    assert later is not None and later.on_policy is None and later.all_tokens.tokens == len(k3)


def test_benchmark_cpu_check_passes(tmp_path):
    assert bench.main(["--cpu-check", "--out", str(tmp_path)]) == 0


# --- `python -m services.trainer` on the Megatron backend ------------------------------------

ENGINE_MODULE = "services.trainer.engines.megatron.engine"


class FakeBridgeLoRA:
    """megatron-bridge's `LoRA` transform as far as the engine uses it: `dim`, not `rank`."""

    def __init__(self, target_modules: list[str], dim: int, alpha: float, dropout: float):
        self.target_modules, self.dim, self.alpha, self.dropout = target_modules, dim, alpha, dropout

    def __call__(self, chunks: list[nn.Module], training: bool) -> list[nn.Module]:
        for chunk in chunks:
            attach_lora(chunk, rank=self.dim, alpha=self.alpha, targets=tuple(self.target_modules))
        return chunks


class FakeProvider:
    """`bridge.to_megatron_provider(...)`: takes the parallel settings, builds a CPU model."""

    def finalize(self) -> None:
        pass

    def provide_distributed_model(self, wrap_with_ddp: bool, **precision: bool) -> list[nn.Module]:
        return [TinyMegatronLM(vocab=32, hidden=16)]


class FakeAutoBridge:
    def __init__(self) -> None:
        from transformers import Qwen2Config

        config = Qwen2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        self.hf_pretrained = type("HF", (), {"config": config})()

    @classmethod
    def from_hf_pretrained(cls, path: str, **kwargs: object) -> FakeAutoBridge:
        return cls()

    def to_megatron_provider(self, load_weights: bool) -> FakeProvider:
        return FakeProvider()


def _fake_megatron_modules() -> dict[str, types.ModuleType]:
    one_rank = {
        "get_tensor_model_parallel_group": None,
        "get_tensor_model_parallel_world_size": 1,
        "get_data_parallel_group": None,
        "get_data_parallel_rank": 0,
        "get_data_parallel_world_size": 1,
        "get_model_parallel_group": None,
        "get_tensor_model_parallel_rank": 0,
        "get_pipeline_model_parallel_group": None,
        "get_pipeline_model_parallel_world_size": 1,
        "is_pipeline_last_stage": True,
        "get_pipeline_model_parallel_last_rank": 0,
        "get_expert_model_parallel_world_size": 1,
        "get_expert_model_parallel_rank": 0,
    }
    parallel_state = types.SimpleNamespace(**{k: (lambda v=v: v) for k, v in one_rank.items()})
    tensor_parallel = types.SimpleNamespace(vocab_parallel_cross_entropy=None)
    mods = {
        name: types.ModuleType(name)
        for name in (
            "megatron",
            "megatron.core",
            "megatron.core.pipeline_parallel",
            "megatron.bridge",
            "megatron.bridge.peft",
            "megatron.bridge.peft.lora",
            "megatron.bridge.models",
            "megatron.bridge.models.gpt_provider",
        )
    }
    mods["megatron.core"].parallel_state = parallel_state  # type: ignore[attr-defined]
    mods["megatron.core"].tensor_parallel = tensor_parallel  # type: ignore[attr-defined]
    mods["megatron.core.pipeline_parallel"].get_forward_backward_func = lambda: None  # type: ignore[attr-defined]
    mods["megatron.bridge"].AutoBridge = FakeAutoBridge  # type: ignore[attr-defined]
    mods["megatron.bridge.peft.lora"].LoRA = FakeBridgeLoRA  # type: ignore[attr-defined]
    mods["megatron.bridge.models.gpt_provider"].local_layer_spec = lambda config: None  # type: ignore[attr-defined]
    return mods


@pytest.fixture
def fake_megatron(monkeypatch):
    """The Megatron engine module imported against fake megatron-core/-bridge modules, with its
    CUDA/NCCL set-up replaced by a one-rank CPU one; both are undone afterwards."""
    for name, mod in _fake_megatron_modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    pkg = importlib.import_module("services.trainer.engines.megatron")
    before = sys.modules.pop(ENGINE_MODULE, None)
    try:
        engine = importlib.import_module(ENGINE_MODULE)
        monkeypatch.setattr(engine, "init_megatron", lambda cfg: torch.device("cpu"))
        monkeypatch.setattr(engine, "dist", types.SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: 1))
        yield engine
    finally:
        sys.modules.pop(ENGINE_MODULE, None)
        pkg.__dict__.pop("engine", None)
        if before is not None:
            sys.modules[ENGINE_MODULE] = before


def test_megatron_trainer_main_gets_past_its_first_log_line(fake_megatron, tmp_path, monkeypatch, caplog):
    """The start-up line reads the adapter's shape through the engine contract (`lora_spec()`),
    not the backend's own LoRA object, which on Megatron has no `rank`."""
    import yaml

    from services.trainer import __main__ as trainer_main
    from services.trainer import service

    served = []

    async def run_rank0(cfg, engine, ckpt, initial, followers, canary=None) -> int:
        served.append((engine, ckpt, initial))
        return 0

    monkeypatch.setattr(service, "run_rank0", run_rank0)
    monkeypatch.setattr("services.common.entry.setup_logging", lambda *a, **k: None)  # keeps caplog's handler
    monkeypatch.setattr("services.common.metrics.start_metrics_server", lambda cfg: 9999)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    config = tmp_path / "trainer.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "m",
                "trial_name": "t",
                "run": "m",
                "run_dir": str(tmp_path / "run"),
                "actor": {
                    "backend": "megatron",
                    "path": "fake/qwen2",
                    "device": "cpu",
                    "dtype": "float32",
                    "lora_rank": R,
                    "lora_alpha": 8,
                    "target_modules": ["linear_fc1", "linear_fc2"],
                    "megatron": {"bridge_type": "megatron-bridge"},
                },
                "train_dataset": {"path": "builtin:arith", "reward_fn": "services.common.rewards:arith_reward"},
            }
        )
    )
    with caplog.at_level("INFO"):
        assert trainer_main.main(["--config", str(config)]) == 0
    [(engine, ckpt, initial)] = served
    assert isinstance(engine, fake_megatron.MegatronEngine) and ckpt is None
    assert sorted({adapter_io.parse_peft_key(k)[0].rsplit(".", 1)[-1] for k in initial}) == [
        "down_proj",
        "gate_proj",
        "up_proj",
    ]
    assert f"LoRA r={R} on down_proj,gate_proj,up_proj; cpu, world size 1" in caplog.text
