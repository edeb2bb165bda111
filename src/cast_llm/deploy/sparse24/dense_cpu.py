"""The careful dense CPU GEMV for the layers that stay dense (the LM head): the CPU extension's ``dense_mm``
(vdpbf16ps, or AVX2 FMA on weights widened in registers; one row a block, torch's threads) — at one token it reads the dense bf16 weight ~1.5-2× faster than
torch's ``F.linear`` on the CPUs measured (docs/results/cpu24-notes.md §3-4), and the head of a small model is a
large share of each decode step's bytes (SmolLM2-135M: 28 M of its 135 M parameters).

:func:`use_careful_head_` swaps ``lm_head`` for :class:`CarefulDenseLinear` only where it passes a check
against ``F.linear`` and measures faster at one token (weights cycled past the cache) on this machine; the
wrapper holds the same Parameter (a tied head stays tied, no copy) and runs ``F.linear`` for more tokens.
``CAST_LLM_KERNELS=reference`` keeps torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cast_llm import kernels
from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24.cycles import cycled_many

__all__ = ["CarefulDenseLinear", "restore_head_", "use_careful_head_"]


class CarefulDenseLinear(nn.Module):
    """``nn.Linear``'s map with the extension's GEMV at one token, ``F.linear`` otherwise (same Parameters)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._op = cpu24.load_extension().dense_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return self._op(x.reshape(1, -1), self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def to_linear(self) -> nn.Linear:
        """The plain ``nn.Linear`` again (the same Parameters)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, careful dense GEMV at 1 token"


@torch.no_grad()
def use_careful_head_(model: nn.Module, *, min_speedup: float = 1.05) -> str | None:
    """Swap ``model``'s output head (``get_output_embeddings()``) in place where the careful GEMV passes its
    check and is faster here; returns a few words on what was decided (None: not applicable)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or head.weight.dtype != torch.bfloat16 or head.weight.device.type != "cpu":
        return None
    if kernels.mode() == kernels.REFERENCE or cpu24.dense_unavailable_reason():
        return "LM head: torch's F.linear (the careful GEMV cannot run here)"
    x = torch.randn(1, head.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    ref = x.double() @ head.weight.double().t() + (0 if head.bias is None else head.bias.double())
    y = cpu24.dense_mm(x, head.weight, head.bias).double()
    err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    if not err <= 8e-3:
        return f"LM head: torch's F.linear (the careful GEMV failed its check: max|Δ|/max|y| = {err:.3g})"
    # the head is read once per token, after the whole model: time it from DRAM, the two candidates walking one
    # ring of copies of the weight (2x the cache together), interleaved round by round (as the dispatcher times)
    torch_s, careful_s = cycled_many([(lambda w: F.linear(x, w, head.bias), head.weight),
                                      (lambda w: cpu24.dense_mm(x, w, head.bias), head.weight)])
    if torch_s < careful_s * min_speedup:
        return f"LM head: torch's F.linear ({torch_s * 1e3:.2f} ms against the careful GEMV's {careful_s * 1e3:.2f})"
    model.set_output_embeddings(CarefulDenseLinear(head))
    return f"LM head: the careful GEMV ({careful_s * 1e3:.2f} ms a token against torch's {torch_s * 1e3:.2f})"


def restore_head_(model: nn.Module) -> bool:
    """Undo :func:`use_careful_head_` (True if there was something to undo)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, CarefulDenseLinear):
        model.set_output_embeddings(head.to_linear())
        return True
    return False
