"""The adapter's on-disk and in-object-store form: the Hugging Face PEFT layout.

One format everywhere (object store, exporter, vLLM/SGLang adapter directories):
`adapter_model.safetensors` with keys `base_model.model.<module path>.lora_{A,B}.weight`
(no `.default` segment: vLLM rejects it) and `adapter_config.json` built from the event's
`LoraSpec`, so a receiver needs only the event and the one object.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from proto.messages import Dtype, LoraSpec

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_ADAPTER_SEGMENT = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_(A|B)\.weight$")

DTYPES: dict[Dtype, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> Dtype:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype: {dtype} is not one of {sorted(DTYPES)}")


def peft_key(module_path: str, which: str) -> str:
    """`model.layers.0.self_attn.q_proj`, "A" -> the PEFT-standard tensor key."""
    if which not in ("A", "B"):
        raise ValueError(f"which: {which!r} must be 'A' or 'B'")
    return f"{PEFT_PREFIX}{module_path}.lora_{which}.weight"


def parse_peft_key(key: str) -> tuple[str, str]:
    """The inverse of `peft_key`: (module path, "A" | "B")."""
    m = _KEY.match(key)
    if not m:
        raise ValueError(f"{key!r} is not a PEFT LoRA key (base_model.model.<module>.lora_A|B.weight)")
    return m.group(1), m.group(2)


def standardize_key(key: str) -> str:
    """Drop the adapter-name segment peft uses in memory (`lora_A.default.weight`)."""
    key = _ADAPTER_SEGMENT.sub(lambda m: f".lora_{m.group(1)}.weight", key)
    return key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key


def adapter_config(lora: LoraSpec) -> dict:
    """The `adapter_config.json` that `peft.PeftModel.from_pretrained` accepts."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": lora.base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _safetensors_layout(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """The safetensors header (length prefix included) and the tensors in file order: sorted
    names, data packed without gaps, header padded with spaces to 8 bytes (the format's own
    alignment). Written here rather than by `safetensors.torch.save` so the bytes can be
    streamed into a file or a preallocated buffer with one copy per tensor (save: ~43 ms for
    37 MB; this: one memcpy)."""
    header: dict[str, dict] = {}
    ordered, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name]  # read as it is (`host_bytes`): detach() too would wait for the GIL
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not one of {sorted(DTYPES)}")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        ordered.append(t)
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ordered


def host_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A tensor's bytes on the host, and the tensor whose memory they are (the caller keeps it
    alive while it reads them). A contiguous CPU tensor's are its memory as it is, reached
    through no torch call: each (`reshape`, `view`, `numpy`) releases the GIL and waits to get
    it back, ~2 ms a tensor beside a thread busy in Python, which is what the trainer's step
    thread is while a step's adapter is serialised (35 MB: 1.37 s so). Any other tensor is
    copied to a contiguous CPU one first."""
    if not (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()):
        t = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b""), t
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B"), t


def to_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Serialize with sorted keys so the same weights always give the same sha256."""
    head, ordered = _safetensors_layout(tensors)
    parts = [host_bytes(t) for t in ordered]  # the tensors kept alive until the join has read them
    return b"".join([head, *(view for view, _ in parts)])


def serialize_into(tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """`to_bytes(tensors)` written into `out` (a CPU uint8 tensor of at least that many bytes,
    reused across versions); returns the view of `out` that holds them.

    What `to_bytes` costs beside the copy is the GIL and first-touch page faults of a fresh
    37 MB `bytes` (~25 ms at 37 MB, all of it holding the GIL): here the memory is warm and
    the copies are torch copies, which release the GIL, one per run of tensors that lie back
    to back in one storage (XCCL send buckets: usually one per bucket)."""
    head, ordered = _safetensors_layout(tensors)
    size = len(head) + sum(t.numel() * t.element_size() for t in ordered)
    if out.dtype != torch.uint8 or out.device.type != "cpu" or out.dim() != 1 or out.numel() < size:
        raise ValueError(f"out: {out.dtype} {tuple(out.shape)} on {out.device}; a CPU uint8 buffer of {size} bytes")
    out = out[:size]
    out[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    at = len(head)
    for src, n in _byte_runs(ordered):
        out[at : at + n].copy_(src)
        at += n
    return out


def _byte_runs(ordered: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """The tensors' bytes as few flat uint8 tensors as possible: neighbours that are
    contiguous and adjacent in one storage become one run."""
    runs: list[tuple[torch.Tensor, int]] = []
    start: torch.Tensor | None = None
    first = end = 0
    for t in ordered:
        t = t.detach()
        n = t.numel() * t.element_size()
        at = int(t.storage_offset()) * t.element_size()
        if (
            start is not None
            and t.is_contiguous()
            and t.device == start.device
            and t.untyped_storage().data_ptr() == start.untyped_storage().data_ptr()
            and at == end
        ):
            end += n
            continue
        if start is not None:
            runs.append((_storage_bytes(start, first, end), end - first))
        if t.is_contiguous():
            start, first, end = t, at, at + n
        else:
            start = None
            runs.append((t.contiguous().reshape(-1).view(torch.uint8), n))
    if start is not None:
        runs.append((_storage_bytes(start, first, end), end - first))
    return runs


def _storage_bytes(t: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Bytes [first, end) of `t`'s storage as a flat uint8 tensor (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), first, (end - first,), (1,))
    return flat


def serialized_size(tensors: Mapping[str, torch.Tensor]) -> int:
    """len(to_bytes(tensors)), from names, shapes and dtypes alone (no data is read)."""
    head, ordered = _safetensors_layout(tensors)
    return len(head) + sum(t.numel() * t.element_size() for t in ordered)


def write_weights(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """`to_bytes(tensors)` written to `path` tensor by tensor (no whole-file buffer), atomically
    (tmp + rename): a reader sees no file or the whole file."""
    path = Path(path)
    head, ordered = _safetensors_layout(tensors)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        for t in ordered:
            view, _kept = host_bytes(t)
            f.write(view)
    os.replace(tmp, path)


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return st_load(data)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_peft_dir(directory: str | os.PathLike, weights: bytes | dict[str, torch.Tensor], lora: LoraSpec) -> Path:
    """Write a PEFT adapter directory from serialized weights or from tensors (streamed, see
    `write_weights`); files appear atomically (tmp + rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(weights, dict):
        write_weights(directory / WEIGHTS_NAME, weights)
    else:
        _write_atomically(directory / WEIGHTS_NAME, weights)
    _write_atomically(directory / CONFIG_NAME, json.dumps(adapter_config(lora), indent=2).encode())
    return directory


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
