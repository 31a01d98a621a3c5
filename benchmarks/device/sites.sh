# Sourced after benchmarks/h200_env.sh on the lent H200: stages the SGLang site beside vLLM's.
#   source benchmarks/h200_env.sh && source benchmarks/device/sites.sh
#
# Each call carries at most 64 MiB, so the parts arrive one per call while the machine stays
# warm (/tmp is kept 30 s after a call): vLLM's four (.device/vllm/part_*, h200_env.sh copies
# them) and SGLang's two (.device/sglang/part_aa, part_ab; DEST=.device/sglang bash
# benchmarks/device/sglang-site.sh makes them). This copies the SGLang parts a call carries to
# /tmp/sw and unpacks them into /tmp/ssite once both are there; SGLANG_SITE and VLLM_SITE name
# the sites that are ready. Neither goes on the services' PYTHONPATH here: gpu_engines.py
# gives each server its own site (--vllm-site / --sglang-site), `lorabus up` its servers
# (--server-site), since vLLM's and SGLang's sites pin different transformers.
#
# The call sequence for the next session with device time (six calls, one machine, back to back):
#   1-4: carry [".device/vllm/part_aa"] ... [".device/vllm/part_ad"] (one each), command:
#          source benchmarks/h200_env.sh && source benchmarks/device/sites.sh
#   5:   carry [".device/sglang/part_aa"], same command
#   6:   carry [".device/sglang/part_ab"]:
#          source benchmarks/h200_env.sh && source benchmarks/device/sites.sh &&
#          python3 benchmarks/gpu_engines.py --out-dir $OUT --label h200 \
#            --vllm-site $VLLM_SITE --sglang-site $SGLANG_SITE --vllm-arg=--gpu-memory-utilization --vllm-arg=0.5
#   7:   (same machine, no carry) the SGLang learning run, after examples/arith3 is made:
#          source benchmarks/h200_env.sh && source benchmarks/device/sites.sh &&
#          PYTHONPATH=${PYTHONPATH//\/tmp\/vsite:/} python3 benchmarks/gpu_learning.py --out-dir $OUT \
#            --engine sglang --server-site $SGLANG_SITE --label sglang_bf16 actor.dtype=bfloat16 rollout.dtype=bfloat16
#        and with actor.weight_update_mode=xccl (label sglang_xccl_bf16): its JSON's loads_by_path
#        says how many versions came by broadcast (the group is gloo on one GPU: docs/xccl.md).
mkdir -p /tmp/sw
for p in "$PWD"/.device/sglang/part_*; do [ -f "$p" ] && cp "$p" /tmp/sw/; done
if [ ! -f /tmp/ssite/.ok ] && [ "$(ls /tmp/sw | wc -l)" -ge 2 ]; then
  mkdir -p /tmp/ssite && cat /tmp/sw/part_* | xz -d -T0 | tar -x -C /tmp/ssite && touch /tmp/ssite/.ok
fi
unset SGLANG_SITE VLLM_SITE
[ -f /tmp/ssite/.ok ] && export SGLANG_SITE=/tmp/ssite
[ -f /tmp/vsite/.ok ] && export VLLM_SITE=/tmp/vsite
echo "sites: sglang parts $(ls /tmp/sw | wc -l)/2, sglang ${SGLANG_SITE:-absent}, vllm ${VLLM_SITE:-absent}"
