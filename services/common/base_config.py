"""The base model's `config.json`, read without torch or transformers (the registry has neither).

`actor.path` is a local model directory or a Hugging Face hub id; a hub id is looked up in the
local hub cache only (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), as
the services that load the model find it offline. Nothing is downloaded.

Invariant: this reads files and nothing else; what a config means is `adapter_memory`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class BaseConfigError(ValueError):
    """No readable config.json for `actor.path`; the message names the field and the places looked in."""


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ["HF_HOME"]) if os.environ.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    return home / "hub"


def candidates(path: str) -> list[Path]:
    """Where `path`'s config.json may be, in the order tried."""
    out = [Path(path) / "config.json"]
    if path.count("/") == 1 and not Path(path).exists():
        repo = hub_cache() / f"models--{path.replace('/', '--')}"
        ref = repo / "refs" / "main"
        # the snapshot `main` points to, as transformers picks it offline
        if ref.is_file():
            out.append(repo / "snapshots" / ref.read_text().strip() / "config.json")
    return out


def read(path: str) -> dict[str, Any]:
    """The parsed config.json of the model at `path` (actor.path)."""
    tried = candidates(path)
    for file in tried:
        if file.is_file():
            try:
                loaded = json.loads(file.read_text())
            except (OSError, ValueError) as exc:
                raise BaseConfigError(
                    f"actor.path: {path!r}: {file} cannot be read as JSON ({exc}); fix the file"
                ) from None
            if not isinstance(loaded, dict):
                raise BaseConfigError(f"actor.path: {path!r}: {file} is not a JSON object; fix the file")
            return loaded
    looked = ", ".join(str(f) for f in tried)
    raise BaseConfigError(
        f"actor.path: {path!r} has no config.json here (looked in {looked}); give this process the model "
        "directory (or the hub cache), or unset fleet.max_adapter_memory_gib"
    )
