"""What the package calls a linear layer, and how a layer is replaced inside a model.

A *linear layer* is an ``nn.Linear`` or transformers' GPT-2 ``Conv1D`` (weight stored ``(in, out)``) whose
forward is the plain ``x Wᵀ + b`` (:func:`is_linear_like`). A *wrapper* holds such a layer as
``base_layer`` (peft's convention; :mod:`cast_llm.nn`), so the weight Parameter keeps its identity; a
*scaling wrapper* is a wrapper with a learnable ``scale`` (:class:`cast_llm.nn.ScaledLinear`): it computes
a dense linear map of its base layer's shape, so target selection (:mod:`cast_llm.targets`) treats it as
the layer itself. These are recognised by what they are, so this module — and :mod:`cast_llm.targets`,
which uses it — imports none of the wrapper classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["is_linear_like", "is_scaled_linear", "linear_features", "linear_forward", "set_submodule"]


def _conv1d_type() -> type | None:
    """transformers' GPT-2 ``Conv1D`` (weight ``(in, out)``, ``y = x @ W + b``), or None without transformers."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is a dependency, but the math here must not need it
        return None
    return Conv1D


def is_linear_like(module: nn.Module) -> bool:
    """True for modules whose forward a wrapper can reproduce exactly: ``nn.Linear`` and GPT-2 ``Conv1D``.

    Subclasses that override ``forward`` (quantized or LoRA linears) are not linear-like: their forward is
    not ``x W^T + b`` and wrapping them would silently change the model.
    """
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    conv1d = _conv1d_type()
    return conv1d is not None and isinstance(module, conv1d) and type(module).forward is conv1d.forward


def is_scaled_linear(module: nn.Module) -> bool:
    """True for a weight-scaling wrapper: a linear-like ``base_layer`` and a learnable ``scale`` Parameter
    (:class:`cast_llm.nn.ScaledLinear`)."""
    base = getattr(module, "base_layer", None)
    return (isinstance(base, nn.Module) and is_linear_like(base)
            and isinstance(getattr(module, "scale", None), nn.Parameter))


def linear_features(module: nn.Module) -> tuple[int, int, bool]:
    """``(in_features, out_features, transposed)`` of an ``nn.Linear`` / ``Conv1D`` / scaling wrapper.

    ``transposed`` is True when the weight is stored ``(in, out)`` (GPT-2 ``Conv1D``): its N:M groups then
    run along dim 0 instead of the last dim.
    """
    if is_scaled_linear(module):
        return linear_features(module.base_layer)
    if not is_linear_like(module):
        raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(module).__name__}")
    if isinstance(module, nn.Linear):
        out_f, in_f = module.weight.shape
        return in_f, out_f, False
    in_f, out_f = module.weight.shape  # Conv1D stores (nx, nf) = (in, out)
    return in_f, out_f, True


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   transposed: bool) -> torch.Tensor:
    """``nn.Linear`` semantics (weight ``(out, in)``), or GPT-2 ``Conv1D`` semantics when ``transposed``:
    ``y = x @ W + b`` with ``W`` of shape ``(in, out)``."""
    if not transposed:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, weight.shape[0])
    y = torch.mm(flat, weight) if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


def set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    """Replace the submodule named ``fqn`` (``"model.layers.0.mlp.up_proj"``) of ``model`` by ``module``."""
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
