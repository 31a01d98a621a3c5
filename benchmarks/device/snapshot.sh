#!/usr/bin/env bash
# The committed tree as .device/src.tgz, with its commit id in .commit: what benchmarks/h200_env.sh
# unpacks on the lent GPU and runs instead of the working tree (which travels with whatever is
# being edited at the time). Run from the project root after committing.
set -euo pipefail
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
git archive --format=tar -o "$tmp/src.tar" HEAD
git rev-parse --short HEAD > "$tmp/.commit"
tar -C "$tmp" -rf "$tmp/src.tar" .commit
mkdir -p .device && gzip -9 -c "$tmp/src.tar" > .device/src.tgz
echo "snapshot $(cat "$tmp/.commit"): $(du -h .device/src.tgz | cut -f1)"
