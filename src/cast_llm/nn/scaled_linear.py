"""Learnable weight scaling (method.md §3, Eq. 11-12).

CAST multiplies every N:M target weight by a learnable scale in the forward pass::

    W_scale = Diag(A) W                      (Eq. 11, row-wise: A in R^{out})
    W_scale[r, block b] = A[r, b] W[r, block b]   (Eq. 12, A in R^{out x n_groups})

where the ``n_groups`` blocks are equal contiguous slices of the *input* dimension of each output row
(the paper uses ``n_groups = 2``). The scale starts at 1, is trained as a dense parameter, compensates the
magnitude the L1 decay of AdamS takes from the weights, and is folded into the weight at the end
(``W <- Diag(A) (W ⊙ M)``), so the exported model is a plain ``nn.Linear`` / ``Conv1D`` again.

Because every block is a multiple of ``m`` columns, the scale is constant inside every N:M group and can
never change which entries a magnitude mask keeps; :class:`ScaledLinear` refuses shapes where that would
not hold.

Design notes (the "why"):

* **Forward strategy.** The forward builds the scaled weight (an elementwise ``out x in`` product) and runs
  one dense matmul. The alternatives are worse: scaling the *output* (only possible for ``n_groups = 1``)
  makes autograd keep the ``tokens x out`` pre-scale activation for the gradient of ``A``, and splitting
  the input into blocks (``n_groups > 1``) keeps ``n_groups`` partial products of ``tokens x out`` alive
  and runs ``n_groups`` smaller matmuls. Building the weight costs ``out x in`` multiplies per step (less
  than the matmul's ``tokens x out x in``), saves only ``W`` and ``A`` for backward, and under autocast the
  scaled weight simply replaces the low-precision weight copy autocast makes anyway (timings of the
  alternatives: docs/results/performance.md, §5). The forward is dense — CAST never masks in the
  forward. The product and its backward are one hand-written autograd function
  (:mod:`cast_llm.nn.scaled_weight`): one memory pass each way, the product written directly in the
  matmul's (autocast) dtype; on CUDA the backward is one Triton kernel per layer
  (:mod:`cast_llm.nn.triton_scaled_weight`). Scaling the output instead (exact only for ``n_groups = 1``:
  ``y = (x W^T) ⊙ A``) or splitting the input into ``n_groups`` matmuls trades the ``out x in`` product for
  ``tokens x out`` work and activations, and at ``n_groups = 2`` halves each matmul's inner dimension.
* **Scale dtype.** The scale is a float32 parameter even when the wrapped weight is bf16/fp16 (float64
  weights get a float64 scale, for reference tests): a scale near 1 in bf16 has a resolution of 2^-7, so
  updates of ``lr ~ 1e-4`` would be rounded away. The product ``W * A`` is formed in the promoted dtype and
  cast once to the weight's dtype, so a bf16 weight is rounded once, and under ``torch.autocast`` with
  fp32 master weights the matmul receives the fp32 scaled weight and autocast casts it as it would the
  plain weight. (Casting the whole model with ``model.to(bfloat16)`` *after* wrapping casts the scale too;
  wrap after choosing the model dtype.)
* **Folding** (:meth:`ScaledLinear.to_linear`) writes into the *same* weight Parameter and returns the
  original module object, so the optimizer state, masks keyed by Parameter, tied references and the
  state_dict keys of a Hugging Face checkpoint all survive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from cast_llm.errors import CastError
from cast_llm.layers import linear_features, linear_forward, set_submodule
from cast_llm.nn.recomputed_linear import recomputed_scaled_linear
from cast_llm.nn.scaled_group import group_by_block_, ungroup_
from cast_llm.nn.scaled_weight import matmul_dtype
from cast_llm.nn.scaled_weight import scaled_weight as _scaled_weight
from cast_llm.targets import select_targets

logger = logging.getLogger(__name__)

__all__ = ["ScaledLinear", "wrap_scaling_", "fold_scaling_"]


class ScaledLinear(nn.Module):
    """A linear layer with a learnable block-wise weight scale, ``W_scale = Diag(A) W`` (Eq. 11-12).

    Args:
        base_layer: the ``nn.Linear`` or transformers ``Conv1D`` to wrap; kept as ``self.base_layer``
            (peft-style), so its parameters keep their identity and their names gain a ``base_layer.``
            infix while wrapped.
        n_groups: number of equal contiguous blocks of the input dimension that get their own scale
            (1 = row-wise Eq. 11, 2 = the paper's default).
        m: the N:M group size the weight will be pruned with; ``in_features / n_groups`` must be a multiple
            of it so that the scale is constant inside every N:M group.

    The scale ``A`` (``self.scale``, shape ``(out_features, n_groups)``) is initialised to 1, so a freshly
    wrapped layer computes exactly what the base layer computes. The forward is dense (no mask).
    """

    def __init__(self, base_layer: nn.Module, n_groups: int = 2, m: int = 4):
        super().__init__()
        in_f, out_f, transposed = linear_features(base_layer)
        if isinstance(base_layer, ScaledLinear):
            raise TypeError("the layer is already a ScaledLinear; wrap its base_layer or keep it as it is")
        if not isinstance(n_groups, int) or n_groups < 1:
            raise ValueError(f"n_groups must be a positive integer, got {n_groups!r}")
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"m must be a positive integer, got {m!r}")
        if in_f % n_groups != 0 or (in_f // n_groups) % m != 0:
            shape = tuple(base_layer.weight.shape)
            raise ValueError(
                f"cannot scale {type(base_layer).__name__} with weight {shape} (in_features={in_f}) in "
                f"n_groups={n_groups} blocks for {m}-wide N:M groups: in_features / n_groups must be a "
                f"multiple of {m} so that the scale is constant inside every N:M group. "
                f"Use n_groups=1 or leave this layer unscaled."
            )
        self.base_layer = base_layer
        self.n_groups = n_groups
        self.m = m
        self.in_features = in_f
        self.out_features = out_f
        self.transposed = transposed
        weight = base_layer.weight
        scale_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.scale = nn.Parameter(torch.ones(out_f, n_groups, dtype=scale_dtype, device=weight.device))
        # True: the forward keeps x, W and A for backward and forms W_scale again there (one layer's product
        # at a time, nn/recomputed_linear.py) instead of the matmul keeping W_scale; --fsdp's policy sets it
        self.recompute_weight = False

    @classmethod
    def from_linear(cls, linear: nn.Module, n_groups: int = 2, m: int = 4) -> ScaledLinear:
        """Wrap ``linear`` (``nn.Linear`` or ``Conv1D``) with a unit scale; the result computes the same."""
        return cls(linear, n_groups=n_groups, m=m)

    @property
    def weight(self) -> nn.Parameter:
        """The unscaled weight Parameter of the base layer (its own layout: ``(in, out)`` for Conv1D)."""
        return self.base_layer.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.base_layer.bias

    def _scale_weight(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``Diag(A) W`` block-wise in ``weight``'s layout, computed in the promoted dtype (Eq. 12)."""
        g = self.n_groups
        if self.transposed:
            # weight (in, out) -> (g, in/g, out); scale (out, g) -> (g, 1, out)
            blocks = weight.unflatten(0, (g, self.in_features // g))
            return (blocks * scale.t().unsqueeze(1)).flatten(0, 1)
        # weight (out, in) -> (out, g, in/g); scale (out, g) -> (out, g, 1)
        blocks = weight.unflatten(1, (g, self.in_features // g))
        return (blocks * scale.unsqueeze(-1)).flatten(1, 2)

    def scaled_weight(self) -> torch.Tensor:
        """The effective weight ``W_scale`` (differentiable w.r.t. W and A), in the weight's dtype and layout."""
        weight = self.base_layer.weight
        # one rounding to the weight's dtype (bf16 weight * fp32 scale is formed in fp32)
        return self._scale_weight(weight, self.scale).to(weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = self.__dict__.get("_grouped")  # W_scale formed with the block's other layers (scaled_group)
        if grouped is not None:
            return linear_forward(x, grouped, self.base_layer.bias, self.transposed)
        weight = self.base_layer.weight
        if self.recompute_weight and _is_plain(weight) and _is_plain(self.scale):
            return recomputed_scaled_linear(x, weight, self.scale, self.base_layer.bias, self.n_groups,
                                            self.transposed, matmul_dtype(weight))
        if _is_plain(weight) and _is_plain(self.scale):
            weight = _scaled_weight(weight, self.scale, self.n_groups, self.transposed, matmul_dtype(weight))
        else:  # tensor subclasses (DTensor shards, ...): the plain autograd version of the same product
            weight = self.scaled_weight()
        return linear_forward(x, weight, self.base_layer.bias, self.transposed)

    @torch.no_grad()
    def to_linear(self, mask: torch.Tensor | None = None) -> nn.Module:
        """Fold the scale (and ``mask``) into the weight: ``W <- Diag(A) (W ⊙ M)``; return the base layer.

        Returns the original ``nn.Linear`` / ``Conv1D`` object (same type, same Parameter objects, so
        state_dict keys and layout are the model's own again). ``mask`` is a boolean tensor in the weight's
        *own* layout (``(out, in)`` for Linear, ``(in, out)`` for Conv1D); entries where it is False become
        exactly 0. Without a mask the returned layer computes exactly what this wrapper computed (the folded
        weight is formed by the same operations as the forward's).

        The fold happens in place; afterwards this wrapper's scale is reset to 1 so that it stays
        equivalent to its (now folded) base layer instead of applying the scale twice.
        """
        weight = self.base_layer.weight
        folded = self._scale_weight(weight, self.scale)
        if mask is not None:
            if tuple(mask.shape) != tuple(weight.shape):
                layout = "(in, out) like Conv1D's weight" if self.transposed else "(out, in)"
                raise ValueError(
                    f"mask shape {tuple(mask.shape)} does not match the weight shape {tuple(weight.shape)}; "
                    f"the mask must be in the weight's own layout {layout}"
                )
            folded = torch.where(mask.to(device=folded.device, dtype=torch.bool), folded, 0)
        weight.copy_(folded)
        self.scale.fill_(1)
        return self.base_layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, n_groups={self.n_groups}, "
            f"m={self.m}, transposed={self.transposed}"
        )


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def wrap_scaling_(
    model: nn.Module,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    n_groups: int = 2,
    m: int = 4,
    skip_incompatible: bool = False,
    group_blocks: bool = True,
) -> list[str]:
    """Replace the N:M target layers of ``model`` in place by :class:`ScaledLinear`; return their fqns.

    Targets are chosen by :func:`cast_llm.targets.find_targets` (default: every Linear / Conv1D inside the
    decoder blocks; ``filter_fn(module, fqn)`` chooses instead, torchao-style). ``group_blocks``: the wrapped
    layers of each decoder block form their scaled weights together, one op each way on CUDA
    (:mod:`cast_llm.nn.scaled_group`; the numbers are the per-layer path's). Layers that are already
    wrapped are left as they are and not returned. A layer whose width cannot be scaled in ``n_groups``
    blocks of whole ``m``-groups raises :class:`CastError` naming it, unless ``skip_incompatible`` is set:
    then it stays unwrapped (and, if its width is not a multiple of ``m`` at all, dense) and is logged.
    """
    # build every wrapper first, so that an incompatible layer leaves the model untouched
    planned = []
    for target in select_targets(model, m=m, filter_fn=filter_fn, skip_incompatible=skip_incompatible):
        if isinstance(target.module, ScaledLinear):
            continue
        try:
            planned.append((target.fqn, ScaledLinear.from_linear(target.module, n_groups=n_groups, m=m)))
        except ValueError as err:
            if skip_incompatible:
                logger.warning("not scaling %s: %s", target.fqn, err)
                continue
            raise CastError(
                f"layer {target.fqn!r}: {err} (or pass skip_incompatible=True / --skip-incompatible)"
            ) from err
    for fqn, scaled in planned:
        set_submodule(model, fqn, scaled)
    wrapped = [fqn for fqn, _ in planned]
    if group_blocks:  # on CUDA: each decoder block's layers scaled in one op each way (nn/scaled_group.py)
        group_by_block_(model, [fqn for fqn, mod in model.named_modules() if isinstance(mod, ScaledLinear)])
    return wrapped


def fold_scaling_(
    model: nn.Module, masks: Mapping[str | torch.Tensor, torch.Tensor] | None = None
) -> nn.Module:
    """Fold every :class:`ScaledLinear` of ``model`` back into its base layer in place (and prune).

    Each wrapper is replaced by its base ``nn.Linear`` / ``Conv1D`` with ``W <- Diag(A) (W ⊙ M)``, so the
    model's state_dict keys are the original ones again. ``masks`` maps either a name or a weight Parameter
    to a boolean mask in that weight's own layout. Names may be the module fqn (``...q_proj``) or a
    parameter name with or without the wrapper's infix (``...q_proj.weight``,
    ``...q_proj.base_layer.weight``). A mask for a parameter of the model that is not wrapped (e.g. a
    sparse layer that was too narrow to scale) is applied to it in place (``W <- W ⊙ M``); a key that
    matches nothing in the model raises :class:`CastError`.

    Returns ``model``.
    """
    wrappers = {fqn: mod for fqn, mod in model.named_modules() if isinstance(mod, ScaledLinear)}
    # every way a mask may name a weight -> (wrapper fqn or None, parameter name, parameter)
    index: dict[object, tuple[str | None, str, torch.Tensor]] = {}
    for fqn, mod in wrappers.items():
        entry = (fqn, f"{fqn}.base_layer.weight", mod.weight)
        for key in (fqn, f"{fqn}.weight", f"{fqn}.base_layer.weight", id(mod.weight)):
            index[key] = entry
    for name, param in model.named_parameters():
        if id(param) not in index:
            index[name] = index[id(param)] = (None, name, param)

    # resolve and check every mask before touching the model, so a bad key leaves it unchanged
    resolved: dict[str, tuple[str | None, torch.Tensor, torch.Tensor]] = {}
    for key, mask in (masks or {}).items():
        if not isinstance(key, (str, torch.Tensor)):
            raise TypeError(f"mask keys must be names or Parameters, got {type(key).__name__}")
        entry = index.get(key if isinstance(key, str) else id(key))
        label = key if isinstance(key, str) else f"Parameter of shape {tuple(key.shape)}"
        if entry is None:
            raise CastError(f"mask given for {label!r}, which is not a weight of this model")
        fqn, name, param = entry
        if name in resolved:
            raise CastError(f"several masks given for the same weight {name!r}")
        if tuple(mask.shape) != tuple(param.shape):
            raise CastError(
                f"mask for {name!r} has shape {tuple(mask.shape)} but the weight has {tuple(param.shape)} "
                f"(masks are in the weight's own layout; GPT-2 Conv1D weights are (in, out))"
            )
        resolved[name] = (fqn, param, mask)

    masks_of_wrappers = {fqn: mask for fqn, _, mask in resolved.values() if fqn is not None}
    ungroup_(model)
    for fqn, mod in wrappers.items():
        set_submodule(model, fqn, mod.to_linear(masks_of_wrappers.get(fqn)))
    with torch.no_grad():
        for fqn, param, mask in resolved.values():
            if fqn is None:  # a sparse weight that was never wrapped: prune it in place
                param.masked_fill_(~mask.to(device=param.device, dtype=torch.bool), 0)
    return model
