#!/usr/bin/env bash
# The CUDA benchmark of docs/BENCHMARKS.md: a LLaMA-13B-shaped random-weight model (its first LAYERS
# layers), F16 and Q4_0, fully on the GPU, our engine and llama.cpp on the same dense GGUF files.
#   tools/bench_gpu.sh LLAMA_BIN_DIR OUT_DIR [LAYERS]
set -euo pipefail
bin=$1; out=$2; layers=${3:-12}
mkdir -p "$out"
for t in f16 q4_0; do
    [ -f "$out/l13b-$t.gguf" ] || python3 -m tools.make_synthetic_model llama-13b --dense --type "$t" \
        --layers "$layers" -o "$out/l13b-$t.gguf"
done
for t in f16 q4_0; do
    python3 -m pyinfer bench -m "$out/l13b-$t.gguf" -ngl 99 -p 512 -n 32 -r 5 -o json > "$out/pyinfer-$t.json"
    "$bin/llama-bench" -m "$out/l13b-$t.gguf" -ngl 99 -p 512 -n 32 -r 5 -o json > "$out/llamacpp-$t.json"
done
python3 -m tools.compare_bench --ours "$out"/pyinfer-*.json --llamacpp "$out"/llamacpp-*.json
