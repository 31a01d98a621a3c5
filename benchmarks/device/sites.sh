# Sourced after benchmarks/h200_env.sh on the lent H200: stages the SGLang site beside vLLM's.
#   source benchmarks/h200_env.sh && source benchmarks/device/sites.sh
#
# Each call carries at most 64 MiB, the tracked tree (17 MB) included, so the parts arrive one per
# call while the machine stays warm (/tmp is kept 30 s after a call): SGLang's two
# (.device/sglang/part_aa, part_ab, 45 MiB; DEST=.device/sglang bash benchmarks/device/sglang-site.sh;
# at 22 MB of tree, re-split them to 40 MiB: three parts) and vLLM's four (.device/vllm/part_*,
# re-split to 40 MiB: `cat part_* | split -b 40m - .device/vllm/part_`; ../shared/device/vllm-site.sh's
# 50 MiB parts, and 44 MiB since the tree grew to 22 MB, do not fit beside it; h200_env.sh copies them). This copies the SGLang parts a
# call carries to /tmp/sw and unpacks them into /tmp/ssite once both are there; SGLANG_SITE and
# VLLM_SITE name the sites that are ready. Neither goes on the services' PYTHONPATH here:
# gpu_engines.py gives each server its own site (--vllm-site / --sglang-site), `lorabus up` its
# servers (--server-site), since vLLM's and SGLang's sites pin different transformers.
#
# The call sequence (one machine, back to back; every call after the first also does work, so no
# call only waits for a transfer; each starts `source benchmarks/h200_env.sh && source
# benchmarks/device/sites.sh &&`):
#   1 carry sglang/part_aa: decode_breakdown.py --shapes qwen2.5-1.5b --batches 16 64 256, then
#                           continuous_batching.py (the embedded engine's decode, issue 27)
#   2 carry sglang/part_ab: gpu_engines.py --engines embedded sglang --label h200
#                           --sglang-site $SGLANG_SITE --sglang-arg=--cuda-graph-backend-prefill
#                           --sglang-arg=disabled
#   3 carry vllm/part_aa:   PYTHONPATH=${PYTHONPATH//\/tmp\/vsite:/} python3 benchmarks/gpu_learning.py
#                           --out-dir $OUT --engine sglang --server-site $SGLANG_SITE --label
#                           sglang_bf16 actor.dtype=bfloat16 rollout.dtype=bfloat16
#   4, 5 carry vllm/part_ab, part_ac: the transfer alone
#   6 carry vllm/part_ad:   gpu_engines.py --engines vllm --label h200_vllm --vllm-site $VLLM_SITE
#                           --vllm-arg=--gpu-memory-utilization --vllm-arg=0.5
#   7 no carry:             gpu_learning.py --engine vllm --label vllm_xccl_bf16 actor.dtype=bfloat16
#                           rollout.dtype=bfloat16 actor.weight_update_mode=xccl
#                           'vllm.extra_args=[--gpu-memory-utilization, "0.3", --enforce-eager]'
#                           (its JSON's loads_by_path: how many versions came by broadcast)
mkdir -p /tmp/sw
# the parts lie in the working tree ($_tree) also when h200_env.sh moved into a committed snapshot
for p in "${_tree:-$PWD}"/.device/sglang/part_*; do [ -f "$p" ] && cp "$p" /tmp/sw/; done
# unpacked once the parts make a whole xz stream, however many they were cut into
if [ ! -f /tmp/ssite/.ok ] && compgen -G "/tmp/sw/part_*" >/dev/null && cat /tmp/sw/part_* | xz -t 2>/dev/null; then
  mkdir -p /tmp/ssite && cat /tmp/sw/part_* | xz -d -T0 | tar -x -C /tmp/ssite && touch /tmp/ssite/.ok
fi
unset SGLANG_SITE VLLM_SITE
[ -f /tmp/ssite/.ok ] && export SGLANG_SITE=/tmp/ssite
[ -f /tmp/vsite/.ok ] && export VLLM_SITE=/tmp/vsite
echo "sites: sglang parts $(ls /tmp/sw | wc -l), sglang ${SGLANG_SITE:-absent}, vllm ${VLLM_SITE:-absent}"
