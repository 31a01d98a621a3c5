#!/usr/bin/env bash
# Packs megatron-bridge 0.6.2 + megatron-core 0.19.2 for the lent GPU (its image: Python 3.12,
# torch 2.11.0+cu130, transformers 5.17, peft 0.21, huggingface-hub 1.33, einops; no network) as
# an xz'd `pip --target` site in parts of at most 44 MiB (one part today: see below).
#   DEST=.device/megatron bash benchmarks/device/megatron-bridge-site.sh     # from the project root
#   SITE_OUT=/some/dir ...   also leaves the unpacked site there (an import check without a GPU)
#   TRANSFORMERS=5.12.1 ...  adds transformers (and tokenizers 0.22.2, which 5.12.1 requires) for
#                            megatron-bridge's declared range; not needed: see below
# DEST must be git-ignored (/.device/ in .git/info/exclude).
#
# What travels and why (checked on CPU with the same versions, tests/integration/
# test_megatron_bridge_cpu.py, and by listing what the engine's process imports):
# - megatron-bridge 0.6.2 (py3 wheel) and megatron-core 0.19.2 (cp312 wheel), --no-deps. None of
#   megatron-bridge's own requirements travel: it imports without wandb, mlflow, flashinfer,
#   nvidia-resiliency-ext, diffusers, timm, open-clip, hydra, datasets ... (each is a guarded or
#   lazy import), and without Transformer Engine (services/trainer/engines/megatron/bridge_import.py
#   answers its one unguarded `import transformer_engine.pytorch`; the engine builds the model
#   from megatron-core's local layer spec). What it does import at module level beyond that
#   (einops, transformers, huggingface-hub <2, rich, psutil, packaging, pyyaml, omegaconf) is on
#   the image, omegaconf in benchmarks/wheels (h200_env.sh installs it with msgspec and nats).
# - transformers: megatron-bridge 0.6.2 declares transformers >=5.8,<=5.12.1, but it imports and
#   runs with 5.17 (the image's); it does not import with 5.24 (it reads
#   transformers.modeling_attn_mask_utils, gone there). So nothing of transformers travels.
# Measured (December 2026): 22 MB unpacked, one part: see the `ls -l` this prints.
#
# On the device (one call; benchmarks/run_megatron_bridge_gpu.sh unpacks the part itself):
#   carry [".device/megatron/part_aa"]:  bash benchmarks/run_megatron_bridge_gpu.sh
set -euo pipefail
DEST=${DEST:-.device/megatron}
CLEAN=()
if [ -n "${SITE_OUT:-}" ]; then SITE=$SITE_OUT; rm -rf "$SITE"; mkdir -p "$SITE"; else SITE=$(mktemp -d); CLEAN+=("$SITE"); fi
WHEELS=$(mktemp -d); CLEAN+=("$WHEELS")
trap 'rm -rf "${CLEAN[@]}"' EXIT
PY=${PYTHON:-python3}
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
PKGS=(megatron-bridge==0.6.2 megatron-core==0.19.2)
[ -n "${TRANSFORMERS:-}" ] && PKGS+=("transformers==$TRANSFORMERS" tokenizers==0.22.2)
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WHEELS" "${PKGS[@]}"
# --ignore-requires-python: only when this runs on another Python than 3.12 (megatron-bridge says
# >=3.12,<3.13; the site is for the image's 3.12)
"$PY" -m pip install -q --no-deps --no-index --no-compile --ignore-requires-python "${PLAT[@]}" \
  --find-links "$WHEELS" --target "$SITE" "${PKGS[@]}"
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$SITE"/bin
mkdir -p "$DEST"; rm -f "$DEST"/part_*
tar -C "$SITE" -cf - . | xz -T2 -9 | split -b 44m - "$DEST/part_"
du -sb "$SITE" | awk '{print "unpacked bytes:", $1}'
ls -l "$DEST"
