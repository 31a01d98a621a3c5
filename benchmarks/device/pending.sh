# The device calls that the open issues' figures wait for (34, 27, 33): one stage per call, back to
# back on one warm machine. Every output goes straight under $OUT (at most 8 files come back a
# call: logs travel as one archive), so a call cut short at its limit still brings back what it
# finished.
#
# Here, before the first call:
#   bash benchmarks/device/snapshot.sh                      # .device/src.tgz: what runs is a commit
#   pip download -d .device/pyw --no-deps pytest pluggy iniconfig packaging   # the image has no pytest
#   vLLM's four parts in .device/vllm (benchmarks/device/sites.sh says how: 40 MiB each, the most
#   that fits beside the 22 MB tree)
# Each call (timeout_s 595): `source benchmarks/h200_env.sh && TREE=$_tree STAGE=<s> bash
# benchmarks/device/pending.sh` (TREE: the carried tree; h200_env.sh has moved into the snapshot,
# which the first call carries and the later ones on the warm machine keep).
#
# A lease is ~1,800 s of device time and a machine's start ~270-300 of them: two full calls and
# part of a third. A start that fails costs 90-180 s as well (12-07 late: four failed and four
# were refused; 12-08: eight failed starts and nine refusals cost 946 s of the 1,800, and
# then none was lent for the rest of the session). Next lease, in this order:
#   1 carry .device/src.tgz + .device/pyw  STAGE=mixed LIMIT=270   issue 27: the kernels' GPU tests
#                                          (the decoder layer's fused add and the corrected SwiGLU are
#                                          the default since 12-08 and have run on no GPU yet), then the
#                                          mixed step, fused_attention beside fused_residual, side by side
#   2 (nothing carried)                    STAGE=chain   issue 34: the chain task pre-trained (<= 240 s),
#                                          then its runs: k = 0 2 4 1 x seeds 1-3, 40 steps (resumable;
#                                          LIMIT=<s> where less than a full call is left)
#   3 (nothing carried)                    STAGE=chain   the runs the call before left (the task stays)
#   and where a short call fits: STAGE=stretches LIMIT=<s> (issue 27: the attention's 128 programs
#   against 512 on the head, the step's share of the HBM limit at batch 64 being 37.7 % of 40)
# The lease after: the rest of the chain runs, then issue 27 (engines: vLLM's four parts carried one
# a call, part_aa with STAGE=kernels, part_ab..ad with the calls after, engines last) and issue 33
# (STAGE=fleet, fleet_together, fleet_one_replica: the trainer's collate and gc.freeze of 12-08 are
# not yet measured there).
# Also: STAGE=kernel_tests, joint_step, kernels, fleet_decode, sync_async (arith3; twice: a run
# already recorded under /tmp/pending is not run again), sweep (done 12-07 late; seeds 2-3 of the
# 1e-4 and 3e-4 columns would be the next cells), and with less device time left than a full
# call, STAGE=short LIMIT=<seconds>.
set -u
L=h100 HBM=3.35
nvidia-smi | grep -q H200 && L=h200 HBM=4.8
KEEP=/tmp/pending  # survives between calls while the machine stays warm
mkdir -p "$KEEP"
kernel_tests() {  # the new decode kernels compiled for the card and checked against their references
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyt "${TREE:?TREE: the carried tree}"/.device/pyw/*.whl
  PYTHONPATH="$PYTHONPATH:/tmp/pyt" timeout 150 python -m pytest -q -p no:cacheprovider --noconftest \
    -o addopts="" -rs -k gpu tests/unit/test_norm_kernel.py tests/unit/test_kv_write.py \
    tests/unit/test_swiglu_kernel.py tests/unit/test_attention_kernel.py tests/unit/test_sample_kernel.py \
    tests/unit/test_lora_kernels.py tests/unit/test_decoder_layer.py \
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
fleet_out() {  # at most 8 files come back from a call: the JSON, the plot and the logs as one archive
  cp "$KEEP"/out/multi_run_"$L".* "$OUT"/ 2>/dev/null
  [ -d "$KEEP/out/multi_run_${L}_logs" ] && tar -czf "$OUT/multi_run_${L}_logs.tgz" -C "$KEEP/out" "multi_run_${L}_logs"
}
sync_async_chain() {  # k = 0 1 2 4 x seeds 1 2 3 on the chain task, 40 steps a run (resumable: call it
  # again on the same machine and the recorded runs are kept); LIMIT: the call's seconds
  timeout $((${LIMIT:-585} - SECONDS)) python benchmarks/sync_async.py --task chain --steps 40 --ks 0 2 4 1 \
    --seeds 1 2 3 --max-wall-s $((${LIMIT:-585} - 115 - SECONDS)) --out "$KEEP/sync_async_chain_$L.json" 2>&1 | tail -40
  cp "$KEEP"/sync_async_chain_"$L".json "$KEEP"/sync_async_chain_"$L".png "$OUT"/ 2>/dev/null
  tar -czf "$OUT/sync_async_chain_${L}_runs.tgz" -C "$KEEP" "sync_async_chain_${L}_runs"
}
case "${STAGE:?STAGE: chain, sweep, fleet, fleet_one_replica, fleet_together, kernel_tests, joint_step, engines, mixed, chain_task, sync_async_chain, kernels, stretches, short, fleet_decode or sync_async}" in
kernel_tests)  # issue 27: the kernels' GPU tests alone
  kernel_tests
  ;;
kernels)  # issue 27: the kernels checked, the step they make, and continuous batching (the attention
  # kernel's mask scan skips a slab row's unwritten tail since 12-07)
  kernel_tests
  LIMIT=400 breakdown "64 256 1 16"
  timeout $((585 - SECONDS)) python benchmarks/continuous_batching.py --out "$OUT/continuous_batching_$L.json" 2>&1 | tail -8
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
fleet)  # issue 33: the 8 runs one after another (task made first: ~65 s; 8 solo runs ~340 s)
  timeout $((585 - SECONDS)) python benchmarks/multi_run.py --task arith3 --runs 8 --phase solo \
    --out-dir "$KEEP/out" --label "$L" --work-dir "$KEEP/mr" --budget-s $((560 - SECONDS)) 2>&1 | tail -20
  fleet_out
  ;;
fleet_together)  # issue 33: fleets of 2, 4 and 8 against the solo runs of the call before (~380 s)
  timeout $((585 - SECONDS)) python benchmarks/multi_run.py --task arith3 --runs 2 4 8 --phase together \
    --out-dir "$KEEP/out" --label "$L" --work-dir "$KEEP/mr" --budget-s $((560 - SECONDS)) 2>&1 | tail -30
  fleet_out
  ;;
fleet_one_replica)  # issue 33: solo runs and the fleets of 2, 4 and 8 with one rollout replica, not two (one
  # process fewer time-slicing the card with the trainer; a replica's round decodes every run's
  # groups in one batch either way). Solo ~340 s, then the fleets the call has time for; call it
  # again on the same machine for the rest (recorded runs are kept).
  timeout $((585 - SECONDS)) python benchmarks/multi_run.py --task arith3 --runs 8 2 4 --phase all \
    --out-dir "$KEEP/out1" --label "${L}_1r" --work-dir "$KEEP/mr1" --budget-s $((560 - SECONDS)) \
    rollout.replicas=1 2>&1 | tail -20
  cp "$KEEP"/out1/multi_run_"${L}"_1r.* "$OUT"/ 2>/dev/null
  ;;
chain)  # issue 34: the task (once per machine), then as many of its runs as the call has time for
  [ -f examples/chain/pretrain_metrics.json ] || timeout 260 python scripts/make_chain_task.py --max-seconds 240 2>&1 | tail -6
  cp examples/chain/pretrain_metrics.json "$OUT/chain_pretrain_$L.json"
  sync_async_chain
  ;;
sweep)  # issue 34: rank 1 8 32 x learning rate 3e-5 1e-4 3e-4 on arith3 in bf16, 80 steps a cell
  timeout $((${LIMIT:-585} - SECONDS)) python benchmarks/lora_sweep.py --task arith3 \
    --max-wall-s $((${LIMIT:-585} - 75 - SECONDS)) --out "$KEEP/lora_sweep_arith3_$L.json" 2>&1 | tail -20
  cp "$KEEP"/lora_sweep_arith3_"$L".json "$KEEP"/lora_sweep_arith3_"$L".png "$OUT"/ 2>/dev/null
  tar -czf "$OUT/lora_sweep_arith3_${L}_runs.tgz" -C "$KEEP" "lora_sweep_arith3_${L}_runs" 2>/dev/null
  ;;
chain_task)  # issue 34: the long-rollout task, pre-trained on the card (its model stays in the snapshot's
  # examples/chain/ while the machine is warm)
  timeout $((585 - SECONDS)) python scripts/make_chain_task.py --max-seconds $((520 - SECONDS)) 2>&1 | tail -6
  cp examples/chain/pretrain_metrics.json "$OUT/chain_pretrain_$L.json"
  ;;
sync_async_chain)  # issue 34: the chain task's runs alone (the task made by chain_task or chain)
  sync_async_chain
  ;;
mixed)  # issue 27: where a step with rows on older versions goes (the mixed batches' 0.85 of base on
  # 12-07 late), after the kernels' GPU tests: the stacked expand's contiguous output (fused_attention)
  # beside the decoder layer's fused residual adds with o_proj's and down_proj's corrections in them
  kernel_tests
  timeout $((${LIMIT:-570} - SECONDS)) python benchmarks/decode_breakdown.py --hbm-tbs "$HBM" \
    --shapes qwen2.5-1.5b --batches 64 256 --variants fused_attention fused_residual --mixes head mixed25 mixed3 \
    --side-by-side \
    --out "$OUT/decode_breakdown_mixed_$L.json" 2>&1 | grep -v USDT | tail -12
  ;;
stretches)  # issue 27: the attention's stretches for 128 programs against 512 (at batch 64: no merge
  # launch, whose 28 launches took 0.10 ms of the 2.67 ms step on 12-07 late), on the head
  timeout $((${LIMIT:-570} - SECONDS)) python benchmarks/decode_breakdown.py --hbm-tbs "$HBM" \
    --shapes qwen2.5-1.5b --batches 64 16 1 256 --variants fused_residual few_stretches --side-by-side \
    --out "$OUT/decode_breakdown_stretches_$L.json" 2>&1 | grep -v USDT | tail -10
  ;;
joint_step)  # issue 33: N runs' train steps together against one after another (the 0.5B shape)
  timeout $((585 - SECONDS)) python benchmarks/joint_step.py --out "$OUT/joint_step_$L.json" 2>&1 | tail -8
  ;;
engines)  # issue 27: a vLLM server, then the embedded engine, on the same work (on 12-07 vLLM ran second, slow)
  [ -f /tmp/vsite/.ok ] || { echo "engines: vLLM is not unpacked (/tmp/vsite); carry its four parts first" >&2; exit 2; }
  # vLLM's site (and its pinned transformers) on the vLLM server's path only
  PYTHONPATH="${PYTHONPATH//\/tmp\/vsite:/}" timeout $((585 - SECONDS)) python benchmarks/gpu_engines.py \
    --engines vllm embedded --out-dir "$OUT" --label "$L" --vllm-site /tmp/vsite \
    --vllm-arg=--gpu-memory-utilization --vllm-arg=0.5 2>&1 | tail -30
  ;;
*) echo "STAGE: $STAGE is not one of chain, sweep, fleet, fleet_one_replica, fleet_together, kernel_tests, joint_step, engines, mixed, chain_task, sync_async_chain, kernels, stretches, short, fleet_decode, sync_async" >&2
  exit 2 ;;
esac
