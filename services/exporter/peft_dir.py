"""One adapter version -> a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`).

Synchronous and free of the bus: `peft_files` turns the fetched payload into the two files'
contents, `write_export` puts them under `<exporter.uri>/v<N>/` (a local directory or an
object-store prefix) and `existing_sha256` tells whether an earlier delivery already did.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
from msgspec import Struct

from proto.messages import LoraSpec
from services.common import adapter_io
from services.common.megatron_to_hf import ModelShape, convert, target_modules_of
from services.common.store import ObjectNotFound, S3Store, StoreError, write_error
from services.common.store.objects import file_sha256
from services.config.schema import StoreConfig

FILES = [adapter_io.CONFIG_NAME, adapter_io.WEIGHTS_NAME]


class PeftFiles(Struct, frozen=True, kw_only=True):
    weights: bytes
    """adapter_model.safetensors"""
    lora: LoraSpec
    """what adapter_config.json is derived from (target modules as HF names)"""

    @property
    def sha256(self) -> str:
        return adapter_io.sha256(self.weights)

    def config_bytes(self) -> bytes:
        return json.dumps(adapter_io.adapter_config(self.lora), indent=2).encode()


def peft_files(data: bytes, layout: str, lora: LoraSpec, model_shape: Callable[[], ModelShape]) -> PeftFiles:
    """The export of one payload. `model_shape` is called only for the megatron-bridge layout,
    which needs the base model's dimensions to split the fused tensors."""
    try:
        tensors = adapter_io.from_bytes(data)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise ValueError(f"payload: not a safetensors file ({exc})") from exc
    if not tensors:
        raise ValueError("payload: the safetensors file holds no tensors")
    if layout == "megatron-bridge":
        tensors = convert(tensors, model_shape())
        lora = msgspec.structs.replace(lora, target_modules=target_modules_of(tensors))
        return PeftFiles(weights=adapter_io.to_bytes(tensors), lora=lora)
    if layout != "hf-peft":
        raise ValueError(f"layout: {layout!r} is not one of hf-peft, megatron-bridge")
    standard = {adapter_io.standardize_key(k): v for k, v in tensors.items()}
    for key in standard:
        adapter_io.parse_peft_key(key)  # raises, naming the key, for anything but lora_A/B
    if list(standard) == list(tensors):
        return PeftFiles(weights=data, lora=lora)  # already standard: keep the trainer's bytes
    return PeftFiles(weights=adapter_io.to_bytes(standard), lora=lora)


def load_model_shape(model_path: str, *, ep_size: int = 1) -> ModelShape:
    """The base model's shape from `<actor.path>/config.json` (a local HF model directory)."""
    config = Path(model_path) / "config.json"
    if not model_path or not config.is_file():
        raise ValueError(
            f"actor.path: {model_path!r} has no config.json; the exporter needs the base "
            "model's directory to convert megatron-bridge adapters"
        )
    return ModelShape.from_hf_config(json.loads(config.read_text()), ep_size=ep_size)


def _local_root(export_uri: str) -> Path | None:
    if export_uri.startswith("file://"):
        return Path(export_uri[len("file://") :]).resolve()
    return None


def _s3_store(export_uri: str, store_cfg: StoreConfig) -> S3Store:
    if not export_uri.startswith("s3://"):
        raise StoreError(
            f"exporter.uri {export_uri!r}: must start with file:// or s3:// (versions land in <uri>/v<N>/)"
        )
    return S3Store.from_config(store_cfg, uri=export_uri)


def version_uri(export_uri: str, version: int) -> str:
    root = _local_root(export_uri)
    return f"file://{root}/v{version}" if root else f"{export_uri.rstrip('/')}/v{version}"


def write_export(export_uri: str, version: int, files: PeftFiles, store_cfg: StoreConfig) -> str:
    """Write version N's directory; returns its URI. The weights go last, so a reader that
    sees adapter_model.safetensors also finds adapter_config.json."""
    root = _local_root(export_uri)
    if root is not None:
        directory = root / f"v{version}"
        try:
            adapter_io.write_peft_dir(directory, files.weights, files.lora)
        except OSError as exc:
            # adapter_io writes `.<name>.tmp` then renames: a full disk leaves the partial temp
            # file, which would keep the disk full; the finished files are left alone
            for partial in directory.glob(".*.tmp"):
                partial.unlink(missing_ok=True)
            raise write_error(exc, f"exporting v{version}", directory, "exporter.uri") from exc
    else:
        store = _s3_store(export_uri, store_cfg)
        store.put_bytes(f"v{version}/{adapter_io.CONFIG_NAME}", files.config_bytes())
        store.put_bytes(f"v{version}/{adapter_io.WEIGHTS_NAME}", files.weights)
    return version_uri(export_uri, version)


def existing_sha256(export_uri: str, version: int, store_cfg: StoreConfig) -> str | None:
    """sha256 of version N's exported weights if both files are already there, else None."""
    root = _local_root(export_uri)
    if root is not None:
        d = root / f"v{version}"
        if not all((d / name).is_file() for name in FILES):
            return None
        return file_sha256(d / adapter_io.WEIGHTS_NAME)[1]
    store = _s3_store(export_uri, store_cfg)
    if not store.exists(f"v{version}/{adapter_io.CONFIG_NAME}"):
        return None
    try:
        data = store.get_bytes(store.uri_for(f"v{version}/{adapter_io.WEIGHTS_NAME}"))
    except ObjectNotFound:
        return None
    return adapter_io.sha256(data)
