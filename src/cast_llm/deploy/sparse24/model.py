"""Whole-model operations on :class:`~cast_llm.deploy.sparse24.linear.Sparse24Linear` layers (torchao-style:
in-place functions end in ``_`` and take ``filter_fn(module, fqn)``).

* :func:`to_sparse24_` — swap the 2:4 targets for ``Sparse24Linear`` (validating every one first, so a bad
  layer leaves the model untouched); :func:`from_sparse24_` — back to ``nn.Linear``;
* :func:`plan_sparse24_` — measure the kernel choices for the token counts a deployment will see (prefill
  ``batch × prompt``, decode ``batch``), in eager and/or graph mode, before serving (and before any CUDA graph
  capture, which cannot measure); ``release=True`` then frees the form each layer will not use;
* :func:`sparse24_memory` — weight bytes held, compressed and dense fallback copies counted separately.

The targets are :func:`cast_llm.targets.find_targets`'s (the linears inside the decoder blocks; embeddings and
``lm_head`` — tied to the embeddings in SmolLM2 — stay dense); ``filter_fn`` narrows them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from torch import nn

from cast_llm.deploy.sparse24.cpu import scratch_bytes
from cast_llm.deploy.sparse24.dispatch import Dispatcher
from cast_llm.deploy.sparse24.linear import Sparse24Linear
from cast_llm.errors import CastError
from cast_llm.layers import set_submodule
from cast_llm.targets import find_targets

__all__ = ["from_sparse24_", "plan_sparse24_", "sparse24_layers", "sparse24_memory", "to_sparse24_"]


def sparse24_layers(model: nn.Module) -> list[tuple[str, Sparse24Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Sparse24Linear)]


def to_sparse24_(model: nn.Module, *, filter_fn: Callable[[nn.Module, str], bool] | None = None, targets=None,
                 kernels: Sequence[str] | None = None, dispatch: Dispatcher | bool = True,
                 keep_dense: bool | None = None, skip_incompatible: bool = False) -> list[str]:
    """Swap the 2:4 targets of ``model`` for :class:`Sparse24Linear`, in place; returns their fqns.

    ``dispatch``: True (a :class:`Dispatcher` on the model's device, shared by all layers), a Dispatcher, or
    False (always the first usable kernel, no dense fallback). Layers that cannot be swapped raise one
    CastError naming them (all checked before anything changes), or with ``skip_incompatible`` stay
    ``nn.Linear`` (listed in ``model._sparse24_skipped`` with the reason).
    """
    if targets is None:
        targets = find_targets(model, n=2, m=4, skip_incompatible=True)
    if filter_fn is not None:
        targets = [t for t in targets if filter_fn(t.module, t.fqn)]
    if dispatch is True:
        params = [p for p in model.parameters() if p.is_floating_point()]
        dispatch = Dispatcher(device=params[0].device if params else None)
    dispatcher = dispatch or None
    built, problems = {}, []
    for t in targets:
        try:
            built[t.fqn] = Sparse24Linear.from_linear(t.module, kernels=kernels, dispatcher=dispatcher,
                                                      keep_dense=keep_dense, name=t.fqn)
        except CastError as e:
            problems.append(str(e))
    if problems and not skip_incompatible:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CastError("cannot swap to 2:4 kernels: " + "; ".join(problems[:3]) + more)
    for fqn, layer in built.items():
        set_submodule(model, fqn, layer)
    model._sparse24_skipped = problems
    return list(built)


def from_sparse24_(model: nn.Module) -> list[str]:
    """Replace every Sparse24Linear of ``model`` by the equivalent ``nn.Linear``, in place; their fqns."""
    found = sparse24_layers(model)
    for fqn, layer in found:
        set_submodule(model, fqn, layer.to_linear())
    return [fqn for fqn, _ in found]


def plan_sparse24_(model: nn.Module, token_counts: Iterable[int] | dict[str, Iterable[int]], *,
                   modes: Sequence[str] = ("eager",), release: bool = False,
                   save: bool = True) -> dict[str, dict[str, str]]:
    """Decide (measuring where needed) every layer's kernel for the token counts a deployment will see.

    ``token_counts``: counts planned in every mode of ``modes``, or ``{mode: counts}`` (e.g. eager prefill
    and decode counts, graph decode counts). Returns ``{fqn: {"<mode>:<tokens>": kernel}}``.

    ``release=True`` then drops, per layer, the forms no planned decision uses — the dense fallback where
    every planned count runs 2:4, the compressed weight where every planned count runs dense — and turns a
    layer that is left with the dense weight only back into an ``nn.Linear`` (no wrapper cost at all).
    Counts planned later can only use what is left. The dispatch cache file (if any) is written at the end.
    """
    cases = token_counts if isinstance(token_counts, dict) else {mode: token_counts for mode in modes}
    cases = {mode: sorted({int(t) for t in counts}) for mode, counts in cases.items()}
    plan: dict[str, dict[str, str]] = {}
    dispatchers = {}
    for fqn, layer in sparse24_layers(model):
        chosen = {f"{mode}:{t}": layer.kernel_for(t, mode) for mode, counts in cases.items() for t in counts}
        plan[fqn] = chosen
        if layer.dispatcher is not None:
            dispatchers[id(layer.dispatcher)] = layer.dispatcher
        if release:
            layer.release_(set(chosen.values()))
            if not layer.kernels:
                set_submodule(model, fqn, layer.to_linear())
    if save:
        for d in dispatchers.values():
            d.save()
    return plan


def sparse24_memory(model: nn.Module) -> dict[str, int]:
    """Weight bytes of ``model`` as held now: ``compressed`` 2:4 weights, ``dense_fallback`` copies kept for
    the dispatch, ``other`` (every other parameter and bias, tied ones once), ``scratch`` (the CPU layers'
    shared rebuild buffers) and ``total``."""
    compressed = dense = other = 0
    seen = set()
    for _, layer in sparse24_layers(model):
        b = layer.nbytes()
        compressed += b["compressed"]
        dense += b["dense"]
        other += b["bias"]
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        other += p.numel() * p.element_size()
    # the CPU layers' shared buffers for rebuilt dense weights (one per shape, process-wide: counted once)
    scratch = scratch_bytes() if any(layer.device.type == "cpu" for _, layer in sparse24_layers(model)) else 0
    return {"compressed": compressed, "dense_fallback": dense, "other": other, "scratch": scratch,
            "total": compressed + dense + other + scratch}
