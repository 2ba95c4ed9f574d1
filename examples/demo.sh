#!/usr/bin/env bash
# The bundled demo: plan a real model's layout, then reshard a small real checkpoint into TP=2,
# verify it (bits and a distributed forward on gloo), merge it back and verify that too.
# Outputs go to $DEMO_OUT (default: a fresh temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DEMO_OUT:-$(mktemp -d)}
mkdir -p "$out"
sc() { echo "+ shardctl $*" >&2; python3 -m shardctl "$@"; }

sc plan manifests/llama-3-70b-tp8.yaml
sc reshard examples/tiny-llama "$out/tiny-llama-tp2" --tp 2 --force
sc inspect "$out/tiny-llama-tp2"
sc verify examples/tiny-llama "$out/tiny-llama-tp2"
sc reshard "$out/tiny-llama-tp2" "$out/tiny-llama-merged" --format hf --force
sc verify examples/tiny-llama "$out/tiny-llama-merged" --level bitwise
cmp examples/tiny-llama/model.safetensors "$out/tiny-llama-merged/model.safetensors"
echo "demo ok: merged checkpoint is byte-identical to the original ($out)"
