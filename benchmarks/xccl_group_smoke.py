"""One trainer and one replica process in an XCCL group, a few versions end to end, checked bit
for bit: the NCCL check of the sender/receiver protocol (header, buckets, the flags' gather)
on two GPUs, or the same over gloo on CPU.

    python benchmarks/xccl_group_smoke.py --backend nccl --out $OUT/xccl_group_smoke.json   # 2 GPUs
    python benchmarks/xccl_group_smoke.py --backend gloo                                    # CPU

Invariant: exits 0 only if every version reached the replica through `take` with the trainer's
exact bytes (adopted as its slot; the previous one released) and the slot of the version before
was untouched by the next broadcast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.propagation import make_tensors, manifest_for


def sha(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def replica(backend: str) -> None:
    import msgspec

    from proto.messages import XcclPayload
    from services.rollout.xccl_receiver import XcclReceiver

    rx = XcclReceiver("r0", device="cuda:1" if backend == "nccl" else "cpu", timeout_s=60)
    held: tuple[int, dict[str, torch.Tensor], str] | None = None
    for line in sys.stdin:
        msg = json.loads(line)
        xp = msgspec.json.decode(json.dumps(msg["payload"]).encode(), type=XcclPayload)
        rx.observe(xp, msg["version"])
        got = rx.take(msg["version"], xp, wait_s=10.0) if xp.ranks else None
        out: dict = {"version": msg["version"], "sha": sha(got) if got is not None else None}
        if held is not None:
            out["previous_intact"] = sha(held[1]) == held[2]
        if got is not None:
            rx.adopt(msg["version"])
            if held is not None:
                rx.release(held[0])
            held = (msg["version"], got, out["sha"])
        print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="nccl" if torch.cuda.device_count() >= 2 else "gloo")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replica:
        replica(args.backend)
        return 0
    import msgspec

    from services.common import xccl
    from services.trainer.xccl_sender import XcclSender

    device = "cuda:0" if args.backend == "nccl" else "cpu"
    sender = XcclSender(address="127.0.0.1", port=0, backend=args.backend,
                        bucket_bytes=xccl.bucket_bytes_of(16), timeout_s=60, device=device)  # fmt: skip
    child = subprocess.Popen([sys.executable, __file__, "--replica", "--backend", args.backend],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    rows, ok = [], True
    try:
        manifest = manifest_for("37MB")
        for v in range(args.versions):
            tensors = {n: t.to(device) for n, t in make_tensors(manifest, v).items()}
            t0 = time.perf_counter()
            xp = sender.send(v, tensors)
            send_s = time.perf_counter() - t0
            child.stdin.write(json.dumps({"version": v, "payload": json.loads(msgspec.json.encode(xp))}) + "\n")
            child.stdin.flush()
            got = json.loads(child.stdout.readline())
            if v == 0:  # the handle it joins from; nobody in the group yet
                joined_since = time.monotonic()
                while sender.store.add("join_seq", 0) < 1 and time.monotonic() - joined_since < 30:
                    time.sleep(0.02)
                continue
            good = got["sha"] == sha(tensors) and got.get("previous_intact", True)
            ok &= good
            stats = {k: getattr(sender.stats, k) for k in ("header_s", "buckets_s", "flag_s")}
            rows.append({"version": v, "ranks": xp.ranks, "send_ms": send_s * 1e3, "ok": good, "stats": stats})
            print(rows[-1], flush=True)
    finally:
        sender.close()
        child.kill()
    ok &= len(rows) == args.versions - 1 and all(r["ranks"] == {"r0": 1} for r in rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"backend": args.backend, "ok": ok, "rows": rows}, indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
