"""Whole-model inference, dense vs 2:4, through Hugging Face ``generate`` and a CUDA-graph decoder (issue 21).

Models: SmolLM2-135M (the embedded weights, magnitude-pruned to 2:4), and LLaMA-7B- and LLaMA-3-8B-shaped
models with random weights made 2:4 (all 32 layers; built directly on the GPU in bf16). For each model the
dense model and its 2:4 twin share every tensor (the twin's targets are ``Sparse24Linear`` layers keeping
the dense weight only where their measured dispatch needs it), so both are timed **alternately** in one
process — run-to-run drift hits both equally. Per batch size 1, 8, 32 (prompts of 2,048 / 512 / 128 tokens):

* ``prefill`` — ``model.generate(ids, max_new_tokens=1)``: prompt tokens / s;
* ``decode_eager`` — ``generate`` of 9 tokens minus that of 1 (run back to back), per token: the eager
  Hugging Face loop, host-bound for both paths (reported, not a target);
* ``decode`` — :class:`~cast_llm.deploy.sparse24.decode.StaticDecoder`: static KV cache and the whole
  decoder step in one CUDA graph (``--graph manual``, default) or ``torch.compile(mode="reduce-overhead")``
  (``--graph compile``): generated tokens / s, with the KV cache of the prompt.

Before timing, the 2:4 twin is planned for exactly these token counts (eager: prefill and decode rows; graph:
decode rows) and keeps only the weight forms its decisions use. Weight memory is reported for both.

Exactness (``checks``): logits of the same weights, dense vs 2:4, on a (2 × 128) prompt and 8 teacher-forced
decode steps with the KV cache; ``rel_err = max|Δlogit| / max|logit|``. Beside it the **noise floor**: the
dense model against itself with every target GEMM accumulated in fp32 and rounded once — another valid
rounding order — which shows how far bf16 noise alone moves this model's logits. Checked at SmolLM2's shape
(random weights: well-conditioned) and LLaMA-7B's, and on the real SmolLM2 weights (whose magnitude-pruned
2:4 version amplifies bf16 noise strongly: compare with its floor).

Targets (top-level keys): ``model24_prefill_speedup`` (7B-shaped, 2,048 tokens, batch 1), ``model24_decode_speedup``
(7B-shaped, batch 1, graph decode), ``model24_min_speedup`` (smallest 2:4/dense ratio over every model, batch and
phase in {prefill, decode}; SmolLM2 included), ``model24_logits_rel_err`` (max over SmolLM2- and 7B-shaped
checks, prefill and decode). ``--tiny``: a tiny random LLaMA on the CPU in seconds — dense timings, the 2:4
side skipped with the reason (its logits still checked with the emulated CPU kernel), targets null.

    python benchmarks/inference24.py --json docs/results/gpu/inference24.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch
import torch.nn.functional as F
from _common import machine
from _sparse24 import SHAPES, command, identity, prune24_, random_llama, twin, write_json

from cast_llm.deploy.sparse24 import (
    Dispatcher,
    available_kernels,
    plan_sparse24_,
    sparse24_layers,
    sparse24_memory,
    to_sparse24_,
)
from cast_llm.deploy.sparse24.decode import StaticDecoder
from cast_llm.targets import find_targets

PROMPTS = {1: 2048, 8: 512, 32: 128}  # batch -> prompt tokens
EAGER_NEW = 8  # generated tokens timed through generate (eager; reported, not a target)
GRAPH_STEPS = 24  # decode steps timed per graph run
REPEATS = 3
SPEED_MODELS = ("llama-7b", "smollm2-135m", "llama3-8b")
CHECK_SHAPES = ("llama-7b", "smollm2-135m")  # model24_logits_rel_err: random weights at these shapes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_s(model, ids, new_tokens) -> float:
    sync(ids.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    sync(ids.device)
    return time.perf_counter() - t0


def graph_step_s(model, ids, steps, runner) -> float:
    """Seconds per decode step of a StaticDecoder, after its eager warm-up step and its capture."""
    b, p = ids.shape
    dec = StaticDecoder(model, batch_size=b, max_len=p + steps + 8, runner=runner)
    tok = dec.prefill(ids).argmax(-1)
    for _ in range(2 if runner == "manual" else 5):  # warm-up, capture (compile: cudagraph trees record late)
        tok = dec.step(tok).argmax(-1)
    sync(ids.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = dec.step(tok).argmax(-1)
    sync(ids.device)
    return (time.perf_counter() - t0) / steps


def alternate(fn_dense, fn_sparse, repeats):
    """Medians of alternating runs (one warm-up each): drift hits both paths alike."""
    fn_dense(), fn_sparse()
    d, s = [], []
    for _ in range(repeats):
        d.append(fn_dense())
        s.append(fn_sparse())
    return statistics.median(d), statistics.median(s), d, s


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@contextlib.contextmanager
def fp32_accumulated(model):
    """Every target GEMM computed in fp32 from the same bf16 values and rounded once: another valid rounding
    order than the bf16 GEMM's, i.e. a measure of the bf16 noise floor of this model's logits."""
    def fp32_forward(module):
        def forward(x):
            bias = None if module.bias is None else module.bias.float()
            return F.linear(x.float(), module.weight.float(), bias).to(x.dtype)
        return forward

    targets = find_targets(model, n=2, m=4)
    for t in targets:
        t.module.forward = fp32_forward(t.module)
    try:
        yield
    finally:
        for t in targets:
            del t.module.forward


def teacher_forced(model, ids, tokens):
    """Prefill logits (B, P, V) and the logits of feeding ``tokens`` (B, S) one by one with the KV cache."""
    out = model(ids, use_cache=True)
    pre, cache, dec = out.logits.float(), out.past_key_values, []
    for i in range(tokens.shape[1]):
        out = model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        dec.append(out.logits[:, -1].float())
    return pre, torch.stack(dec, 1)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.inference_mode()
def logits_check(name, dense, sparse, vocab, device, graph_runner, steps=8):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 128), generator=gen).to(device)
    tokens = torch.randint(0, vocab, (2, steps), generator=gen).to(device)
    pre_d, dec_d = teacher_forced(dense, ids, tokens)
    with fp32_accumulated(dense):
        pre_f, dec_f = teacher_forced(dense, ids, tokens)
    pre_s, dec_s = teacher_forced(sparse, ids, tokens)
    rows = [{"model": name, "phase": "prefill", "rel_err": rel(pre_s, pre_d), "noise_floor": rel(pre_f, pre_d),
             "max_abs_diff": float((pre_s - pre_d).abs().max()), "max_abs_logit": float(pre_d.abs().max())},
            {"model": name, "phase": "decode", "rel_err": rel(dec_s, dec_d), "noise_floor": rel(dec_f, dec_d),
             "max_abs_diff": float((dec_s - dec_d).abs().max()), "max_abs_logit": float(dec_d.abs().max())}]
    if graph_runner:  # the graphed decoder on the 2:4 model against the dense (eager) decode
        try:
            dec = StaticDecoder(sparse, batch_size=2, max_len=128 + steps + 2, runner=graph_runner)
            dec.prefill(ids)
            got = torch.stack([dec.step(tokens[:, i]).float().clone() for i in range(steps)], 1)
            rows[1]["graph_rel_err"] = rel(got, dec_d)
        except Exception as e:  # noqa: BLE001
            rows[1]["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return rows


def build(name, device, dtype, layers, real):
    if real:
        from cast_llm.models import load_model

        model = load_model("smollm2-135m", dtype=dtype, device=device).requires_grad_(False)
        return model, "embedded SmolLM2-135M-Instruct weights, magnitude-pruned to 2:4"
    model = random_llama(name, device, dtype, layers)
    return model, f"random weights (HF init), magnitude-pruned to 2:4, {model.config.num_hidden_layers} layers"


def run(name, kind, args, device, dtype, dispatcher, kernels, skipped, prompts, graph_runner):
    """One model: ``kind`` "speed" (timed rows; logits checked for the real SmolLM2 and the 7B shape) or
    "shape-check" (random weights at that shape, logits only)."""
    t0 = time.perf_counter()
    real = kind == "speed" and name == "smollm2-135m" and device.type == "cuda"
    dense, origin = build(name, device, dtype, args.layers, real)
    n_targets = prune24_(dense)
    vocab = dense.config.vocab_size
    sparse = twin(dense)
    info = {"model": name, "kind": kind, "weights": origin, "targets": n_targets,
            "layers": dense.config.num_hidden_layers}
    check = kind == "shape-check" or real or name == "llama-7b" or args.tiny
    rows, checks = [], []
    if not kernels:
        info["sparse_skipped"] = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        if device.type != "cuda":  # still check the layer plumbing, with the emulated CPU kernel
            to_sparse24_(sparse, kernels=("emulated",), dispatch=False)
            checks = logits_check(name, dense, sparse, vocab, device, None)
            for c in checks:
                c["kernel"] = "emulated (CPU reference, not a GPU kernel)"
    else:
        if check:  # exactness of each kernel: every target forced onto it (no dense fallback, no dispatch)
            for k in kernels:
                forced = twin(dense)
                to_sparse24_(forced, kernels=(k,), dispatch=False)
                # torch's op is not captured in a graph when the direct binding exists (see linear24.py)
                runner = None if k == "cusparselt" and "cusparselt-direct" in kernels else graph_runner
                for c in logits_check(name, dense, forced, vocab, device, runner):
                    checks.append({**c, "kernel": k})
                del forced
        to_sparse24_(sparse, kernels=kernels, dispatch=dispatcher)
        if kind == "speed":
            eager_counts = [b * p for b, p in prompts.items()] + list(prompts)
            held = sparse24_memory(sparse)
            plan = plan_sparse24_(sparse, {"eager": eager_counts, "graph": list(prompts)} if graph_runner
                                  else {"eager": eager_counts}, release=True)
            info["plan"] = summarize(plan)
            info["memory"] = {"dense_weights": weight_bytes(dense), "sparse_held_before_release": held,
                              "sparse_held": sparse24_memory(sparse), "sparse_layers": len(sparse24_layers(sparse))}
            if device.type == "cuda":
                info["memory"]["cuda_allocated"] = torch.cuda.memory_allocated(device)
    for c in checks:
        c["weights"] = origin
        # the target is about the kernels at these shapes: random weights (well-conditioned); the real,
        # one-shot-pruned SmolLM2 amplifies bf16 noise itself (see its noise_floor)
        c["counts_for_target"] = bool(kernels) and not real and name in CHECK_SHAPES
    if kind == "speed":
        for b, p in prompts.items():
            gen = torch.Generator().manual_seed(b)
            ids = torch.randint(0, vocab, (b, p), generator=gen).to(device)
            with torch.inference_mode():
                rows += measure(name, b, p, ids, dense, sparse if kernels else None, args, graph_runner)
    info["seconds"] = time.perf_counter() - t0
    del dense, sparse
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, rows, checks


def measure(name, b, p, ids, dense, sparse, args, graph_runner):
    rows = []

    def row(phase, tokens, d_s, s_s, d_all, s_all):
        r = {"model": name, "batch": b, "prompt": p, "phase": phase, "dense_ms": d_s * 1e3,
             "dense_runs_ms": [x * 1e3 for x in d_all]}
        if s_s is not None:
            r.update(sparse_ms=s_s * 1e3, sparse_runs_ms=[x * 1e3 for x in s_all])
        if d_s <= 0 or (s_s is not None and s_s <= 0):  # a difference of two timings lost in their noise
            r["note"] = "time not resolved above the measurement noise"
        else:
            r["dense_tok_s"] = tokens / d_s
            if s_s is not None:
                r.update(sparse_tok_s=tokens / s_s, ratio=d_s / s_s)
        rows.append(r)

    def both(fn):
        if sparse is None:
            fn(dense)
            d = [fn(dense) for _ in range(args.repeats)]
            return statistics.median(d), None, d, None
        return alternate(lambda: fn(dense), lambda: fn(sparse), args.repeats)

    pre = both(lambda m: generate_s(m, ids, 1))
    row("prefill", b * p, *pre)
    # per generated token: generate(1 + N) minus generate(1), measured back to back (paired: less noise)
    dec = both(lambda m: (generate_s(m, ids, args.new_tokens + 1) - generate_s(m, ids, 1)) / args.new_tokens)
    row("decode_eager", b, *dec)
    if graph_runner:
        try:
            g = both(lambda m: graph_step_s(m, ids, args.graph_steps, graph_runner))
            row("decode", b, *g)
            rows[-1]["runner"] = graph_runner
        except Exception as e:  # noqa: BLE001 - report, do not lose the other rows
            rows.append({"model": name, "batch": b, "prompt": p, "phase": "decode", "runner": graph_runner,
                         "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
    return rows


def summarize(plan):
    """{"<mode>:<tokens>": {kernel: number of layers}}"""
    out = {}
    for chosen in plan.values():
        for case, kernel in chosen.items():
            out.setdefault(case, {}).setdefault(kernel, 0)
            out[case][kernel] += 1
    return out


def targets(rows, checks, measured):
    def ratio(model, batch, phase):
        r = next((r for r in rows if r["model"] == model and r["batch"] == batch and r["phase"] == phase), None)
        return None if r is None else r.get("ratio")

    phase_rows = [r for r in rows if r["phase"] in ("prefill", "decode")]
    ratios = [r.get("ratio") for r in phase_rows]
    complete = "smollm2-135m" in measured and ratios and all(x is not None for x in ratios)
    counted = [c for c in checks if c["counts_for_target"]]
    # every 2:4 kernel, prefill and decode; the CUDA-graph decode too (against the dense decode)
    errs = [c["rel_err"] for c in counted] + [c["graph_rel_err"] for c in counted if "graph_rel_err" in c]
    return {
        "model24_prefill_speedup": ratio("llama-7b", 1, "prefill"),
        "model24_decode_speedup": ratio("llama-7b", 1, "decode"),
        "model24_min_speedup": min(ratios) if complete else None,
        "model24_logits_rel_err": max(errs) if {c["model"] for c in counted} == set(CHECK_SHAPES) else None,
    }


def report(infos, rows, checks, keys):
    print(f"{'model':<14} {'batch':>5} {'prompt':>6} {'phase':<13} {'dense tok/s':>12} {'2:4 tok/s':>12} {'ratio':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<14} {r['batch']:>5} {r['prompt']:>6} {r['phase']:<13} failed: {r['error']}")
            continue
        if "note" in r:
            print(f"{r['model']:<14} {r['batch']:>5} {r['prompt']:>6} {r['phase']:<13} {r['note']}")
            continue
        s = f"{r['sparse_tok_s']:>12,.1f} {r['ratio']:>6.3f}x" if "ratio" in r else f"{'skipped':>12}"
        print(f"{r['model']:<14} {r['batch']:>5} {r['prompt']:>6} {r['phase']:<13} {r['dense_tok_s']:>12,.1f} {s}")
    for c in checks:
        extra = f", CUDA-graph decode {c['graph_rel_err']:.2e}" if "graph_rel_err" in c else c.get("graph_error", "")
        print(f"logits {c['model']} ({c.get('weights', '')}) {c['phase']}: max|Δ|/max|logit| = {c['rel_err']:.2e} "
              f"(bf16 noise floor {c['noise_floor']:.2e}){extra} {c.get('kernel', '')}")
    for i in infos:
        mem = i.get("memory")
        if mem:
            mib = 2 ** 20
            held = mem["sparse_held"]
            print(f"{i['model']}: weights dense {mem['dense_weights'] / mib:,.0f} MiB; 2:4 twin holds "
                  f"{held['total'] / mib:,.0f} MiB (compressed {held['compressed'] / mib:,.0f}, dense fallback "
                  f"{held['dense_fallback'] / mib:,.0f}, other {held['other'] / mib:,.0f}); plan {i.get('plan')}")
        if "sparse_skipped" in i:
            print(f"{i['model']}: 2:4 side skipped: {i['sparse_skipped']}")
        if "skipped" in i:
            print(f"{i['model']}: skipped: {i['skipped']}")
    for k, v in keys.items():
        print(f"{k}: {'n/a' if v is None else f'{v:.4g}'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write targets, rows, checks, device and versions to this file")
    ap.add_argument("--tiny", "--quick", action="store_true", help="a tiny random LLaMA on the CPU in seconds")
    ap.add_argument("--emulate", action="store_true",
                    help="a dry run of the GPU path's logic on the CPU: --tiny shapes, the 2:4 side run by the "
                         "emulated kernel, graph decode replaced by eager replays (no figure means anything; "
                         "targets null)")
    ap.add_argument("--models", default=",".join(SPEED_MODELS), help="speed models, in this order")
    ap.add_argument("--graph", default="manual", choices=("manual", "compile", "none"),
                    help="how the decode step is captured (none: no graph rows)")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count of random models")
    ap.add_argument("--new-tokens", type=int, default=EAGER_NEW)
    ap.add_argument("--graph-steps", type=int, default=GRAPH_STEPS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--dispatch-cache", default=None, help="JSON file of dispatch decisions to reuse / extend")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip models that would start after this")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dtype = torch.bfloat16
    if args.tiny or args.emulate:
        args.tiny = True
        device, models, prompts = torch.device("cpu"), ["tiny-llama"], {1: 16, 2: 8}
        dtype = torch.float32
        args.new_tokens, args.graph_steps, args.repeats = 3, 3, 1
    else:
        if not torch.cuda.is_available():
            raise SystemExit("inference24.py needs a CUDA GPU (use --tiny for the CPU dry run)")
        device, models, prompts = torch.device("cuda"), args.models.split(","), PROMPTS
        from cast_llm.deploy.sparse24 import cusparselt_direct

        cusparselt_direct.start_probe(device)  # ~10 s in a child process, overlapping the first model's build
    for m in models:
        if m not in SHAPES:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(SHAPES)}")
    graph_runner = None if args.graph == "none" or device.type != "cuda" else args.graph
    kernels, skipped = available_kernels(device, dtype)
    if args.emulate:
        kernels, graph_runner = ["emulated"], "eager"
    dispatcher = Dispatcher(device=device, cache_path=args.dispatch_cache) if kernels else None
    infos, rows, checks = [], [], []
    todo = [(m, "speed") for m in models]
    if not args.tiny:  # random weights at SmolLM2's shape, after the first two speed models
        todo.insert(min(2, len(todo)), ("smollm2-135m", "shape-check"))
    for name, kind in todo:
        if time.perf_counter() - t0 > args.budget_s:
            infos.append({"model": name, "kind": kind, "skipped": f"time budget of {args.budget_s:.0f} s used up"})
            continue
        info, r, c = run(name, kind, args, device, dtype, dispatcher, kernels, skipped, prompts, graph_runner)
        infos.append(info)
        rows += r
        checks += c
    measured = {r["model"] for r in rows if "ratio" in r}
    keys = targets(rows, checks, measured)
    if args.tiny:
        keys = dict.fromkeys(keys)  # never estimated: no 2:4 tensor-core kernel ran
    report(infos, rows, checks, keys)
    print(f"[{time.perf_counter() - t0:.0f} s]  machine: {machine()}")
    write_json(args.json, {
        **keys,
        "definitions": {
            "model24_prefill_speedup": "LLaMA-7B-shaped (random 2:4 weights, 32 layers), batch 1, 2,048-token "
                                       "prompt: 2:4 / dense prompt tokens per second through generate",
            "model24_decode_speedup": "LLaMA-7B-shaped, batch 1, decode with the KV cache of the 2,048-token "
                                      "prompt, whole step in a CUDA graph: 2:4 / dense tokens per second",
            "model24_min_speedup": "min of 2:4/dense over every model, batch (1, 8, 32) and phase (prefill, "
                                   "graph decode); eager-generate decode rows are reported, host-bound for both",
            "model24_logits_rel_err": "max over SmolLM2- and LLaMA-7B-shaped models (random weights made 2:4), "
                                      "prefill and 8 decode steps with the KV cache, of max|Δlogit|/max|logit|",
        },
        # what bounds model24_logits_rel_err: the same dense model moves this far when its target GEMMs are
        # accumulated in fp32 and rounded once (another correct rounding order); a correct 2:4 kernel lands near it
        "emulated": args.emulate,
        "logits_noise_floor": max((c["noise_floor"] for c in checks if c["counts_for_target"]), default=None),
        "rows": rows, "checks": checks, "models": infos, "skipped_kernels": skipped, "identity": identity(device),
        "dispatch_measured": len(dispatcher.measured) if dispatcher else 0, "command": command(),
        "seconds": time.perf_counter() - t0,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
