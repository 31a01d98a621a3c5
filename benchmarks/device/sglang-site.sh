#!/usr/bin/env bash
# Packs sglang 0.5.17 for the lent H200 (its image: Python 3.12, torch 2.11.0+cu130, triton 3.6,
# transformers 5.17) as xz'd parts of 45 MiB, one to carry per device call (a call carries at most
# 64 MiB, the repo's tracked tree included).
#   DEST=.device/sglang bash benchmarks/device/sglang-site.sh       # from the project root
#   WHEELS=/some/dir ...   reuses (and fills) a wheel cache instead of a temporary one
#   ATTN=fa3 ...           keeps FlashAttention 3 (sgl_kernel/flash_ops, 1.1 GB unpacked)
#   SITE_OUT=/some/dir ... leaves the unpacked site there, for an import check without a GPU
# DEST must be git-ignored (/.device/ in .git/info/exclude). Measured (December 2026): 492,954,103
# bytes unpacked, 75,028,188 packed = 2 parts (part_aa 47,185,920 + part_ab 27,842,268); with
# ATTN=fa3 FlashAttention 3 adds 141,209,256 packed bytes (5 parts in all).
# On the device, one call right after the other (the machine keeps /tmp only while warm):
#   call 1, carry [".device/sglang/part_aa"]:  mkdir -p /tmp/sw && cp .device/sglang/part_* /tmp/sw/
#   call 2, carry [".device/sglang/part_ab"]:  cp .device/sglang/part_* /tmp/sw/ && mkdir -p /tmp/ssite &&
#     cat /tmp/sw/part_* | xz -d -T0 | tar -x -C /tmp/ssite && source benchmarks/h200_env.sh &&
#     export PYTHONPATH=/tmp/ssite:$PYTHONPATH && python3 benchmarks/device/sglang_smoke.py --out $OUT/s.json
#
# What the wheel list holds (sglang-0.5.17-wheels.txt): what `python -m sglang.launch_server`
# imports in its processes for a dense Qwen2 with --enable-lora --lora-backend triton, less what
# the image has. It carries transformers 5.12.1 and tokenizers 0.22.2 although the image has 5.17 /
# 0.23.2: sglang 0.5.17 registers its own `qwen3_asr` config with AutoConfig, which transformers
# 5.17 already has ("'qwen3_asr' is already used by a Transformers config"), and transformers
# 5.12.1 refuses tokenizers above 0.23.0. Left out although sglang requires them (imported only by
# FP8/MoE/MLA/DSA/Blackwell/diffusion/gRPC/structured-output paths, or tools): nvidia-cutlass-dsl
# (cute-DSL kernels), flash-attn-4, quack-kernels, tilelang, tokenspeed-mla/-triton, helion,
# z3-solver, humming-kernels, nvidia-mathdx, the nvcc/nvvm/crt/cccl wheels (the image has nvcc
# 13.0), nccl4py, outlines, llguidance, openai-harmony, anthropic, datasets, modelscope,
# smg-grpc-*, blobfile, py-spy, cuda-python (the image has cuda-bindings).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${DEST:-.device/sglang}
ATTN=${ATTN:-triton}
CLEAN=()
if [ -n "${SITE_OUT:-}" ]; then SITE=$SITE_OUT; rm -rf "$SITE"; mkdir -p "$SITE"; else SITE=$(mktemp -d); CLEAN+=("$SITE"); fi
if [ -n "${WHEELS:-}" ]; then mkdir -p "$WHEELS"; else WHEELS=$(mktemp -d); CLEAN+=("$WHEELS"); fi
trap 'rm -rf "${CLEAN[@]}"' EXIT
PY=${PYTHON:-python3}
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WHEELS" -r "$HERE/sglang-0.5.17-wheels.txt"
"$PY" -m pip install -q --no-deps --no-index --no-compile "${PLAT[@]}" --find-links "$WHEELS" --target "$SITE" \
  -r "$HERE/sglang-0.5.17-wheels.txt"
# Never loaded for a dense bf16 model on an H200 (compute capability 9.0, which loads
# sgl_kernel/sm90/common_ops): the Blackwell build of the common ops, FlashMLA, InfLLM-v2,
# sglang's diffusion server and tests, xgrammar's static library, tests and byte-code.
rm -rf "$SITE"/sgl_kernel/sm100 "$SITE"/sglang/multimodal_gen "$SITE"/sglang/test
rm -f "$SITE"/sgl_kernel/flashmla_ops.abi3.so "$SITE"/sgl_kernel/infllm_ops*.so "$SITE"/xgrammar/lib/libxgrammar.a
# FlashAttention 3 is loaded only by --attention-backend fa3 (sgl_kernel.flash_attn, imported
# lazily by flashattention_backend); the triton backend needs none of it.
[ "$ATTN" = fa3 ] || rm -f "$SITE"/sgl_kernel/flash_ops.abi3.so
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
find "$SITE" -mindepth 2 -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
mkdir -p "$DEST"; rm -f "$DEST"/part_*
tar -C "$SITE" -cf - . | xz -T2 -6 | split -b 45m - "$DEST/part_"
du -sb "$SITE" | awk '{print "unpacked bytes:", $1}'
ls -l "$DEST"
