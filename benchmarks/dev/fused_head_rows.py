"""How many fp32 ``chunk × V`` rows the fused head (``--fused-head``) holds at its peak, with KD and without (fp32,
as the CPU trainer runs it): the loss term of the memory plan (``cast_llm/plan/memory.py``) is set from this.

Measured as resident memory over what existed before the loss (``VmHWM`` after ``clear_refs``), after one short
call of the loss (a training step's steady state: the first call also allocates ~230 MB once, whatever the chunk);
run it with glibc giving freed blocks back (``MALLOC_MMAP_THRESHOLD_=131072``) so that the resident set follows the
tensors, and with ``CAST_LLM_COMPILE=0`` for the KD loss's eager path (else its compiled chunk where torch.compile
runs: one row less):

    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python benchmarks/dev/fused_head_rows.py kd
    MALLOC_MMAP_THRESHOLD_=131072 OMP_NUM_THREADS=1 python benchmarks/dev/fused_head_rows.py ce

V = 128,256 (LLaMA-3's), h = 576 (SmolLM2-135M's), 2,048 tokens in chunks of 1,024 (the default --kd-chunk-size);
``--vocab`` / ``--hidden`` for a smaller case (tests/test_head_loss.py runs it at 32,768 × 64).
"""

import argparse

import torch

from cast_llm.distill.head import fused_head_loss


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("loss", choices=["ce", "kd"])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=576)
    args = ap.parse_args()
    kd = args.loss == "kd"
    V, h, N, c = args.vocab, args.hidden, 2048, 1024
    torch.manual_seed(0)
    w = torch.randn(V, h, requires_grad=True)
    hid = torch.randn(N, h, requires_grad=True)
    tw, th = (torch.randn(V, h), torch.randn(N, h)) if kd else (None, None)
    ids = torch.randint(0, V, (1, N))
    fused_head_loss(hid[None, :8], w, None if th is None else th[None, :8], tw, ids[:, :8], eta=2 / 3 if kd else 0.0,
                    chunk_size=c)  # the first call's one-time allocations
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    out = fused_head_loss(hid[None], w, None if th is None else th[None], tw, ids, eta=2 / 3 if kd else 0.0,
                          chunk_size=c)
    fwd = status("VmHWM") - base
    out.loss.backward()
    row, head = c * V * 4, V * h * 4
    print(f"{'KD' if kd else 'CE'}: forward peak over the inputs {fwd / 2**30:.3f} GiB = the head's fp32 gradient "
          f"accumulator ({head / 2**30:.3f}) + {(fwd - head) / row:.2f} rows of chunk × V fp32 ({row / 2**30:.3f} GiB)")


if __name__ == "__main__":
    main()
