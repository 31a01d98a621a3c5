#!/usr/bin/env bash
# On the lent GPU, once vLLM's four parts and the megatron-bridge part have arrived (h200_env.sh and
# run_megatron_bridge_gpu.sh stage them; the calls before this one carry them, one part each):
#   bash benchmarks/run_megatron_vllm_gpu.sh [case ...]        (default: the four dense cases)
# Cases, each one `lorabus up` of AReaL's Megatron + vLLM example (benchmarks/megatron_vllm.py),
# Qwen3-0.6B shape (28 layers), r16 on the seven modules, bf16, 5 steps, vLLM at 30 % of the GPU:
#   megatron_xccl megatron_disk fsdp_xccl fsdp_disk    Megatron -> vLLM beside FSDP2 -> vLLM
#   moe_xccl                                           Qwen3-30B-A3B shape, 2 layers, 128 experts
#   embedded_xccl                                      FSDP2 -> the embedded engine (one replica), the
#                                                      same run without a server: the canary's share on it
# The call sequence that ran it (H100, December 2026; 64 MiB a call, the tree's 19 MB included):
#   1 carry .device/src.tgz (benchmarks/device/snapshot.sh), .device/megatron/part_aa, .device/vllm/part_ad:
#     any megatron-bridge work (CASES=moe_bf16 bash benchmarks/run_megatron_bridge_gpu.sh, ~130 s)
#   2, 3 carry .device/vllm/part_aa, then part_ab:   source benchmarks/h200_env.sh   (< 1 s each)
#   4 carry .device/vllm/part_ac:   OUT=$OUT/mv bash benchmarks/run_megatron_vllm_gpu.sh megatron_xccl fsdp_xccl
# A case takes 3-4 minutes (megatron_xccl 239 s, fsdp_xccl 181 s: vLLM's start is 60-100 s of it;
# the MoE case's server took 103 s), so a 10-minute call holds two dense cases, not four.
# Writes $OUT/megatron_vllm_<case>.json and .._up.log, and $OUT/megatron_vllm_logs.tgz (each run's
# trainer, vLLM and sidecar logs: the 8-files-back limit).
set -uo pipefail
OUT=${OUT:-/tmp/megatron_vllm_out}
mkdir -p "$OUT"
source benchmarks/h200_env.sh
[ -f /tmp/msite/.ok ] || { echo "megatron site missing: carry .device/megatron/part_aa"; exit 2; }
# the site goes to the servers and the trainer by flag, not to every service
export PYTHONPATH=${PYTHONPATH//\/tmp\/vsite:/}
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(megatron_xccl fsdp_xccl megatron_disk fsdp_disk)
rc=0
for c in "${cases[@]}"; do
  case $c in
    megatron_xccl) a=(--trainer megatron --mode xccl) ;;
    megatron_disk) a=(--trainer megatron --mode disk) ;;
    fsdp_xccl) a=(--trainer fsdp --mode xccl) ;;
    fsdp_disk) a=(--trainer fsdp --mode disk) ;;
    embedded_xccl) a=(--trainer fsdp --mode xccl rollout.engine=embedded rollout.replicas=1) ;;
    # its server took 103 s to start (fused MoE LoRA buffers for 128 experts): a longer run
    moe_xccl) a=(--trainer megatron --mode xccl --shape qwen3-30b-a3b --moe --experts 128 --layers 2 --steps 3) ;;
    *) echo "unknown case $c"; exit 2 ;;
  esac
  [ "$c" = embedded_xccl ] || [ -f /tmp/vsite/.ok ] || { echo "$c: vLLM site missing: its four parts have not all arrived"; rc=2; continue; }
  echo "== $c"
  up_s=240; [ "$c" = moe_xccl ] && up_s=500
  timeout $((up_s + 60)) python3 benchmarks/megatron_vllm.py --out-dir "$OUT" --label "$c" --run-dir "/tmp/mv_run_$c" \
    --server-site /tmp/vsite --trainer-site /tmp/msite --timeout "$up_s" "${a[@]}" >"$OUT/megatron_vllm_$c.stdout" 2>&1
  r=$?; [ $r -eq 0 ] || rc=$r
  tail -25 "$OUT/megatron_vllm_$c.stdout"
done
tar -czf "$OUT/megatron_vllm_logs.tgz" -C /tmp $(cd /tmp && ls -d mv_run_*/*.log 2>/dev/null) 2>/dev/null
(cd "$OUT" && tar -czf megatron_vllm_stdout.tgz megatron_vllm_*.stdout megatron_vllm_*_up.log && rm -f megatron_vllm_*.stdout megatron_vllm_*_up.log)
exit $rc
