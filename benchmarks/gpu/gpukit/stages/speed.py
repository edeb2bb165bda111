"""Stage speed: the diagnostics of issue 16's first GPU session, run only when asked (the targets are the perf
stage's): the 2:4 semi-structured ``F.linear`` against dense per shape, with the pre-transposed ``W_s @ Xᵀ``
beside it (``kit.py linear-check``), and whole-model prefill / decode through ``cast-llm bench-inference``."""

from __future__ import annotations

import json
from pathlib import Path

from gpukit.executor import Ctx, Step
from gpukit.stages.correctness import parse_kit_json


def _inference_parser(json_file: Path):
    def parse(text: str, ctx: Ctx) -> dict:
        if not json_file.is_file():
            return {"ok": False, "error": "bench-inference wrote no JSON"}
        r = json.loads(json_file.read_text())
        d, s = r["dense"], r.get("sparse")
        out = {"model": r["model"], "device": r["device"], "dtype": r["dtype"], "config": r["config"],
               "dense_prefill_tok_s": d["prefill_tokens_per_s"], "dense_decode_tok_s": d["decode_tokens_per_s"],
               "sparse_skipped": r.get("sparse_skipped"), "max_abs_logit_diff": r.get("max_abs_logit_diff"),
               "per_linear": r.get("per_linear", []), "notes": r.get("notes", [])}
        if s:
            out.update(sparse_prefill_tok_s=s["prefill_tokens_per_s"], sparse_decode_tok_s=s["decode_tokens_per_s"],
                       prefill_speedup=s["prefill_tokens_per_s"] / d["prefill_tokens_per_s"],
                       decode_speedup=s["decode_tokens_per_s"] / d["decode_tokens_per_s"] if d["decode_tokens_per_s"] else None,
                       weight_bytes_ratio=s["all_weight_bytes"] / d["all_weight_bytes"])
        return out

    return parse


def steps(ctx: Ctx) -> list[Step]:
    sp = ctx.kit / "speed"
    sp.mkdir(parents=True, exist_ok=True)
    if ctx.dry:
        small = ["--device", "cpu", "--dtype", "fp32", "--batch-size", "1", "--prompt-len", "8", "--gen-len", "2",
                 "--warmup", "0", "--repeats", "1", "--linear-repeats", "1"]
        inf7b = ["-m", "cast_llm.cli", "bench-inference", ctx.model, *small]
        infs = ["-m", "cast_llm.cli", "bench-inference", ctx.model, *small]
        lin = ["benchmarks/gpu/kit.py", "linear-check", "--device", "cpu", "--dtype", "fp32", "--tokens", "16",
               "--shapes", "tiny"]
    else:
        inf7b = ["-m", "cast_llm.cli", "bench-inference", "random:llama-2-7b", "--dtype", "bf16", "--batch-size", "4",
                 "--prompt-len", "1024", "--gen-len", "16", "--repeats", "3"]
        infs = ["-m", "cast_llm.cli", "bench-inference", "smollm2-135m", "--dtype", "bf16", "--batch-size", "16",
                "--prompt-len", "512", "--gen-len", "64", "--repeats", "3"]
        lin = ["benchmarks/gpu/kit.py", "linear-check", "--device", "cuda", "--dtype", "bf16", "--tokens", "4096",
               "--shapes", "llama-7b,smollm2"]
    j7, js = sp / "inference-llama7b.json", sp / "inference-smollm2.json"
    return [
        Step("linear-2to4", argv=lin, timeout_s=120, min_s=30, parse=parse_kit_json),
        Step("inference-llama7b", argv=[*inf7b, "--json-out", str(j7)], timeout_s=300, min_s=120,
             parse=_inference_parser(j7), before=lambda ctx: j7.unlink(missing_ok=True)),
        Step("inference-smollm2", argv=[*infs, "--json-out", str(js)], timeout_s=180, min_s=60, needs=("model",),
             parse=_inference_parser(js), before=lambda ctx: js.unlink(missing_ok=True)),
    ]
