#!/usr/bin/env bash
# One call on the lent GPU: megatron-bridge's LoRA through the project's Megatron engine, without
# Transformer Engine (benchmarks/megatron_bridge_step.py). Carries one part built here first:
#   DEST=.device/megatron bash benchmarks/device/megatron-bridge-site.sh     # here, ~30 s, 2.4 MB
#   device call, carry [".device/megatron/part_aa"], kind nvidia-h200 (or any one-GPU kind):
#     bash benchmarks/run_megatron_bridge_gpu.sh
# It sources benchmarks/h200_env.sh (msgspec, nats-py, nats-server, omegaconf from
# benchmarks/wheels into /tmp/site; it unpacks the megatron part into /tmp/msite: megatron-bridge 0.6.2,
# megatron-core 0.19.2) and runs, most important first, each under its own timeout and each
# writing $OUT/megatron_bridge_step_<label>.json (every stage: result or traceback) and a log:
#   dense_bf16  Qwen3-0.6B shape, 4 layers, vocab 151936, bf16, r16: 5 GRPO steps of 8 groups x 4
#               (prompt 128, completions 128-256 tokens; the megatron-core run's batch, see
#               results/megatron_h200.json), step time / tokens/s / peak memory; publish + bf16
#               logits vs HF + peft
#   dense_fp32  the same shape, 2 layers, vocab 32768, fp32: the exact check (tolerance 2e-4)
#   moe_fp32    Qwen3-30B-A3B shape (hidden 2048, 32 heads, 4 KV groups, experts of 768, top-8),
#               2 layers, 16 experts, vocab 32768, fp32: per-expert LoRA, exact check
#   moe_bf16    Qwen3-30B-A3B shape, 2 layers, all 128 experts, bf16: 3 GRPO steps, timing, memory
#   moe_deep    the same at 24 of its 48 layers (a 31 GB bf16 checkpoint; the 2-layer case's 11.9 GiB
#               peak gives about 2.2 GB a layer with its adapter state and activations), steps only
#               (--no-checks: an HF float32 copy for the logits check would not fit beside it).
#               Not in the default set: CASES=moe_deep, in a call of its own (~5 min).
# Expected: ~4-5 min in all once the machine is up (each run: ~10 s imports, HF checkpoint write,
# build, steps, two publications, four HF loads). Extra arguments go to every run; CASES="moe_bf16
# dense_bf16" runs only those.
set -uo pipefail
OUT=${OUT:-/tmp/megatron_bridge_out}
mkdir -p "$OUT"
source benchmarks/h200_env.sh
[ -f /tmp/msite/.ok ] || { echo "megatron site missing: carry .device/megatron/part_aa"; exit 2; }
export PYTHONPATH=/tmp/msite:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import transformers, peft, torch; print('transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
step() {  # label seconds args...
  local label=$1 secs=$2; shift 2
  [[ -z "${CASES:-}" || " $CASES " == *" $label "* ]] || return 0
  echo "== $label (timeout ${secs}s)"
  timeout "$secs" python3 benchmarks/megatron_bridge_step.py --out "$OUT" --label "$label" --work "/tmp/mb_$label" "$@" \
    >"$OUT/megatron_bridge_$label.log" 2>&1
  local r=$?
  [ $r -eq 0 ] || rc=$r
  rm -rf "/tmp/mb_$label"
  python3 -c "import json; d=json.load(open('$OUT/megatron_bridge_step_$label.json')); print({k: v.get('ok') for k, v in d['stages'].items()})" \
    || tail -20 "$OUT/megatron_bridge_$label.log"
}
step dense_bf16 150 --shape qwen3-0.6b --layers 4 --dtype bfloat16 --rank 16 --alpha 32 --groups 8 --samples 4 \
  --prompt-len 128 --max-new 256 --steps 5 --lr 1e-4 --check-len 64 "$@"
step dense_fp32 90 --shape qwen3-0.6b --layers 2 --vocab 32768 --dtype float32 --groups 2 --steps 2 --check-len 64 "$@"
step moe_fp32 120 --shape qwen3-30b-a3b --moe --experts 16 --layers 2 --vocab 32768 --dtype float32 --groups 2 \
  --steps 2 --check-len 64 "$@"
step moe_bf16 150 --shape qwen3-30b-a3b --moe --experts 128 --layers 2 --dtype bfloat16 --groups 4 --samples 4 \
  --prompt-len 128 --max-new 256 --steps 3 --lr 1e-4 "$@"
[[ " ${CASES:-} " == *" moe_deep "* ]] && step moe_deep 540 --shape qwen3-30b-a3b --moe --experts 128 --layers 24 \
  --dtype bfloat16 --groups 4 --samples 4 --prompt-len 128 --max-new 256 --steps 3 --lr 1e-4 --no-checks "$@"
exit $rc
