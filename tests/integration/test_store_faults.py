"""Issue 30, storage faults on a real filesystem: the store's and the export directory's disk
full (a 256 KiB tmpfs) or read-only (the same tmpfs remounted), in a private mount namespace
(`unshare --mount --map-root-user`, so no root and no host mount is needed). Each write fails
with a `StoreUnwritable` naming the directory, the cause and the config key to change; nothing
written before is touched and the failed write leaves no partial file behind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from pathlib import Path
    from proto.messages import LoraSpec
    from services.config.schema import StoreConfig
    from services.common.store import LocalStore, StoreUnwritable
    from services.exporter.peft_dir import PeftFiles, write_export

    disk = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    out = {}

    def attempt(name, write):
        try:
            write()
        except StoreUnwritable as exc:
            out[name] = {"message": str(exc), "full": exc.full}
        else:
            out[name] = {"message": "no error"}

    store = LocalStore(disk / "store")
    kept = store.put_bytes("adapters/v0/adapter_model.safetensors", b"v0" * 1000)
    attempt("store full", lambda: store.put_bytes("adapters/v1/adapter_model.safetensors", os.urandom(400_000)))
    lora = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"], base_model="tiny")
    export = f"file://{disk}/export"
    files = PeftFiles(weights=os.urandom(400_000), lora=lora)
    attempt("export full", lambda: write_export(export, 1, files, StoreConfig()))
    out["left behind"] = sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file())
    out["v0 intact"] = store.get_bytes(kept.uri, sha256=kept.sha256, size=kept.bytes) == b"v0" * 1000
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    attempt("store read-only", lambda: store.put_bytes("adapters/v2/adapter_model.safetensors", b"x"))
    out["v0 readable"] = store.get_bytes(kept.uri, sha256=kept.sha256) == b"v0" * 1000
    print(json.dumps(out))
    """
)


def in_namespace(disk: Path) -> dict:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a private namespace")
    probe = subprocess.run([unshare, "--mount", "--map-root-user", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs user namespaces to mount a small tmpfs: {probe.stderr.strip()}")
    done = subprocess.run(
        [unshare, "--mount", "--map-root-user", sys.executable, "-c", CHILD, str(disk)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_full_or_read_only_disk_names_the_directory_and_the_fix_and_loses_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    out = in_namespace(disk)
    full = out["store full"]
    assert full["full"] is True, full
    assert full["message"].startswith(f"store.uri: {disk}/store/adapters/v1 has no space left on its device (ENOSPC")
    assert "point store.uri at a larger disk" in full["message"]
    assert "nothing written before is lost" in full["message"]
    export = out["export full"]
    assert export["full"] is True and export["message"].startswith(f"exporter.uri: {disk}/export/v1 "), export
    assert "point exporter.uri at a larger disk" in export["message"]
    # the failed writes left no partial object or temp file: only v0, whole
    assert out["left behind"] == ["store/adapters/v0/adapter_model.safetensors"], out["left behind"]
    assert out["v0 intact"] and out["v0 readable"]
    ro = out["store read-only"]
    assert ro["full"] is False and "on a read-only filesystem (EROFS" in ro["message"], ro
    assert "remount it read-write or point store.uri at a writable directory" in ro["message"]
