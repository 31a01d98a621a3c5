#!/usr/bin/env bash
# One command on the lent H200: install the carried wheels, run the Megatron LoRA step.
#   bash benchmarks/run_megatron_gpu.sh        (writes $OUT/megatron_lora_step.json and a log)
# The image has torch 2.11, transformers, peft, numpy, packaging, pyyaml; it lacks
# megatron-core (and msgspec/omegaconf, which lorabus's own modules import).
set -uo pipefail
OUT=${OUT:-/tmp/megatron_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site benchmarks/wheels/*.whl 2>&1 | tee "$OUT/install.log" || exit 2
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 420 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
  benchmarks/megatron_lora_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
python3 -c "import json,sys; d=json.load(open('$OUT/megatron_lora_step.json')); print({k: v.get('ok') for k, v in d['stages'].items()})" || true
exit $rc
