"""The kit's own subcommands that stages run as steps, each ending with one JSON line (``KIT-JSON: …``):
``software`` (imports, versions, CUDA, what the project finds), ``doctor`` (``cast-llm doctor``: every custom
kernel's verdict on this GPU, timed against its reference), ``convert`` (the embedded GGUF into the cache),
``check-export`` (a run's exact 2:4 export) and ``linear-check`` (2:4 ``F.linear`` against dense per shape)."""

from __future__ import annotations

import contextlib
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from gpukit.common import emit_json
from gpukit.image import IMAGE_VERSIONS, WHEELS


def cmd_software(args) -> int:
    """Imports and versions, CUDA, and the project's view of the embedded model, corpus and WikiText-2."""
    import importlib.metadata as md

    res: dict = {"python": platform.python_version(), "executable": sys.executable, "packages": {}, "missing": []}
    mods = [("torch", "torch"), ("transformers", "transformers"), ("accelerate", "accelerate"), ("peft", "peft"),
            ("safetensors", "safetensors"), ("tokenizers", "tokenizers"), ("triton", "triton"), ("numpy", "numpy"),
            ("yaml", "pyyaml"), ("tqdm", "tqdm"), ("matplotlib", "matplotlib"), ("pytest", "pytest"),
            ("hypothesis", "hypothesis"), ("tensorboard", "tensorboard"), ("pyarrow", "pyarrow")]
    mods += [(w.replace("-", "_"), w) for w in WHEELS]
    for mod, dist in mods:
        try:
            importlib.import_module(mod)
            res["packages"][dist] = md.version(dist)
        except Exception as e:
            res["missing"].append(f"{dist}: {type(e).__name__}: {e}"[:200])
    notes = [f"{k} {res['packages'].get(k)} (KINDS.md: {v})" for k, v in IMAGE_VERSIONS.items()
             if k in res["packages"] and not res["packages"][k].startswith(v)]
    if notes and args.device != "cpu":
        res["version_notes"] = notes
    import torch

    cuda = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
            "torch_version": torch.__version__}
    if cuda["available"]:
        p = torch.cuda.get_device_properties(0)
        cuda.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported(),
                    cusparselt=torch.backends.cusparselt.is_available(),
                    cusparselt_version=torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None,
                    cudnn=torch.backends.cudnn.version())
    res["cuda"] = cuda
    from cast_llm.deploy.semi_structured import semi_structured_unavailable_reason
    from cast_llm.optim.triton_adams import unavailable_reason

    res["triton_adams"] = unavailable_reason() or "available"
    res["semi_structured"] = semi_structured_unavailable_reason() or "available"
    emb: dict = {}
    for key, fn in (("model", lambda: __import__("cast_llm.models", fromlist=["x"]).embedded_gguf("smollm2-135m")),
                    ("corpus", lambda: __import__("cast_llm.data", fromlist=["x"]).embedded_file("wiki-summaries")),
                    ("wikitext2", lambda: __import__("cast_llm.eval.ppl", fromlist=["x"]).wikitext2_file())):
        try:
            emb[key] = str(fn())
        except Exception as e:
            emb[key] = f"unavailable: {type(e).__name__}: {e}"[:300]
    res["embedded"] = emb
    required = [m for m in res["missing"] if not (args.device == "cpu" and m.startswith("triton"))]
    res["ok"] = not required and (args.device == "cpu" or cuda["available"])
    if args.device != "cpu" and not cuda["available"]:
        res["error"] = "no CUDA device visible"
    emit_json(res)
    return 0


def cmd_doctor(args) -> int:
    """``cast-llm doctor``, first thing on the machine: the table into the log, the whole report as JSON."""
    from cast_llm.doctor import doctor, format_doctor

    report = doctor()
    print(format_doctor(report), flush=True)
    failed = [f"{r['path']} [{r['candidate']}] on {r['device']} ({r['variant']}): {r.get('error')}"
              for r in report["rows"] if r["verdict"] == "fail"]
    emit_json({"ok": True, "failed": failed, "report": report})
    return 0


def cmd_convert(args) -> int:
    """Convert the embedded GGUF once into the project's cache (``$CAST_LLM_CACHE``) and load it back."""
    from cast_llm.models import cache_dir, load_model, load_tokenizer

    t = time.perf_counter()
    tok = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m")
    res = {"ok": True, "seconds": round(time.perf_counter() - t, 1), "cache": str(cache_dir()),
           "cached": sorted(p.name for p in cache_dir().iterdir()) if cache_dir().is_dir() else [],
           "parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tok)}
    emit_json(res)
    return 0


def cmd_check_export(args) -> int:
    """The exported run loads in plain transformers, every target is exactly 2:4, and a forward is finite."""
    import torch
    from transformers import AutoModelForCausalLM

    from cast_llm.deploy.export import sparsity_report

    run = Path(args.run_dir)
    meta = json.loads((run / "config.json").read_text()).get("sparsity", {})
    model = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32)
    rows = sparsity_report(model, n=2, m=4)
    bad = [r.name for r in rows if not r.is_nm]
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model.to(device).eval()
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (2, 32), device=device)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        finite = bool(torch.isfinite(model(input_ids=ids).logits).all())
    listed = set(meta.get("targets", []))
    res = {"targets": len(rows), "exact_2to4": not bad, "not_2to4": bad[:10], "finite_forward": finite,
           "metadata_targets": len(listed), "metadata_matches": listed == {r.name for r in rows} if listed else None,
           "sparsity": round(sum(r.zeros for r in rows) / max(1, sum(r.numel for r in rows)), 4)}
    res["ok"] = res["exact_2to4"] and finite and bool(rows)
    emit_json(res)
    return 0


LINEAR_SHAPES = {"llama-7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
                 "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536)], "tiny": [(64, 64), (128, 64)]}


def cmd_linear_check(args) -> int:
    """2:4 semi-structured F.linear vs dense on the same pruned weights: outputs (max |Δ| / max |y|) and the
    median time of each (CUDA events), per shape; also ``W_s @ Xᵀ`` with a pre-transposed input (the product
    the sparse kernels compute natively: what F.linear's transposes cost). The targets (``min_speedup``,
    ``max_rel_err``) are taken over the first shape set named; every set's rows are reported."""
    import torch
    import torch.nn.functional as F

    from cast_llm.deploy.semi_structured import semi_structured_unavailable_reason
    from cast_llm.sparsity.mask import nm_mask

    device = torch.device(args.device)
    reason = semi_structured_unavailable_reason(device)  # a sentence on CPU, None on an sm80+ GPU
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    shapes = []
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in LINEAR_SHAPES]
    if unknown or not names:
        raise SystemExit(f"linear-check: unknown shape set(s) {unknown or args.shapes!r}; known: "
                         f"{', '.join(sorted(LINEAR_SHAPES))}")
    for set_name, (out_f, in_f) in ((n, sh) for n in names for sh in LINEAR_SHAPES[n]):
        w = torch.randn(out_f, in_f, generator=g).to(device=device, dtype=dtype)
        w.masked_fill_(~nm_mask(w, 2, 4), 0)
        x = torch.randn(args.tokens, in_f, generator=g).to(device=device, dtype=dtype)
        row = {"set": set_name, "out": out_f, "in": in_f, "tokens": args.tokens}
        if reason is None:
            from torch.sparse import to_sparse_semi_structured

            ws = to_sparse_semi_structured(w)
            yd, ys = F.linear(x, w).float(), F.linear(x, ws).float()
            row["max_rel_err"] = float((ys - yd).abs().max() / yd.abs().max())

            def timed(fn, reps=args.repeats):
                for _ in range(3):
                    fn()
                times = []
                for _ in range(reps):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) * 1e3)
                return statistics.median(times)

            row["dense_us"] = timed(lambda: F.linear(x, w))  # noqa: B023
            row["sparse_us"] = timed(lambda: F.linear(x, ws))  # noqa: B023
            row["speedup"] = row["dense_us"] / row["sparse_us"]
            try:  # a diagnostic: its failure must not cost the F.linear measurement above
                xt = x.t().contiguous()
                row["mm_rel_err"] = float((ws @ xt).float().t().sub(yd).abs().max() / yd.abs().max())
                row["sparse_mm_us"] = timed(lambda: ws @ xt)  # noqa: B023
                row["mm_speedup"] = row["dense_us"] / row["sparse_mm_us"]
            except Exception as e:  # noqa: BLE001
                row["mm_error"] = f"{type(e).__name__}: {e}"[:300]
        shapes.append(row)
    res = {"device": str(device), "dtype": args.dtype, "shapes": shapes, "skipped": reason}
    if reason is None:
        first = [r for r in shapes if r["set"] == names[0]]
        res["min_speedup"] = min(r["speedup"] for r in first)
        res["max_rel_err"] = max(r["max_rel_err"] for r in first)
        res["max_rel_err_all"] = max(max(r["max_rel_err"], r["mm_rel_err"]) for r in shapes)
        res["backend"] = "cusparselt" if torch.backends.cusparselt.is_available() else "cutlass"
    emit_json(res)
    return 0
