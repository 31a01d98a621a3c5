"""Serve several LoRA versions of one adapter from one base model, with the head merged.

Why not peft: peft's `load_adapter` allocates new modules per version (~0.7 s for 37 MB on an
H200) and its unmerged forward adds two small matmuls per target module for every row (0.64x
base tokens/s; two versions mixed in a batch, 0.13x). Here:

- Every target `nn.Linear` becomes a `SlotLinear` holding preallocated slot tensors, so loading
  a version is an in-place `copy_` into a free slot: no allocation, no module surgery after the
  first load.
- The head version (the newest loaded) is merged into the layer's weight, W = W0 + s_h B_h A_h,
  so a batch entirely on the head costs exactly what the base model costs.
- Rows pinned to an older version v get a rank-2r correction on their rows only:
      y[rows] += x [A_v; A_h]^T [s_v B_v, -s_h B_h]^T = s_v x A_v^T B_v^T - s_h x A_h^T B_h^T
  Each slot stores that pair already stacked (A in `a[slot, :r]`, the head's A in
  `a[slot, r:]`, likewise B, pre-scaled and negated), so a correction is two GEMMs on a
  contiguous row range (the engine groups rows by version) and no gather/scatter.
- Re-merging on a head change recomputes W from a pristine copy `w0` with one fused `addmm`
  per module, so there is no drift however many versions pass. Memory cost: one extra copy of
  every targeted weight (Qwen2.5-1.5B all-linear: ~1.31 G params, 2.6 GB in bf16), plus the
  slots: slots x 2 x (LoRA params) (37 MB adapter, 4 slots: 0.3 GB).

Thread safety: none here. The engine serialises forward steps, loads and head changes with
one lock, which makes a head swap atomic with respect to decode steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.rollout.versions import SlotTable

_PEFT_PREFIX = "base_model.model."


class Routing:
    """Which rows of the current batch need a correction: (slot, first row, end row) spans.
    Shared by every SlotLinear of a model; set around each forward by `LoraSlots.route`."""

    __slots__ = ("spans", "batch")

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, int]] = []
        self.batch = 0


class SlotLinear(nn.Module):
    def __init__(self, base: nn.Linear, slots: int, rank: int, routing: Routing):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank = rank
        self.routing = routing
        # The live weight keeps the base Parameter's storage: merging writes into it in place.
        self.weight = base.weight
        self.bias = base.bias
        w = base.weight.detach()
        self.register_buffer("w0", w.clone(), persistent=False)
        self.register_buffer(
            "a", torch.zeros(slots, 2 * rank, self.in_features, dtype=w.dtype, device=w.device),
            persistent=False,
        )
        self.register_buffer(
            "b", torch.zeros(slots, self.out_features, 2 * rank, dtype=w.dtype, device=w.device),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        spans = self.routing.spans
        if not spans:
            return y
        x2 = x.reshape(-1, self.in_features)
        y2 = y.view(-1, self.out_features)
        per_row = x2.shape[0] // self.routing.batch
        for slot, lo, hi in spans:
            lo, hi = lo * per_row, hi * per_row
            t = x2[lo:hi] @ self.a[slot].T
            y2[lo:hi].addmm_(t, self.b[slot].T)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, slots={self.a.shape[0]}"


def module_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT-layout tensors -> {module path: (A [r, in], B [out, r])}."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        for which in ("A", "B"):
            for suffix in (f".lora_{which}.weight", f".lora_{which}.default.weight"):
                if name.endswith(suffix):
                    parts.setdefault(name[: -len(suffix)], {})[which] = value
                    break
            else:
                continue
            break
        else:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA A/B weight (PEFT layout)")
    out = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter module {module!r} has only lora_{''.join(ab)}; need A and B")
        out[module] = (ab["A"], ab["B"])
    return out


class LoraSlots:
    """The slot pool of one model: install once, then load/unload/set_head/route."""

    def __init__(self, model: nn.Module, modules: Sequence[str], rank: int, slots: int):
        self.rank = rank
        self.table = SlotTable(slots)
        self.routing = Routing()
        self.head: int | None = None
        self._scale: dict[int, float] = {}
        self.layers: dict[str, SlotLinear] = {}
        for path in sorted(modules):
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            base = getattr(parent, child, None)
            if not isinstance(base, nn.Linear):
                raise ValueError(
                    f"adapter targets {path!r}, which is {type(base).__name__} in the base model, "
                    "not nn.Linear: the adapter was made for a different model"
                )
            layer = SlotLinear(base, slots, rank, self.routing)
            setattr(parent, child, layer)
            self.layers[path] = layer
        # Views built once: a swap is then a handful of fused multi-tensor (`_foreach_*`)
        # calls plus one addmm per module, instead of thousands of small Python-side ops.
        r, layers = rank, list(self.layers.values())
        self._a_first = [[l.a[s, :r] for l in layers] for s in range(slots)]
        self._b_first = [[l.b[s, :, :r] for l in layers] for s in range(slots)]
        self._a_second = [l.a[:, r:] for l in layers]
        self._b_second = [l.b[:, :, r:] for l in layers]
        self._a_head_src = [[l.a[s, :r].expand_as(l.a[:, r:]) for l in layers] for s in range(slots)]
        self._b_head_src = [[l.b[s, :, :r].expand_as(l.b[:, :, r:]) for l in layers] for s in range(slots)]
        self._merge = [(l.w0, l.weight.data) for l in layers]

    @classmethod
    def install(cls, model: nn.Module, tensors: dict[str, torch.Tensor], slots: int) -> LoraSlots:
        """Create slots shaped after the first adapter that arrives."""
        mods = module_tensors(tensors)
        if not mods:
            raise ValueError("adapter has no LoRA tensors")
        rank = next(iter(mods.values()))[0].shape[0]
        return cls(model, list(mods), rank, slots)

    # --- versions ---
    def versions(self) -> list[int]:
        return self.table.versions()

    @torch.no_grad()
    def load(self, version: int, tensors: dict[str, torch.Tensor], scale: float) -> int:
        """Copy a version into a free slot (no allocation). Does not change the head."""
        mods = module_tensors(tensors)
        missing, extra = set(self.layers) - set(mods), set(mods) - set(self.layers)
        if missing or extra:
            raise ValueError(
                f"adapter v{version} targets other modules than the loaded slots: missing "
                f"{sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}; every version must share "
                "the LoRA target modules"
            )
        r = self.rank
        for path, (a, b) in mods.items():
            layer = self.layers[path]
            if a.shape != (r, layer.in_features) or b.shape != (layer.out_features, r):
                raise ValueError(
                    f"adapter v{version} {path}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                    f"do not fit rank {r} slots of {layer.in_features}->{layer.out_features}"
                )
        slot = self.table.assign(version)
        try:
            paths = list(self.layers)
            torch._foreach_copy_(self._a_first[slot], [mods[p][0] for p in paths], non_blocking=True)
            torch._foreach_copy_(self._b_first[slot], [mods[p][1] for p in paths], non_blocking=True)
            torch._foreach_mul_(self._b_first[slot], scale)
            self._refresh_head_halves()
        except BaseException:
            self.table.release(version)
            raise
        self._scale[version] = scale
        return slot

    @torch.no_grad()
    def unload(self, version: int) -> None:
        if version == self.head:
            raise ValueError(f"version {version} is the merged head; set another head first")
        slot = self.table.release(version)
        self._scale.pop(version, None)
        for layer in self.layers.values():
            layer.a[slot].zero_()
            layer.b[slot].zero_()

    @torch.no_grad()
    def set_head(self, version: int | None) -> None:
        """Merge `version` into every weight (from the pristine W0) and refresh the head half
        of every slot's correction pair."""
        head_slot = None if version is None else self.table.slot_of(version)
        if head_slot is None:
            torch._foreach_copy_([w for _, w in self._merge], [w0 for w0, _ in self._merge])
        else:
            for (w0, w), a, b in zip(self._merge, self._a_first[head_slot], self._b_first[head_slot]):
                torch.addmm(w0, b, a, out=w)
        self.head = version
        self._refresh_head_halves()

    def _refresh_head_halves(self) -> None:
        """Second half of every slot's pair: the head's A and -s_h B_h (zeros without a head)."""
        if self.head is None:
            torch._foreach_zero_(self._a_second)
            torch._foreach_zero_(self._b_second)
            return
        h = self.table.slot_of(self.head)
        torch._foreach_copy_(self._a_second, self._a_head_src[h])
        torch._foreach_copy_(self._b_second, self._b_head_src[h])
        torch._foreach_neg_(self._b_second)

    # --- per forward ---
    @contextlib.contextmanager
    def route(self, row_versions: Sequence[int]) -> Iterator[None]:
        """Run one forward with each row on its version: rows on the head need nothing,
        runs of consecutive rows on another version get one correction span each."""
        spans: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(row_versions) + 1):
            if i == len(row_versions) or row_versions[i] != row_versions[start]:
                v = row_versions[start]
                if v != self.head:
                    spans.append((self.table.slot_of(v), start, i))
                start = i
        self.routing.spans, self.routing.batch = spans, len(row_versions)
        try:
            yield
        finally:
            self.routing.spans, self.routing.batch = [], 0
