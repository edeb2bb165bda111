"""torch's matmul and a frozen head (cpu24-notes.md §55): F.linear of the last position of a 128-token hidden state
(a strided [1, 1, 576] view, as HF's generate passes with logits_to_keep=1) and a 49152x576 bf16 weight, with the weight
requiring grad or not, under grad, no_grad and inference mode."""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
w = torch.randn(49152, 576).bfloat16()
xs = torch.randn(1, 128, 576).bfloat16()[:, -1:, :]
for rg in (True, False):
    for ctx_name, ctx in (("grad", torch.enable_grad), ("no_grad", torch.no_grad), ("inference", torch.inference_mode)):
        p = torch.nn.Parameter(w.clone(), requires_grad=rg)
        with ctx():
            F.linear(xs, p)
            t0 = time.perf_counter()
            for _ in range(5):
                F.linear(xs, p)
            print(f"requires_grad={rg} {ctx_name}: {(time.perf_counter()-t0)/5*1e3:.1f} ms", flush=True)
