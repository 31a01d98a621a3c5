"""Megatron-bridge LoRA tensors -> Hugging Face PEFT tensors (dense Qwen2/Qwen3 and Qwen3 MoE).

Pure tensor code: no megatron import, so the Megatron trainer, the exporter and the rollouts
(XCCL path) share it, and the latter two convert without a Megatron environment. Which Megatron
layer fuses which HF modules, by name, is `services.common.lora_targets`'s. Input is the adapter
state of a model with tensor and pipeline parallel shards already gathered (tp = pp = 1 view);
expert-parallel shards are converted one rank at a time (`ModelShape.ep_rank`) and merged with
`merge_ep_shards`.

Megatron fuses what HF keeps apart, and its LoRA sits on the fused layers:

- `self_attention.linear_qkv`: output rows in per-group order. For each of the
  `num_query_groups` KV groups: that group's `q_per_group` query heads, then its key head, then
  its value head, each `head_dim` rows. B is viewed `[groups, q_per_group + 2, head_dim, r]`
  and split `[q_per_group, 1, 1]` on dim 1; HF query head `g * q_per_group + j` is row block
  `[g, j]`, so the reshape keeps HF's head order. A (the input side) is shared: copied to q, k, v.
- `self_attention.linear_proj` -> `self_attn.o_proj` (one to one).
- `mlp.linear_fc1`: output `[2 * ffn]` = gate rows then up rows; B is `chunk(2, dim=0)`, A copied.
- `mlp.linear_fc2` -> `mlp.down_proj`.
- MoE experts, two schemes megatron-bridge produces:
  grouped `mlp.experts.linear_fc{1,2}.adapter.linear_{in,out}.weight` (one adapter shared by
  the rank's experts: replicated to each of them, i.e. to every `mlp.experts.{e}` when
  ep_size is 1; with ep_size > 1 Megatron reduces expert gradients only within the expert-data
  group, so each EP rank's copy belongs to its own experts), and per-expert
  `mlp.experts.linear_fc{1,2}.adapter.linear_{in,out}.weight{idx}` with a rank-local `idx`
  (global expert = idx + ep_rank * num_experts / ep_size). A model built from megatron-core's
  local layer spec (no Transformer Engine) has a SequentialMLP instead, whose experts are
  separate linears: `mlp.experts.local_experts.{idx}.linear_fc{1,2}.adapter.linear_{in,out}.weight`,
  the per-expert scheme under another name (same rank-local `idx`).

`adapter.linear_in` is LoRA A `[r, in]`, `adapter.linear_out` is LoRA B `[out, r]`.

Output keys are PEFT-standard (`base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight`,
no `.default`). Experts are written per expert, transformers-4 style
(`model.layers.L.mlp.experts.{e}.gate_proj`), even though transformers 5.24's `Qwen3MoeExperts`
has no such modules: it stores all experts fused in 3-D parameters `mlp.experts.gate_up_proj`
`[E, 2 * moe_ffn, hidden]` (gate rows first) and `mlp.experts.down_proj` `[E, hidden, moe_ffn]`.
peft 0.21 loads per-expert adapters onto that model by itself (`peft.utils.
transformers_weight_conversion`: `target_modules` gate/up/down_proj become `target_parameters`
gate_up_proj/down_proj, the per-expert A's are stacked and the B's made block-diagonal), and the
per-expert form is also what vLLM reads, so it is the one interchange format. Verified in
`tests/unit/test_megatron_to_hf.py` against the merged-weight math.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from msgspec import Struct

from services.common.adapter_io import parse_peft_key, peft_key


class ModelShape(Struct, frozen=True, kw_only=True):
    """What the converter must know about the base model (and which expert shard it holds)."""

    num_layers: int
    hidden: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden: int
    num_experts: int = 0
    moe_ffn_hidden: int = 0
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_attention_heads", "num_query_groups", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                f"num_query_groups {self.num_query_groups}"
            )
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank: {self.ep_rank} must be in [0, ep_size={self.ep_size})")
        if self.num_experts and self.num_experts % self.ep_size:
            raise ValueError(f"ep_size: {self.ep_size} does not divide num_experts {self.num_experts}")

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any] | Any, *, ep_size: int = 1, ep_rank: int = 0):
        """From a Qwen2/Qwen3 (dense or MoE) `config.json` dict or `PretrainedConfig`."""

        def get(name: str, default: Any = None) -> Any:
            value = cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)
            return default if value is None else value

        model_type = get("model_type", "")
        if not str(model_type).startswith(("qwen2", "qwen3")):
            raise ValueError(
                f"model_type: {model_type!r} is not a Qwen2/Qwen3 config; the Megatron layout "
                "conversion is written for those only"
            )
        if get("shared_expert_intermediate_size"):
            raise ValueError(
                "shared_expert_intermediate_size: models with shared experts (Qwen2-MoE) are not "
                "supported by the converter; use a Qwen3 MoE or dense model"
            )
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            if get(name) is None:
                raise ValueError(f"{name}: missing from the model config")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        return cls(
            num_layers=int(get("num_hidden_layers")),
            hidden=hidden,
            num_attention_heads=heads,
            num_query_groups=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            ffn_hidden=int(get("intermediate_size", 0)),
            # the Hub's Qwen3-MoE config.json says num_experts; transformers 5 writes
            # num_local_experts (num_experts is an attribute alias there)
            num_experts=int(get("num_experts", get("num_local_experts", 0))),
            moe_ffn_hidden=int(get("moe_intermediate_size", 0)),
            ep_size=ep_size,
            ep_rank=ep_rank,
        )


class ConversionError(ValueError):
    pass


def target_modules_of(tensors: Iterable[str]) -> list[str]:
    """The `adapter_config.json` target_modules for converted keys: their module leaf names."""
    return sorted({parse_peft_key(key)[0].rsplit(".", 1)[-1] for key in tensors})


_NAME = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\."
    r"(?P<module>self_attention\.linear_qkv|self_attention\.linear_proj|mlp\.linear_fc1|"
    r"mlp\.linear_fc2|mlp\.experts\.linear_fc1|mlp\.experts\.linear_fc2|"
    r"mlp\.experts\.local_experts\.(?P<sequential>\d+)\.linear_fc[12])"
    r"\.adapter\.linear_(?P<side>in|out)\.weight(?P<expert>\d*)$"
)
_WRAPPERS = ("module.",)
"""DDP / Float16Module wrap the model as `.module`; their prefixes carry no meaning here."""


def _strip_wrappers(name: str) -> str:
    while name.startswith(_WRAPPERS):
        name = name[len("module.") :]
    return name


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    ok = tensor.dim() == len(expected) and all(e is None or s == e for s, e in zip(tensor.shape, expected))
    if not ok:
        want = "[" + ", ".join("r" if e is None else str(e) for e in expected) + "]"
        raise ConversionError(f"{name}: shape {list(tensor.shape)} does not match {want}")


def _split_qkv(name: str, b: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, ...]:
    qpg, groups, hd = shape.q_per_group, shape.num_query_groups, shape.head_dim
    _check_shape(name, b, ((qpg + 2) * groups * hd, None))
    rank = b.shape[1]
    grouped = b.view(groups, qpg + 2, hd, rank)
    q, k, v = torch.split(grouped, [qpg, 1, 1], dim=1)
    return tuple(part.reshape(-1, rank).clone() for part in (q, k, v))


def convert(state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Megatron-bridge LoRA state (one EP rank's) -> PEFT-standard tensors.

    Every input tensor must be recognised and have the shape `shape` implies; anything else
    raises `ConversionError` naming the tensor."""
    pairs: dict[tuple[int, str, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for raw_name, tensor in state.items():
        name = _strip_wrappers(raw_name)
        m = _NAME.match(name)
        if not m:
            raise ConversionError(
                f"{raw_name}: not a megatron-bridge LoRA tensor this converter knows; expected "
                "decoder.layers.<L>.{self_attention.linear_qkv|self_attention.linear_proj|"
                "mlp.linear_fc1|mlp.linear_fc2|mlp.experts.linear_fc1|mlp.experts.linear_fc2|"
                "mlp.experts.local_experts.<e>.linear_fc1|...linear_fc2}.adapter.linear_{in|out}.weight[<expert>]"
            )
        layer = int(m["layer"])
        if layer >= shape.num_layers:
            raise ConversionError(f"{raw_name}: layer {layer} is beyond the model's num_layers {shape.num_layers}")
        module, expert = m["module"], m["expert"]
        if expert and not module.startswith("mlp.experts."):
            raise ConversionError(f"{raw_name}: only expert tensors carry an expert index")
        if m["sequential"] is not None:
            if expert:
                raise ConversionError(f"{raw_name}: a SequentialMLP expert carries no weight index")
            # SequentialMLP's rank-local expert index: the same meaning as `weight<idx>`
            module, expert = "mlp.experts." + module.rsplit(".", 1)[-1], m["sequential"]
        side = "A" if m["side"] == "in" else "B"
        pairs.setdefault((layer, module, expert), {})[side] = (raw_name, tensor)

    out: dict[str, torch.Tensor] = {}
    for (layer, module, expert), sides in sorted(pairs.items()):
        missing = {"A", "B"} - sides.keys()
        if missing:
            present = next(iter(sides.values()))[0]
            raise ConversionError(
                f"{present}: its LoRA {'A (linear_in)' if 'A' in missing else 'B (linear_out)'} "
                "partner is missing from the state"
            )
        a_name, a = sides["A"]
        b_name, b = sides["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ConversionError(
                f"{b_name}: LoRA B {list(b.shape)} and A {list(a.shape)} are not [out, r] and [r, in]"
            )
        for key, tensor in _convert_module(layer, module, expert, a_name, a, b_name, b, shape):
            if key in out:
                raise ConversionError(f"{b_name}: produces {key}, which another tensor already did")
            out[key] = tensor
    return out


def _convert_module(layer, module, expert, a_name, a, b_name, b, shape: ModelShape):
    prefix = f"model.layers.{layer}"
    if module == "self_attention.linear_qkv":
        _check_shape(a_name, a, (None, shape.hidden))
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), _split_qkv(b_name, b, shape)):
            yield from _pair(f"{prefix}.self_attn.{proj}", a, part)
    elif module == "self_attention.linear_proj":
        _check_shape(a_name, a, (None, shape.num_attention_heads * shape.head_dim))
        _check_shape(b_name, b, (shape.hidden, None))
        yield from _pair(f"{prefix}.self_attn.o_proj", a, b)
    elif module == "mlp.linear_fc1":
        _check_shape(a_name, a, (None, shape.hidden))
        _check_shape(b_name, b, (2 * shape.ffn_hidden, None))
        gate, up = b.chunk(2, dim=0)
        yield from _pair(f"{prefix}.mlp.gate_proj", a, gate)
        yield from _pair(f"{prefix}.mlp.up_proj", a, up)
    elif module == "mlp.linear_fc2":
        _check_shape(a_name, a, (None, shape.ffn_hidden))
        _check_shape(b_name, b, (shape.hidden, None))
        yield from _pair(f"{prefix}.mlp.down_proj", a, b)
    else:
        if not shape.num_experts:
            raise ConversionError(f"{b_name}: an expert tensor, but the model shape has num_experts 0 (not MoE)")
        if expert:
            local = int(expert)
            if local >= shape.experts_per_rank:
                raise ConversionError(
                    f"{b_name}: local expert {local} is beyond num_experts / ep_size = {shape.experts_per_rank}"
                )
            experts = [local + shape.ep_rank * shape.experts_per_rank]
        else:
            first = shape.ep_rank * shape.experts_per_rank
            experts = list(range(first, first + shape.experts_per_rank))
        ffn = shape.moe_ffn_hidden
        if module == "mlp.experts.linear_fc1":
            _check_shape(a_name, a, (None, shape.hidden))
            _check_shape(b_name, b, (2 * ffn, None))
            gate, up = b.chunk(2, dim=0)
            for e in experts:
                yield from _pair(f"{prefix}.mlp.experts.{e}.gate_proj", a, gate)
                yield from _pair(f"{prefix}.mlp.experts.{e}.up_proj", a, up)
        else:
            _check_shape(a_name, a, (None, ffn))
            _check_shape(b_name, b, (shape.hidden, None))
            for e in experts:
                yield from _pair(f"{prefix}.mlp.experts.{e}.down_proj", a, b)


def _pair(module_path: str, a: torch.Tensor, b: torch.Tensor):
    # Clones: the same A feeds several HF modules, and safetensors refuses shared storage.
    yield peft_key(module_path, "A"), a.clone()
    yield peft_key(module_path, "B"), b.contiguous().clone()


def merge_ep_shards(shards: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Convert each expert-parallel rank's state (`shards[i]` from rank i) and merge them.

    Expert tensors of different ranks are disjoint; everything else is replicated across EP
    ranks and must agree."""
    if len(shards) != shape.ep_size:
        raise ConversionError(f"shards: got {len(shards)}, ep_size is {shape.ep_size}")
    merged: dict[str, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        fields = {f: getattr(shape, f) for f in shape.__struct_fields__}
        converted = convert(shard, ModelShape(**{**fields, "ep_rank": rank}))
        for key, tensor in converted.items():
            if key in merged and (".mlp.experts." in key or not torch.equal(merged[key], tensor)):
                raise ConversionError(
                    f"{key}: EP rank {rank} disagrees with an earlier rank (experts must be "
                    "disjoint, replicated tensors equal); check each shard's rank"
                )
            merged[key] = tensor
    return merged
