"""Serve several LoRA versions of one adapter from one base model, with the head merged.

(`merge_head` False keeps W = W0 and corrects every row, the head's too: the unmerged baseline.)

Why not peft: peft's `load_adapter` allocates new modules per version (~0.7 s for 37 MB on an
H200) and its unmerged forward adds two small matmuls per target module for every row (0.64x
base tokens/s; two versions mixed in a batch, 0.13x). Here:

- Every target `nn.Linear` becomes a `SlotLinear` holding preallocated slot tensors, so loading
  a version is an in-place copy into a free slot: no module surgery after the first load, and a
  handful of ops for the whole model (one multi-tensor copy of the A's; per group shape, one cat
  of the B's and one transposing multiply into the B^T slots those groups share).
- The head version (the newest loaded) is merged into the layer's weight, W = W0 + s_h B_h A_h,
  so a batch entirely on the head costs what the base model costs.
- Rows pinned to an older version v need y += s_v x A_v^T B_v^T - s_h x A_h^T B_h^T. All slots
  are stacked (A as `a[S, r, in]`, pre-scaled B^T as `bt[S, r, out]`), so for the whole batch
      y += ((x @ A_all^T) * C) @ Bt_all
  with C a per-row sign mask over the slot blocks: +1 on the row's slot, -1 on the head's slot,
  0 elsewhere (all zeros for rows on the head). The routing is data (C), not Python control
  flow: a CUDA graph captured once per batch size serves every mix, and a head change only
  rewrites C.
- Siblings that read the same input (q/k/v, gate/up: Megatron's fused layers) form one
  `SlotGroup`: one matmul for their base outputs and one correction for all of them
  (`lora_kernels`). The group keeps its slots' A rows under its weight in one buffer, so on a
  GPU the default ("stacked") gets x @ W^T and x @ A^T from that one matmul and adds the masked
  expand with one small kernel, which writes a new contiguous output (a column view of the
  matmul would send the residual add after o_proj/down_proj to torch's strided kernel, 2.2x
  slower on an H100): a decoder layer puts 4 matmuls + 4 expands on the critical path
  (0.93x the graph base on the H200 for mixed batches; 0.88x with the shrink as a second kernel
  on a side stream, 0.78x with three small kernels per module). Inside `deferred` a group
  returns its output uncorrected and hands the correction (`lora_kernels.Pending`) to the
  kernel that reads the output next (`decoder_layer`: o_proj's to the fused add and norm,
  down_proj's to the last add, gate/up's to the SwiGLU), which leaves q/k/v's expand as the one
  extra launch a layer. The other corrections (`lora_kernels.Mode`) stay selectable and are
  tested against the same reference.
- Re-merging on a head change recomputes W from a pristine copy W0, so there is no drift
  however many versions pass: one batched matmul per member of each group shape, over every
  layer at once (`ShapeBuffers.merge`: 7 for a Qwen model, not one per module). Memory cost:
  one extra copy of every targeted weight (Qwen2.5-1.5B all-linear: ~1.31 G params, 2.6 GB in
  bf16), plus the slots: slots x (LoRA params) (37 MB adapter, 4 slots: 0.15 GB).

Thread safety: none here. The engine serialises forward steps, loads and head changes with
one lock, which makes a head swap atomic with respect to decode steps.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from services.common.lora_targets import HF_TO_MEGATRON
from services.rollout import lora_kernels, lora_merge
from services.rollout.versions import SlotTable

_PEFT_PREFIX = "base_model.model."


class Routing:
    """What every SlotGroup of a model reads during a forward: the sign mask C ([batch,
    slots * rank], or None when every row is on the head; set around each forward by
    `LoraSlots.route`), which correction captured graphs (and CPU forwards) run
    (`lora_kernels.Correction`), and the side stream the two-kernel path's shrinks run on."""

    __slots__ = ("cols", "correction", "_side")

    def __init__(self, correction: lora_kernels.Mode) -> None:
        self.cols: torch.Tensor | None = None
        self.correction: lora_kernels.Mode = correction
        self._side: torch.cuda.Stream | None = None

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side


class ShapeBuffers:
    """The storage of every SlotGroup of one shape (each layer's q/k/v, say), one block per
    group, so that a load or a merge treats all of them with a few ops instead of a few per
    module (~400 launches for a Qwen model, where each launch costs more than its bytes):
    - `stacked [groups, N + G*S*r, in]`: the live weights, each group's slots' A rows under them;
    - `bias [groups, N + G*S*r]` or None, laid out alike;
    - `bt [groups, S, r, N]`: the slots' pre-scaled B^T;
    - `pristine [groups, N, in]`: W0, the copy every merge starts from (`keep_pristine`, once the
      replaced layers are gone, so that the old weights and the copy never coexist).
    Each group's block is contiguous and shaped as a group of its own would be."""

    def __init__(
        self,
        groups: int,
        segs: list[int],
        in_features: int,
        slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool,
    ):
        self.segs, self.in_features, self.slots, self.rank = segs, in_features, slots, rank
        self.paths: list[str] = []
        """the target paths in (group, member) order: the order of the cat in `load_b`"""
        n, width = segs[-1], (len(segs) - 1) * slots * rank
        self.stacked = torch.empty(groups, n + width, in_features, dtype=dtype, device=device)
        self.stacked[:, n:].zero_()
        self.bias = torch.zeros(groups, n + width, dtype=dtype, device=device) if bias else None
        self.bt = torch.zeros(groups, slots, rank, n, dtype=dtype, device=device)
        self.pristine = torch.empty(0, dtype=dtype, device=device)

    def keep_pristine(self) -> None:
        self.pristine = self.stacked[:, : self.segs[-1]].clone()

    def load_b(self, bs: Sequence[torch.Tensor], slot: int, scale: float) -> None:
        """Slot `slot`'s B^T of every group from `bs` ([out, r] each, in `paths` order), scaled
        by `scale` in their precision and rounded once. Host tensors are cat on the device."""
        device = self.bt.device
        b = torch.cat([t if t.device == device else t.to(device, non_blocking=True) for t in bs])
        torch.mul(b.view(self.bt.shape[0], self.segs[-1], self.rank).transpose(1, 2), scale, out=self.bt[:, slot])

    def clear(self, slot: int) -> None:
        n, span = self.segs[-1], self.rank
        for member in range(len(self.segs) - 1):
            lo = n + (member * self.slots + slot) * span
            self.stacked[:, lo : lo + span].zero_()
        self.bt[:, slot].zero_()

    def merge(self, slot: int | None, kernel: bool = False) -> None:
        """W = W0 + B^T_slot^T A_slot for every group, member by member (W = W0 for None):
        one batched matmul over the groups each (`lora_merge.merge_`), always from W0, so
        nothing drifts."""
        n = self.segs[-1]
        if slot is None:
            self.stacked[:, :n].copy_(self.pristine)
            return
        for member, (lo, hi) in enumerate(itertools.pairwise(self.segs)):
            a = n + (member * self.slots + slot) * self.rank
            lora_merge.merge_(
                self.stacked[:, lo:hi],
                self.pristine[:, lo:hi],
                self.bt[:, slot, :, lo:hi].transpose(1, 2),
                self.stacked[:, a : a + self.rank],
                kernel=kernel,
            )


class SlotGroup:
    """Sibling layers that read the same input (q/k/v, gate/up; or one layer alone), fused:
    one live weight [N, in] whose row blocks are the members' weights, one pristine copy, and
    their slots side by side (`a [members, slots, rank, in]`, `bt [slots, rank, N]`).

    The first member called with an input computes every member's output with one matmul and
    one correction and keeps it; its siblings called with the same tensor take their columns
    of it. A member called with another tensor (or twice) recomputes the group: slower, never
    wrong."""

    def __init__(self, bases: Sequence[nn.Linear], buffers: ShapeBuffers, index: int, routing: Routing):
        """Copies the bases' weights into block `index` of `buffers` (their shape's storage)."""
        self.buffers, self.index = buffers, index
        self.in_features = buffers.in_features
        self.routing = routing
        self.segs = buffers.segs
        n = self.segs[-1]
        if [b.out_features for b in bases] != [hi - lo for lo, hi in itertools.pairwise(self.segs)]:
            raise ValueError(f"bases: out features {[b.out_features for b in bases]} do not fit segments {self.segs}")
        # W and every slot's A rows in one [N + G * S * r, in] buffer: the "stacked" correction
        # gets x @ W^T and the shrink x @ A^T from one matmul (views, so loads and merges are
        # unchanged)
        self._stacked = buffers.stacked[index]
        self._stacked_bias = None if buffers.bias is None else buffers.bias[index]
        for base, lo, hi in zip(bases, self.segs, self.segs[1:]):
            self._stacked[lo:hi].copy_(base.weight.detach())
            if self._stacked_bias is not None:
                self._stacked_bias[lo:hi].copy_(base.bias.detach())
        self.weight = self._stacked[:n]
        self.bias = None if self._stacked_bias is None else self._stacked_bias[:n]
        slots, rank = buffers.slots, buffers.rank
        self.a = self._stacked[n:].view(len(bases), slots, rank, self.in_features)
        self.bt = buffers.bt[index]
        self._a_all = self.a.view(-1, self.in_features)
        self._bt_all = self.bt.view(slots * rank, n)
        self._segs_dev = torch.tensor(self.segs, dtype=torch.int32, device=self.weight.device)
        self._pending: tuple[torch.Tensor, torch.Tensor, set[int]] | None = None
        self.late: Late | None = None
        """set by `deferred` around the code that consumes a lone member's output"""

    @property
    def w0(self) -> torch.Tensor:
        """[N, in]: the pristine weights (set once the pool has replaced every layer)."""
        return self.buffers.pristine[self.index]

    @staticmethod
    def fusable(bases: Sequence[nn.Linear]) -> bool:
        w = bases[0].weight
        return all(
            b.in_features == w.shape[1]
            and b.weight.dtype == w.dtype
            and b.weight.device == w.device
            and (b.bias is None) == (bases[0].bias is None)
            for b in bases
        )

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        pending = self._pending
        if pending is None or pending[0] is not x or member not in pending[2]:
            pending = self._pending = (x, self._forward(x), set(range(len(self.segs) - 1)))
        pending[2].discard(member)
        if not pending[2]:
            self._pending = None
        return pending[1][..., self.segs[member] : self.segs[member + 1]]

    def forget(self) -> None:
        self._pending = None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        cols = self.routing.cols
        if cols is None:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        n, groups = self.segs[-1], len(self.segs) - 1
        # rows of x are (batch row, position) pairs: the mask is per batch row
        per_row = x2.shape[0] // cols.shape[0]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        mode = self.routing.correction
        if x.is_cuda and not capturing:
            # eager on a GPU: a Triton launch costs ~20 us of Python, more than the work it replaces
            mode = "torch"
        choice = lora_kernels.choose(mode, (x2.shape[0], n, self.in_features, groups, cols.shape[1]))
        if isinstance(choice, lora_kernels.FusedConfig):
            y2 = lora_kernels.linear_fused(x2, self.weight, self.bias, self._a_all, self._bt_all, self._segs_dev,
                                           cols, per_row, choice)  # fmt: skip
            return y2.view(*x.shape[:-1], n)
        if choice == "stacked":
            return self._forward_stacked(x, x2, cols, per_row)
        correction = choice
        kernel = correction == "triton"
        # In a captured graph the shrink reads only x, so it runs on a side stream beside the
        # layer's matmul; only the expand waits for both.
        streams = (torch.cuda.current_stream(), self.routing.side_stream(x.device)) if capturing else None
        if streams is not None:
            streams[1].wait_stream(streams[0])
        with torch.cuda.stream(streams[1]) if streams is not None else contextlib.nullcontext():
            if kernel:
                t = lora_kernels.shrink_kernel(x2, self._a_all, cols, per_row, groups)
            else:
                t = lora_kernels.shrink_reference(x2, self._a_all, cols, per_row)
        y = F.linear(x, self.weight, self.bias)
        if streams is not None:
            streams[0].wait_stream(streams[1])
        y2 = y.view(-1, n)
        if kernel:
            lora_kernels.expand_kernel_(y2, t, self._bt_all, self._segs_dev, cols, per_row)
        else:
            lora_kernels.expand_reference_(y2, t, self._bt_all, self.segs)
        return y

    def _forward_stacked(self, x: torch.Tensor, x2: torch.Tensor, cols: torch.Tensor, per_row: int) -> torch.Tensor:
        """One matmul gives y and the unmasked shrink side by side; the expand writes y plus the
        masked correction to a contiguous [..., N] output, as the head-only F.linear returns
        (`lora_kernels.expand_stacked` says why). Inside `deferred`, a lone member returns y as
        it is (a column view) and leaves the correction to whoever reads y next."""
        n = self.segs[-1]
        ya = F.linear(x2, self._stacked, self._stacked_bias)
        y = ya[:, :n].view(*x.shape[:-1], n)
        pending = lora_kernels.Pending(y, ya[:, n:], cols, self._bt_all, per_row, self.buffers.rank, tuple(self.segs))
        if self.late is not None and lora_kernels.kernel_available(x.device, x.dtype):
            self.late.hold(pending)
            return y
        return pending.resolved()


class Late:
    """What a `deferred` block collects: the group's output without its correction, as a
    `lora_kernels.Pending` that whoever reads the output must resolve. At most one per block;
    `take` hands it over exactly once."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: lora_kernels.Pending | None = None

    def hold(self, pending: lora_kernels.Pending) -> None:
        if self._held is not None:
            raise RuntimeError("deferred: the layer ran twice in one block; its first output would stay uncorrected")
        self._held = pending

    def take(self, *outs: torch.Tensor) -> lora_kernels.Pending | None:
        """The correction that `outs`, the group's members' outputs in order (their column
        slices of the one output held), still lack, or None if they lack none. Anything else
        means the block computed on from an uncorrected tensor, which is refused rather than
        returned wrong."""
        pending, self._held = self._held, None
        if pending is None:
            return None
        members = [pending.y[..., lo:hi] for lo, hi in itertools.pairwise(pending.segs)]
        if len(outs) != len(members) or any(_view(a) != _view(b) for a, b in zip(outs, members)):
            raise RuntimeError(
                f"deferred: got {[tuple(o.shape) for o in outs]}, not the layer's outputs "
                f"{[tuple(m.shape) for m in members]}; their correction cannot be added to them"
            )
        return pending


def _view(t: torch.Tensor) -> tuple[int, torch.Size, tuple[int, ...]]:
    return t.data_ptr(), t.shape, t.stride()


@contextlib.contextmanager
def deferred(module: nn.Module) -> Iterator[Late]:
    """Run a block in which `module`'s group, if `module` is a LoRA slot layer, returns its
    outputs without the mixed rows' correction when the stacked kernel path would add it; the
    caller adds it with the kernel that reads the outputs next (`Late.take` gives it). A module
    of any other kind computes as always, and `take` gives None."""
    late = Late()
    group = module.group if isinstance(module, SlotLinear) else None
    if group is None:
        yield late
        return
    group.late = late
    try:
        yield late
    finally:
        group.late = None


class SlotLinear(nn.Module):
    """One target layer: a member of a SlotGroup, whose weight is a view of the group's."""

    def __init__(self, group: SlotGroup, member: int):
        super().__init__()
        self.group = group
        self.member = member
        lo, hi = group.segs[member], group.segs[member + 1]
        self.in_features, self.out_features = group.in_features, hi - lo
        self.rank = group.a.shape[2]
        # Views of the group's storage: merging writes into them in place (a captured CUDA
        # graph keeps reading the right weights after a head change).
        self.weight = nn.Parameter(group.weight[lo:hi], requires_grad=False)
        self.bias = None if group.bias is None else nn.Parameter(group.bias[lo:hi], requires_grad=False)

    @property
    def w0(self) -> torch.Tensor:
        """[out, in]: the pristine weight"""
        return self.group.w0[self.group.segs[self.member] : self.group.segs[self.member + 1]]

    @property
    def a(self) -> torch.Tensor:
        """[slots, rank, in]: slot s holds A_v (PEFT's lora_A layout)."""
        return self.group.a[self.member]

    @property
    def b(self) -> torch.Tensor:
        """[slots, out, rank]: slot s holds s_v * B_v (PEFT's lora_B layout, scaled)."""
        lo, hi = self.group.segs[self.member], self.group.segs[self.member + 1]
        return self.group.bt[:, :, lo:hi].transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.member)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, rank={self.rank}, slots={self.a.shape[0]}, "
            f"member {self.member} of {len(self.group.segs) - 1}"
        )


def fused_groups(paths: Sequence[str]) -> list[list[str]]:
    """Target paths grouped by the input they read: siblings that Megatron fuses into one
    layer (q/k/v, gate/up) share theirs; every other path is alone."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for path in sorted(paths):
        parent, _, leaf = path.rpartition(".")
        fused = HF_TO_MEGATRON.get(leaf)
        groups.setdefault((parent, fused) if fused else (path,), []).append(path)
    return list(groups.values())


def module_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT-layout tensors -> {module path: (A [r, in], B [out, r])}."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
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


class Place(NamedTuple):
    """Where a target layer sits: `parent.child` is `base`, at `path` in the model."""

    path: str
    parent: nn.Module
    child: str
    base: nn.Linear


def group_places(model: nn.Module, modules: Sequence[str]) -> list[list[Place]]:
    """The target layers of `model`, one list per SlotGroup to build: fused siblings together
    when their weights can share one buffer (`SlotGroup.fusable`), else one layer a group."""
    parts = []
    for paths in fused_groups(modules):
        places = []
        for path in paths:
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            base = getattr(parent, child, None)
            if not isinstance(base, nn.Linear):
                raise ValueError(
                    f"adapter targets {path!r}, which is {type(base).__name__} in the base model, "
                    "not nn.Linear: the adapter was made for a different model"
                )
            places.append(Place(path, parent, child, base))
        parts.extend([places] if SlotGroup.fusable([p.base for p in places]) else [[p] for p in places])
    return parts


def shape_of(part: Sequence[Place]) -> tuple[tuple[int, ...], int, torch.dtype, torch.device, bool]:
    """What groups must share to share `ShapeBuffers`: members' out features, in features,
    dtype, device, and whether they have a bias."""
    w = part[0].base.weight
    return tuple(p.base.out_features for p in part), w.shape[1], w.dtype, w.device, part[0].base.bias is not None


class LoraSlots:
    """The slot pool of one model: install once, then load/unload/set_head/route."""

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[str],
        rank: int,
        slots: int,
        correction: lora_kernels.Mode | None = None,
    ):
        self.rank = rank
        self.table = SlotTable(slots)
        self.routing = Routing("torch")
        self.head: int | None = None
        self.merge_head = True
        """whether the head is merged into the weights (the fast path); False: W stays W0 and
        every row, the head's too, runs its version's LoRA product (the native baseline of the
        train/inference mismatch, rollout.merge_head)"""
        self._scale: dict[int, float] = {}
        self.layers: dict[str, SlotLinear] = {}
        self.groups: list[SlotGroup] = []
        parts = group_places(model, modules)
        # Groups of one shape share their storage (`ShapeBuffers`): a load writes every B of a
        # shape with one cat and one transposing multiply, and a merge is one batched matmul per
        # member. The old weights go group by group as their layers are replaced, and W0 is
        # copied only then: the peak is the final footprint (W, W0, slots), not one more W.
        by_shape: dict[tuple[tuple[int, ...], int, torch.dtype, torch.device, bool], list[list[Place]]] = {}
        for part in parts:
            by_shape.setdefault(shape_of(part), []).append(part)
        self._shapes: list[ShapeBuffers] = []
        home: dict[int, tuple[ShapeBuffers, int]] = {}
        for (outs, in_features, dtype, device, bias), same in by_shape.items():
            segs = [0, *itertools.accumulate(outs)]
            buffers = ShapeBuffers(len(same), segs, in_features, slots, rank, dtype, device, bias)
            buffers.paths = [p.path for part in same for p in part]
            self._shapes.append(buffers)
            home.update({id(part): (buffers, i) for i, part in enumerate(same)})
        for part in parts:
            group = SlotGroup([p.base for p in part], *home.pop(id(part)), self.routing)
            self.groups.append(group)
            for member, place in enumerate(part):
                layer = SlotLinear(group, member)
                setattr(place.parent, place.child, layer)
                self.layers[place.path] = layer
            part.clear()  # the pool holds its own copy: the replaced weights can be freed now
        for buffers in self._shapes:
            buffers.keep_pristine()
        # A's slots are contiguous like the adapter's tensors, so one multi-tensor copy fills them
        layers = list(self.layers.values())
        self._a_of = [[l.a[s] for l in layers] for s in range(slots)]
        first = layers[0] if layers else None
        self._device = first.a.device if first else torch.device("cpu")
        self._dtype = first.a.dtype if first else torch.float32
        available = lora_kernels.kernel_available(self._device, self._dtype)
        if correction is None:
            correction = "auto" if available else "torch"
        elif correction not in ("torch", "stacked") and not available:
            raise ValueError(
                f"correction: {correction!r} needs Triton on a CUDA device in half precision (here "
                f"{self._device}, {self._dtype}); pass 'torch' or 'stacked', or leave it None"
            )
        self.routing.correction = correction
        self.merge_kernel = available and self._device.type == "cuda"
        """whether `set_head` merges with `lora_merge`'s one-pass Triton kernel instead of
        torch's baddbmm: on by default on a CUDA device in half precision, where it reads W0 and
        writes W once (H200, benchmarks/slot_swap.py --narrow 1: 1.65 ms against 5.14 ms);
        torch elsewhere (Triton's interpreter runs it on CPU only when a test asks)"""
        # One mask buffer per batch size, rewritten in place, so its address is stable for
        # CUDA graphs; `_cols_key` says what each one holds now.
        self._cols: dict[int, torch.Tensor] = {}
        self._cols_key: dict[int, tuple] = {}

    @classmethod
    def install(
        cls,
        model: nn.Module,
        tensors: dict[str, torch.Tensor],
        slots: int,
        correction: lora_kernels.Mode | None = None,
    ) -> LoraSlots:
        """Create slots shaped after the first adapter that arrives. `correction`: how mixed
        rows are corrected (None: "auto" where the Triton kernels run, see
        `lora_kernels.kernel_available`, else the torch reference)."""
        mods = module_tensors(tensors)
        if not mods:
            raise ValueError("adapter has no LoRA tensors")
        rank = next(iter(mods.values()))[0].shape[0]
        return cls(model, list(mods), rank, slots, correction)

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
            torch._foreach_copy_(self._a_of[slot], [mods[p][0] for p in paths], non_blocking=True)
            for buffers in self._shapes:
                buffers.load_b([mods[p][1] for p in buffers.paths], slot, scale)
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
        for buffers in self._shapes:
            buffers.clear(slot)

    @torch.no_grad()
    def set_head(self, version: int | None) -> None:
        """Merge `version` into every weight, from the pristine W0."""
        head_slot = None if version is None else self.table.slot_of(version)
        if self.merge_kernel and not lora_kernels.kernel_available(self._device, self._dtype):
            raise ValueError(
                f"merge_kernel: the Triton merge needs a CUDA device in half precision (here {self._device}, "
                f"{self._dtype}); leave merge_kernel False"
            )
        for buffers in self._shapes:
            buffers.merge(head_slot if self.merge_head else None, kernel=self.merge_kernel)
        self.head = version

    @property
    def merged(self) -> int | None:
        """The version merged into the weights (None: none is, W is W0)."""
        return self.head if self.merge_head else None

    # --- per forward ---
    @torch.no_grad()
    def columns(self, row_versions: Sequence[int]) -> torch.Tensor | None:
        """The sign mask C for rows on these versions ([rows, slots * rank], on the model's
        device), or None when every row is on the head. The returned tensor is this batch
        size's buffer: it is rewritten by the next call for the same size."""
        slot_of = {v: self.table.slot_of(v) for v in set(row_versions)}  # KeyError if not loaded
        merged = self.merged
        head_slot = None if merged is None else self.table.slot_of(merged)
        if all(v == merged for v in row_versions):
            return None
        n = len(row_versions)
        key = (tuple(row_versions), head_slot, tuple(sorted(slot_of.items())))
        buf = self._cols.get(n)
        if buf is None:
            # a normal tensor even when first made inside inference mode, so that forwards
            # outside it (no_grad) can still rewrite it in place
            with torch.inference_mode(False):
                buf = self._cols[n] = torch.zeros(
                    n, self.table.slots * self.rank, dtype=self._dtype, device=self._device
                )
        if self._cols_key.get(n) != key:
            signs = torch.zeros(n, self.table.slots, dtype=self._dtype)
            for row, v in enumerate(row_versions):
                if v != merged:
                    signs[row, slot_of[v]] = 1.0
                    if head_slot is not None:
                        signs[row, head_slot] = -1.0
            buf.copy_(signs.repeat_interleave(self.rank, dim=1))
            self._cols_key[n] = key
        return buf

    @contextlib.contextmanager
    def route(self, row_versions: Sequence[int]) -> Iterator[bool]:
        """Run one forward with each row on its version. Yields whether any row is corrected
        (the two cases are different CUDA graphs: rows all on the head run no correction)."""
        self.routing.cols = self.columns(row_versions)
        try:
            yield self.routing.cols is not None
        finally:
            self.routing.cols = None
            for group in self.groups:
                group.forget()
