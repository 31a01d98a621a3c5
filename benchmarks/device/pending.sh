# The device calls that the open issues' figures wait for (27, 34, 33), in the order to run them:
# one stage per call, back to back on one warm machine. Every output goes straight under $OUT,
# so a call cut short at its limit still brings back what it finished.
#
# Here, before the first call:
#   bash benchmarks/device/snapshot.sh                      # .device/src.tgz: what runs is a commit
#   pip download -d .device/pyw --no-deps pytest pluggy iniconfig packaging   # the image has no pytest
# Each call (carry [".device/src.tgz", ".device/pyw"]; timeout_s 595):
#   source benchmarks/h200_env.sh && TREE=$_tree STAGE=kernels bash benchmarks/device/pending.sh
# (TREE: the carried tree, where .device/pyw is; h200_env.sh has moved into the snapshot)
# then STAGE=fleet_decode, then STAGE=sync_async (twice: a run already recorded under
# /tmp/pending is not run again), then STAGE=fleet (the solo runs) and STAGE=fleet_together
# (2, 4 and 8 runs against them). With less device time left than a full call, STAGE=short
# LIMIT=<seconds>. Measured 2026-12-07 on an H100: kernels, fleet_decode and an 8-run fleet;
# what is left first: STAGE=kernel_tests (the norm and SwiGLU fixes), sync_async, the fleet.
set -u
L=h100 HBM=3.35
nvidia-smi | grep -q H200 && L=h200 HBM=4.8
KEEP=/tmp/pending  # survives between calls while the machine stays warm
mkdir -p "$KEEP"
kernel_tests() {  # the new decode kernels compiled for the card and checked against their references
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyt "${TREE:?TREE: the carried tree}"/.device/pyw/*.whl
  PYTHONPATH="$PYTHONPATH:/tmp/pyt" timeout 120 python -m pytest -q -p no:cacheprovider --noconftest \
    -o addopts="" -rs -k gpu tests/unit/test_norm_kernel.py tests/unit/test_kv_write.py \
    tests/unit/test_swiglu_kernel.py tests/unit/test_attention_kernel.py tests/unit/test_sample_kernel.py \
    >"$OUT/gpu_kernel_tests_$L.txt" 2>&1
  tail -5 "$OUT/gpu_kernel_tests_$L.txt"
  grep -i unavailable "$OUT/gpu_kernel_tests_$L.txt" | head -3  # a kernel that fell back to torch
}
breakdown() {  # $1: batch sizes; the step the kernels make, next to the torch paths
  timeout $((${LIMIT:-570} - SECONDS)) python benchmarks/decode_breakdown.py --hbm-tbs "$HBM" \
    --shapes qwen2.5-1.5b --batches $1 \
    --variants fused_rope fused_kv fused_norm_kernel fused_swiglu fused_attention \
    --out "$OUT/decode_breakdown_kernels_$L.json" 2>&1 | tail -40
}
case "${STAGE:?STAGE: kernels, kernel_tests, short, fleet_decode, sync_async, fleet or fleet_together}" in
kernel_tests)  # issue 27: the kernels' GPU tests alone
  kernel_tests
  ;;
kernels)  # issue 27
  kernel_tests
  breakdown "64 256 1 16"
  ;;
short)  # what a call cut short by failed machine starts can still bring back (LIMIT: its seconds):
  # the kernels checked (27), the joint step and its canaries timed (33), then batch 64's step (27)
  kernel_tests
  timeout 150 python benchmarks/joint_step.py --steps 2 --out "$OUT/joint_step_$L.json" 2>&1 | tail -8
  breakdown 64
  ;;
fleet_decode)  # issues 33 and 27: a fleet replica's runs decoded as one batch against apart
  timeout $(( ${LIMIT:-585} / 2 )) python benchmarks/fleet_decode.py --out "$OUT/fleet_decode_$L.json" 2>&1 | tail -5
  timeout $((${LIMIT:-585} - SECONDS)) python benchmarks/fleet_decode.py --max-new 6 --prompt-len 16 \
    --out "$OUT/fleet_decode_short_$L.json" 2>&1 | tail -5  # rollouts as short as arith3's
  ;;
sync_async)  # issue 34: k = 0 1 2 4 x seeds 1 2 3 on arith3, the pipelined trainer
  timeout $((585 - SECONDS)) python benchmarks/sync_async.py --task arith3 --ks 0 1 2 4 --seeds 1 2 3 \
    --max-wall-s 470 --out "$KEEP/sync_async_arith3_$L.json" 2>&1 | tail -40
  cp -r "$KEEP"/. "$OUT"/
  ;;
fleet)  # issue 33: the 8 runs one after another (task made first: ~50 s; 8 solo runs ~275 s)
  timeout $((585 - SECONDS)) python benchmarks/multi_run.py --task arith3 --runs 8 --phase solo \
    --out-dir "$OUT" --label "$L" --work-dir "$KEEP/mr" --budget-s $((560 - SECONDS)) 2>&1 | tail -20
  ;;
fleet_together)  # issue 33: fleets of 2, 4 and 8 against the solo runs of the call before
  timeout $((585 - SECONDS)) python benchmarks/multi_run.py --task arith3 --runs 2 4 8 --phase together \
    --out-dir "$OUT" --label "$L" --work-dir "$KEEP/mr" --budget-s $((560 - SECONDS)) 2>&1 | tail -30
  ;;
*) echo "STAGE: $STAGE is not one of kernels, kernel_tests, short, fleet_decode, sync_async, fleet, fleet_together" >&2
  exit 2 ;;
esac
