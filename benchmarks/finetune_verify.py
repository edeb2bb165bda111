"""Check a `cast-llm finetune` output with plain transformers + safetensors only (cast_llm is never imported).

    python benchmarks/finetune_verify.py RUN_DIR [PROMPT_JSONL]

Counts the non-zeros in every group of 4 consecutive input weights of every decoder-block linear straight
from ``model.safetensors`` (the 2:4 check, independent of cast_llm's own), and, for a causal LM, greedily
answers the first prompt of PROMPT_JSONL with ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import json
import sys

from safetensors.torch import load_file


def main(run: str, prompts: str | None) -> None:
    state = load_file(f"{run}/model.safetensors")
    # LLaMA-style names; Linear weights are (out, in), so groups of 4 run along the last dim
    linears = [k for k in state if ".layers." in k and k.endswith("proj.weight")]
    ok = all(bool(((state[k] != 0).reshape(-1, 4).sum(1) <= 2).all()) for k in linears)
    zeros = sum(int((state[k] == 0).sum()) for k in linears) / sum(state[k].numel() for k in linears)
    print(f"{len(linears)} block linears, {zeros:.4%} zero, every group of 4 has at most 2 non-zeros: {ok}")
    if prompts:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok, model = AutoTokenizer.from_pretrained(run), AutoModelForCausalLM.from_pretrained(run)
        row = json.loads(open(prompts).readline())
        ids = tok(row["prompt"], return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=5, do_sample=False)
        answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"{row['prompt']!r} -> {answer!r} (reference {row['completion']!r})")
    assert "cast_llm" not in sys.modules


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
