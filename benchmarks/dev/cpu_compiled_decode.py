"""Does torch.compile (inductor's C++ on CPU) take the decode step's host work away, dense and 2:4?

StaticDecoder's step, eager and compiled (mode="default", dynamic=False; the 2:4 layers one opaque op each),
for the dense model (torch bf16) and the 2:4 model (dispatched for 1 token), ms/step over greedy steps after a
128-token prompt, and the compile time.

    python benchmarks/dev/cpu_compiled_decode.py random:tinyllama-1.1b 32
"""

from __future__ import annotations

import sys
import time

import torch
from decode_profile import pruned_bf16_model  # (this folder)

from cast_llm.deploy.sparse24 import plan_sparse24_, to_sparse24_
from cast_llm.deploy.sparse24.decode import StaticDecoder


class Compiled:
    name = "eager"  # (StaticDecoder's unchecked branch: this is a dev probe, the logits are compared below)

    def warmup(self, fn):
        return fn()

    def capture(self, fn):
        t0 = time.perf_counter()
        self.fn = torch.compile(fn, dynamic=False)
        self.fn()
        self.compile_s = time.perf_counter() - t0

    def replay(self):
        return self.fn()


class Eager(Compiled):
    def capture(self, fn):
        self.fn, self.compile_s = fn, 0.0


def run(model, runner, n, prompt):
    dec = StaticDecoder(model, batch_size=1, max_len=prompt.shape[1] + n + 8, runner=runner)
    tok = dec.prefill(prompt).argmax(-1)
    tok = dec.step(tok).argmax(-1)
    first = dec.step(tok)  # capture (compile) here
    tok = first.argmax(-1)
    t0 = time.perf_counter()
    logits = []
    for _ in range(n):
        out = dec.step(tok)
        logits.append(out.float().clone())
        tok = out.argmax(-1)
    return (time.perf_counter() - t0) / n, runner.compile_s, torch.stack(logits)


@torch.inference_mode()
def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else "random:tinyllama-1.1b"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    torch.set_num_threads(2)
    model, targets = pruned_bf16_model(spec)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    res = {}
    for label in ("dense", "2:4"):
        if label == "2:4":
            to_sparse24_(model, targets=targets)
            plan_sparse24_(model, [1, 128], modes=("eager",), release=True)
        for kind, cls in (("eager", Eager), ("compiled", Compiled), ("eager again", Eager)):
            s, c, lg = run(model, cls(), n, prompt)
            res[(label, kind)] = (s, lg)
            print(f"{label:5s} {kind:12s} {s * 1e3:7.1f} ms/step   compile {c:6.1f} s", flush=True)
        a, b = res[(label, "eager")][1], res[(label, "compiled")][1]
        print(f"{label}: compiled vs eager logits max|Δ|/max = {float((a - b).abs().max() / a.abs().max()):.3g}")
    d, s = res[("dense", "eager")][0], res[("2:4", "compiled")][0]
    print(f"2:4 compiled / dense eager: {d / s:.2f}x; dense compiled / dense eager "
          f"{d / res[('dense', 'compiled')][0]:.2f}x; 2:4 compiled vs dense compiled "
          f"{res[('dense', 'compiled')][0] / s:.2f}x")


if __name__ == "__main__":
    main()
