"""Which weights become N:M sparse, and the AdamS parameter groups built from them (method.md §1).

The N:M targets of a decoder LLM are the linear weights inside its transformer blocks: attention
q/k/v/o and MLP up/gate/down (LLaMA), ``c_attn`` / ``c_proj`` / ``c_fc`` (GPT-2, stored transposed as
``Conv1D``), ``q/k/v/out_proj`` and ``fc1`` / ``fc2`` (OPT). Embeddings, ``lm_head``, norms and biases
stay dense, as does anything outside the blocks.

The blocks are found structurally, not by name: the ``nn.ModuleList`` holding the most parameters among
those whose items are modules containing linear layers (``model.layers``, ``transformer.h``,
``decoder.layers``, ...). This works for causal LMs and bare base models of any architecture that keeps
its layers in a ModuleList, which is every decoder in transformers.

The N:M groups of a weight run along its *input* dimension: the last dim of ``nn.Linear.weight``
``(out, in)``, dim 0 of GPT-2's ``Conv1D.weight`` ``(in, out)`` (``Target.transposed``). A weight whose
input dimension is not a multiple of ``m`` cannot be made N:M.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from cast_llm.errors import CastError
from cast_llm.layers import is_linear_like, is_scaled_linear, linear_features

logger = logging.getLogger(__name__)

__all__ = [
    "Target",
    "TargetList",
    "find_targets",
    "find_block_list",
    "block_filter",
    "target_names",
    "param_groups",
]

FilterFn = Callable[[nn.Module, str], bool]


@dataclass(frozen=True, eq=False)
class Target:
    """One N:M target layer.

    ``module`` is the layer itself (``nn.Linear``, ``Conv1D`` or an already wrapped :class:`~cast_llm.nn.ScaledLinear`),
    ``weight`` its (unscaled) weight Parameter, ``transposed`` True when the weight is stored ``(in, out)``
    so that the N:M groups run along dim 0 (AdamS's ``"transposed": True`` groups).
    """

    fqn: str
    module: nn.Module
    weight: nn.Parameter
    transposed: bool
    in_features: int
    out_features: int

    @property
    def nm_dim(self) -> int:
        """The dim of ``weight`` along which the N:M groups run."""
        return 0 if self.transposed else 1

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)


class TargetList(list):
    """The targets found (a plain ``list[Target]``) plus ``skipped``: layers left dense because their
    input width is not a multiple of ``m`` (only non-empty with ``skip_incompatible=True``)."""

    def __init__(self, targets: Iterable[Target] = (), skipped: Iterable[Target] = ()):
        super().__init__(targets)
        self.skipped: list[Target] = list(skipped)

    @property
    def fqns(self) -> list[str]:
        return [t.fqn for t in self]


def _linear_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """(fqn, module) of every Linear / Conv1D / scaling wrapper, not descending into scaling wrappers
    (:func:`cast_llm.layers.is_scaled_linear`)."""
    inside_wrapper: list[str] = []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(prefix) for prefix in inside_wrapper):
            continue  # the wrapper's base_layer is reported through the wrapper
        if is_scaled_linear(module):
            inside_wrapper.append(fqn + ".")
            yield fqn, module
        elif is_linear_like(module):
            yield fqn, module


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The decoder block list of ``model`` as ``(fqn, ModuleList)``, or None if it has none.

    Chosen as the ModuleList with the most parameters among those whose items are not themselves linear
    layers but contain some (so per-expert or per-head lists of bare linears do not qualify, and a list
    nested inside a block always loses to the block list that contains it).
    """
    best, best_size = None, -1
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        items = list(module)
        if any(is_scaled_linear(item) or is_linear_like(item) for item in items):
            continue
        if not any(True for item in items for _ in _linear_modules(item)):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (fqn, module), size
    return best


def block_filter(model: nn.Module) -> FilterFn:
    """The default target rule as a ``filter_fn(module, fqn)``: True for linears inside the decoder blocks.

    Compose it to narrow the default, e.g. only the MLPs::

        inside = block_filter(model)
        find_targets(model, filter_fn=lambda mod, fqn: inside(mod, fqn) and ".mlp." in fqn)
    """
    found = find_block_list(model)
    if found is None:
        raise CastError(
            f"no decoder block list found in {type(model).__name__}: expected an nn.ModuleList of "
            f"transformer layers (like model.layers or transformer.h); pass filter_fn=... to choose the "
            f"layers to sparsify yourself"
        )
    prefix = found[0] + "." if found[0] else ""
    return lambda module, fqn: fqn.startswith(prefix)


def select_targets(
    model: nn.Module, m: int = 4, filter_fn: FilterFn | None = None, skip_incompatible: bool = False
) -> TargetList:
    """:func:`find_targets` without the ``n`` argument (target selection only depends on ``m``)."""
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be a positive integer, got {m!r}")
    chosen = filter_fn if filter_fn is not None else block_filter(model)
    found, skipped = [], []
    for fqn, module in _linear_modules(model):
        if not chosen(module, fqn):
            continue
        in_f, out_f, transposed = linear_features(module)
        target = Target(fqn, module, module.weight, transposed, in_f, out_f)
        if in_f % m == 0:
            found.append(target)
            continue
        if not skip_incompatible:
            raise CastError(
                f"layer {fqn!r} ({type(module).__name__}, weight {target.shape}) has {in_f} input "
                f"features, not a multiple of m={m}, so it cannot be made N:M sparse; pass "
                f"skip_incompatible=True (CLI: --skip-incompatible) to leave such layers dense"
            )
        logger.warning("leaving %s dense: %d input features is not a multiple of m=%d", fqn, in_f, m)
        skipped.append(target)
    if not found:
        why = "filter_fn selected no linear layer" if filter_fn is not None else "no linear layer in its blocks"
        if skipped:
            why = f"every candidate layer was skipped as incompatible: {[t.fqn for t in skipped]}"
        raise CastError(f"{type(model).__name__} has no layer that can be made N:M sparse ({why})")
    return TargetList(found, skipped)


def find_targets(
    model: nn.Module,
    n: int = 2,
    m: int = 4,
    filter_fn: FilterFn | None = None,
    skip_incompatible: bool = False,
) -> TargetList:
    """The N:M target layers of ``model`` (method.md §1), in module order.

    By default every ``nn.Linear`` / ``Conv1D`` (or already wrapped :class:`~cast_llm.nn.ScaledLinear`) inside the
    decoder blocks (:func:`find_block_list`). ``filter_fn(module, fqn)``, called on every linear-like
    module of the model, *replaces* that rule (torchao-style); use :func:`block_filter` to narrow the
    default instead.

    Raises :class:`CastError` when a selected layer's input width is not a multiple of ``m`` (naming the
    layer and its shape) — unless ``skip_incompatible``, in which case such layers stay dense and are
    listed in the result's ``.skipped`` — and when no layer at all is eligible.
    """
    if not isinstance(n, int) or not isinstance(m, int) or not 0 < n < m:
        raise ValueError(f"need integers 0 < n < m for an N:M pattern, got n={n!r}, m={m!r}")
    return select_targets(model, m=m, filter_fn=filter_fn, skip_incompatible=skip_incompatible)


def target_names(model: nn.Module, **kwargs: Any) -> list[str]:
    """The fqns of :func:`find_targets` (same keyword arguments)."""
    return find_targets(model, **kwargs).fqns


_RESERVED = {"name", "params", "sparse", "transposed"}


def param_groups(
    model: nn.Module,
    *,
    targets: Iterable[Target] | None = None,
    n: int = 2,
    m: int = 4,
    l1_decay: float | None = None,
    weight_decay: float = 0.0,
    no_decay_dense: bool = True,
    skip_incompatible: bool = False,
    **group_overrides: Any,
) -> list[dict[str, Any]]:
    """AdamS parameter groups for ``model`` (method.md §2): sparse targets, and every other trainable param.

    Groups (empty ones omitted), each with a ``"name"`` for logging:

    * ``"sparse"``: N:M targets stored ``(out, in)`` — ``{"sparse": True, "transposed": False}``;
    * ``"sparse_transposed"``: targets stored ``(in, out)`` (GPT-2 ``Conv1D``), whose N:M groups run along
      dim 0 — ``{"sparse": True, "transposed": True}``;
    * ``"dense"``: other trainable parameters with ``weight_decay`` (embeddings, an untied ``lm_head``);
    * ``"dense_no_decay"``: biases, norms (any parameter with fewer than 2 dims) and the ScaledLinear
      scales, with ``weight_decay=0`` — decaying a scale would pull it from 1 towards 0. With
      ``no_decay_dense=False`` they join ``"dense"``.

    ``targets`` defaults to ``find_targets(model, n, m, skip_incompatible=skip_incompatible)``.
    ``l1_decay`` (λ), if given, is set on the sparse groups; ``weight_decay`` on the sparse and ``dense``
    groups (the paper uses none: 0.0). ``group_overrides`` (e.g. ``lr=...``) go into every group.
    Frozen parameters are left out. Tied weights (GPT-2/SmolLM2 ``lm_head`` = embedding) appear once.
    """
    bad = _RESERVED & set(group_overrides)
    if bad:
        raise ValueError(f"param_groups sets {sorted(bad)} itself; they cannot be overridden")
    if targets is None:
        targets = find_targets(model, n=n, m=m, skip_incompatible=skip_incompatible)
    targets = list(targets)

    trainable = {id(p): (name, p) for name, p in model.named_parameters() if p.requires_grad}
    sparse: list[nn.Parameter] = []
    sparse_t: list[nn.Parameter] = []
    target_ids: set[int] = set()
    for target in targets:
        if id(target.weight) in target_ids:
            raise ValueError(f"target weight {target.fqn!r} is listed twice")
        target_ids.add(id(target.weight))
        if id(target.weight) not in trainable:
            if target.weight.requires_grad:
                raise ValueError(f"target {target.fqn!r} is not a parameter of this model")
            logger.info("target %s is frozen; it is left out of the optimizer", target.fqn)
            continue
        (sparse_t if target.transposed else sparse).append(target.weight)

    scale_ids = {id(mod.scale) for mod in model.modules() if is_scaled_linear(mod)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for pid, (_, p) in trainable.items():
        if pid in target_ids:
            continue
        if no_decay_dense and (p.ndim < 2 or pid in scale_ids):
            no_decay.append(p)
        else:
            decay.append(p)

    sparse_extra: dict[str, Any] = {"weight_decay": weight_decay}
    if l1_decay is not None:
        if l1_decay < 0:
            raise ValueError(f"l1_decay must be >= 0, got {l1_decay}")
        sparse_extra["l1_decay"] = l1_decay
    groups = [
        {"name": "sparse", "params": sparse, "sparse": True, "transposed": False, **sparse_extra},
        {"name": "sparse_transposed", "params": sparse_t, "sparse": True, "transposed": True, **sparse_extra},
        {"name": "dense", "params": decay, "sparse": False, "weight_decay": weight_decay},
        {"name": "dense_no_decay", "params": no_decay, "sparse": False, "weight_decay": 0.0},
    ]
    groups = [{**g, **group_overrides} for g in groups if g["params"]]

    # every trainable parameter exactly once: a silent omission would freeze it, a duplicate crashes torch
    seen = [id(p) for g in groups for p in g["params"]]
    if len(seen) != len(set(seen)) or set(seen) != set(trainable):
        missing = [trainable[i][0] for i in set(trainable) - set(seen)]
        raise RuntimeError(f"param_groups bug: parameters missing {missing} or listed twice")
    return groups

