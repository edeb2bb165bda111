"""Peak memory of the loss through the LM head at a 128k vocabulary, on CPU: ``--fused-head`` against full logits.

One forward + backward of Eq. 13 (student and teacher heads, KD on, bf16 autocast with fp32 master weights, as
the trainer on a GPU) for each implementation, each in a fresh child process; the figure is the process's peak
resident memory (``VmHWM``, reset once the inputs exist: Linux's ``clear_refs``) over what it held then — the
memory the loss itself needs on top of the model:

* ``logits`` — the ordinary head: student and teacher logits whole (bf16), then the chunked KD loss;
* ``fused`` — :func:`cast_llm.distill.head.fused_head_loss` of this checkout;
* ``fused@REV`` (``--before REV``) — the same function as of git revision REV (its file read with ``git show``),
  beside it in the same run: what a change to the fused head did.

The inputs: a ``V × h`` fp32 head weight (the student's, trainable) and the teacher's in bf16, ``N × h`` hidden
states of both. Expected (V = 128,256, h = 2,048, N = 512, chunks of 256): the head's gradient in fp32 (1 GiB)
and its bf16 matmul copy (0.5 GiB) in every variant; the full logits add student + teacher + gradient; before
issue 29 the fused head added a ``V × h`` bf16 product and its fp32 copy per chunk (1.5 GiB), after it a
chunk-sized fp32 gradient (``c × V``, 0.13 GiB) instead.

    python benchmarks/fused_head_memory.py --before 211d34b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))  # kB


def _reset_peak() -> int:
    """Reset the process's peak resident memory (Linux: ``clear_refs`` 5) to what it holds now; return that."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _rss_peak() -> int:
    return _status("VmHWM")


def child(variant: str, vocab: int, hidden: int, tokens: int, chunk: int, module_path: str | None) -> dict:
    """Run one variant in this (fresh) process and return its peak growth in bytes."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if module_path:  # an earlier revision of cast_llm/distill/head.py, loaded under its own name
        import importlib.util

        spec = importlib.util.spec_from_file_location("head_loss_before", module_path)
        head_loss = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(head_loss)
    else:
        from cast_llm.distill import head as head_loss
    from cast_llm.distill import causal_kd_loss

    weight = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.02)
    t_weight = (torch.randn(vocab, hidden) * 0.02).bfloat16()
    h = (torch.randn(1, tokens, hidden)).requires_grad_(True)
    th = torch.randn(1, tokens, hidden).bfloat16()
    ids = torch.randint(0, vocab, (1, tokens))
    base = _reset_peak()  # the inputs' own creation (randn temporaries) must not count as the loss's peak
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if variant == "logits":
            logits = h @ weight.t()
            t_logits = th @ t_weight.t()
            out = causal_kd_loss(logits, t_logits, ids, eta=0.5, chunk_size=chunk)
        else:
            out = head_loss.fused_head_loss(h, weight, th, t_weight, ids, eta=0.5, chunk_size=chunk)
    out.loss.backward()
    return {"variant": variant, "peak_growth_bytes": _rss_peak() - base, "seconds": time.perf_counter() - start,
            "loss": float(out.loss), "weight_grad_dtype": str(weight.grad.dtype)}


def run_child(variant: str, args, module_path: str | None = None) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import fused_head_memory as m; "
            f"print('RESULT ' + json.dumps(m.child({variant!r}, {args.vocab}, {args.hidden}, {args.tokens}, "
            f"{args.chunk}, {module_path!r})))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant}: {proc.stderr[-2000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256, help="LLaMA-3's vocabulary")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256, help="--kd-chunk-size")
    ap.add_argument("--before", default=None, help="also measure cast_llm/distill/head.py as of this git revision")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = [run_child("logits", args), run_child("fused", args)]
    if args.before:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:src/cast_llm/distill/head.py"],
                              capture_output=True, text=True, check=True).stdout
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(text)
        try:
            rows.append({**run_child("fused", args, f.name), "variant": f"fused@{args.before}"})
        finally:
            os.unlink(f.name)
    gib = 2**30
    print(f"V = {args.vocab:,}, h = {args.hidden:,}, {args.tokens} tokens, chunks of {args.chunk}, bf16 autocast, "
          "fp32 master weights, KD on; peak resident memory over the inputs, one child process each:")
    for r in rows:
        print(f"  {r['variant']:<22} {r['peak_growth_bytes'] / gib:6.2f} GiB   {r['seconds']:6.1f} s   "
              f"loss {r['loss']:.5f}   weight gradient {r['weight_grad_dtype']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "settings": vars(args) | {"json": str(args.json)}},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
