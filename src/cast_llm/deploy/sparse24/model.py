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

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from cast_llm.deploy.sparse24.cpu import scratch_bytes
from cast_llm.deploy.sparse24.dispatch import DENSE, Dispatcher, wins_needed
from cast_llm.deploy.sparse24.linear import Sparse24Linear
from cast_llm.errors import CastError
from cast_llm.layers import set_submodule
from cast_llm.targets import find_targets

__all__ = ["check_plan_against_dense_", "from_sparse24_", "plan_sparse24_", "sparse24_layers", "sparse24_memory",
           "to_sparse24_"]


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
                   save: bool = True, forward: Callable[[int], object] | None = None,
                   flush: Callable[[], object] | None = None, pairs: int = 5,
                   checks: list[dict] | None = None) -> dict[str, dict[str, str]]:
    """Decide (measuring where needed) every layer's kernel for the token counts a deployment will see.

    ``token_counts``: counts planned in every mode of ``modes``, or ``{mode: counts}`` (e.g. eager prefill
    and decode counts, graph decode counts). Returns ``{fqn: {"<mode>:<tokens>": kernel}}``.

    ``forward(n)``: the model run on ``n`` tokens (e.g. a prompt of ``n`` random ids). Given, every eager count
    above one whose plan puts layers that hold their dense weight on another kernel is **checked on the whole
    model** (:func:`check_plan_against_dense_`): the plan is kept for that count only if the model runs faster
    with it than with those layers on dense ``F.linear``; otherwise they run dense there. A per-layer timing cannot
    see everything a model's forward meets (on a VM, layers given to ``cpu-amx-bf16`` at 128 tokens by their own
    timing left TinyLlama's prefill at 0.88× dense, cpu24-notes.md §56). Each check's result is appended to
    ``checks`` where given.

    ``release=True`` then drops, per layer, the forms no planned decision uses — the dense fallback where
    every planned count runs 2:4, the compressed weight where every planned count runs dense — and turns a
    layer that is left with the dense weight only back into an ``nn.Linear`` (no wrapper cost at all).
    Counts planned later can only use what is left. The dispatch cache file (if any) is written at the end.
    """
    cases = token_counts if isinstance(token_counts, dict) else {mode: token_counts for mode in modes}
    cases = {mode: sorted({int(t) for t in counts}) for mode, counts in cases.items()}
    plan: dict[str, dict[str, str]] = {}
    dispatchers = {}
    layers = sparse24_layers(model)
    for fqn, layer in layers:
        plan[fqn] = {f"{mode}:{t}": layer.kernel_for(t, mode) for mode, counts in cases.items() for t in counts}
        if layer.dispatcher is not None:
            dispatchers[id(layer.dispatcher)] = layer.dispatcher
    if forward is not None:
        for t in (t for t in cases.get("eager", []) if t > 1):
            result = check_plan_against_dense_(model, forward, t, flush=flush, pairs=pairs)
            if checks is not None:
                checks.append(result)
            if result["reverted"]:
                for fqn, layer in layers:
                    plan[fqn][f"eager:{t}"] = layer.kernel_for(t, "eager")
    if release:
        for fqn, layer in layers:
            layer.release_(set(plan[fqn].values()))
            if not layer.kernels:
                set_submodule(model, fqn, layer.to_linear())
    if save:
        for d in dispatchers.values():
            d.save()
    return plan


def check_plan_against_dense_(model: nn.Module, forward: Callable[[int], object], tokens: int, *,
                              flush: Callable[[], object] | None = None, pairs: int = 5) -> dict:
    """Time ``forward(tokens)`` with the layers' eager choices for ``tokens`` against the same with every CPU layer
    that holds its dense weight and chose another kernel put on dense ``F.linear``, in ``pairs`` pairs (the order
    alternating, ``flush()`` before each run); keep the plan only where it is faster than that in all pairs but
    one in five (:func:`~cast_llm.deploy.sparse24.dispatch.wins_needed`), else put those layers on dense for
    ``tokens`` (the token bucket's choice, in this process). Returns ``{"tokens", "layers", "ratios"
    (dense-forward seconds / planned-forward seconds, one a pair), "reverted"}``; ``layers`` 0 and no timing where
    no such layer exists."""
    moved = [layer for _, layer in sparse24_layers(model)  # (CPU layers: the timer does not wait for a GPU)
             if layer.device.type == "cpu" and layer.dense_weight is not None
             and layer.kernel_for(tokens, "eager") != DENSE]
    out = {"tokens": tokens, "layers": len(moved), "ratios": [], "reverted": False}
    if not moved:
        return out
    planned = {id(layer): layer.kernel_for(tokens, "eager") for layer in moved}

    def use(dense: bool) -> None:
        for layer in moved:
            layer.set_choice_(tokens, "eager", DENSE if dense else planned[id(layer)])

    def timed(dense: bool) -> float:
        use(dense)
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        forward(tokens)
        return time.perf_counter() - t0

    with torch.inference_mode():
        timed(False), timed(True)  # first calls: code paths, pages
        for p in range(pairs):
            first_dense = p % 2 == 1
            a = timed(first_dense)
            b = timed(not first_dense)
            dense_s, plan_s = (a, b) if first_dense else (b, a)
            out["ratios"].append(dense_s / plan_s)
    won = sum(r > 1 for r in out["ratios"])
    out["reverted"] = won < wins_needed(len(out["ratios"]))
    use(out["reverted"])
    return out


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
