"""Calibration block by block through the decoder, for the one-shot baselines (method.md §6).

Wanda and SparseGPT need statistics of each target layer's *inputs*. Collecting them for all layers in one
dense forward would measure inputs the pruned model never sees; instead the model is walked one decoder
block at a time:

1. capture the inputs of block 0 (hidden states and every other argument the block receives — attention
   mask, position ids, rotary position embeddings, ...) with a forward pre-hook that stops the forward;
2. for each block: hooks on its targets accumulate input statistics while the calibration samples run
   through the block; the targets are pruned; the block is run again, and its (pruned) outputs become the
   inputs of the next block.

So the inputs of block i+1 come from the already-pruned blocks 0..i, and peak memory is one block plus the
calibration activations. On a CUDA device with the model on the CPU, only the modules outside the blocks
(embeddings, rotary tables) and one block at a time are moved to the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cast_llm.errors import CastError
from cast_llm.targets import find_block_list

# (running statistic or None, inputs (tokens, C) float32) -> updated statistic
Accumulate = Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]


@dataclass
class LayerInputs:
    """Running statistic of one target's inputs over the calibration tokens seen so far."""

    stat: torch.Tensor | None = None
    tokens: int = 0


@dataclass
class BlockInput:
    """What one calibration micro-batch passes to a decoder block: ``block(hidden, *args, **kwargs)``."""

    hidden: torch.Tensor  # (B, L, hidden)
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class _StopForward(Exception):
    """Raised by the capture hook once block 0's inputs are recorded: nothing after them is needed."""


def decoder_blocks(model: nn.Module, target_fqns: list[str]) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of decoder blocks (``model.layers``, ``transformer.h``, ...) holding the targets.

    Uses :func:`cast_llm.targets.find_block_list`; every target must lie inside one of its blocks, since
    block-by-block calibration reaches nothing else.
    """
    found = find_block_list(model)
    if found is None:
        raise CastError(f"no decoder block list found in {type(model).__name__}: block-by-block calibration "
                        "needs an nn.ModuleList of transformer layers (like model.layers or transformer.h)")
    outside = [f for f in target_fqns if not f.startswith(found[0] + ".")]
    if outside:
        raise CastError(
            f"target layer(s) outside the decoder blocks '{found[0]}': {', '.join(outside[:3])}; "
            "block-by-block calibration cannot reach them"
        )
    return found


def targets_by_block(prefix: str, targets) -> dict[int, list]:
    """``targets`` grouped by the index of the decoder block that holds them (``prefix``: the block list's
    fqn, from :func:`decoder_blocks`)."""
    by_block: dict[int, list] = {}
    for t in targets:
        by_block.setdefault(int(t.fqn[len(prefix) + 1:].split(".", 1)[0]), []).append(t)
    return by_block


@contextlib.contextmanager
def block_walk(model: nn.Module, blocks: nn.ModuleList, *, desc: str, progress: bool) -> Iterator[Callable[[], None]]:
    """Around a walk over the decoder blocks: the model in eval mode (its train mode is restored at the end)
    and, with ``progress``, a bar of one tick per block; yields the function that ticks it."""
    was_training = model.training
    model.eval()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(blocks), desc=desc, unit="block")
    try:
        yield (lambda: bar.update(1)) if bar is not None else (lambda: None)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)


def _module_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _move_outside_blocks(model: nn.Module, blocks: nn.ModuleList, device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` that is not inside ``blocks`` to ``device``."""

    def contains_blocks(module: nn.Module) -> bool:
        return any(m is blocks for m in module.modules())

    def visit(module: nn.Module) -> None:
        module._apply(lambda t: t.to(device), recurse=False)  # its own tensors only
        for child in module.children():
            if child is blocks:
                continue
            if contains_blocks(child):
                visit(child)
            else:
                child.to(device)

    visit(model)


def _to(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, calib_ids: torch.Tensor, *, batch_size: int, device: torch.device
) -> list[BlockInput]:
    """Run the model up to block 0 for every micro-batch of ``calib_ids`` (N, L) and record block 0's inputs."""
    captured: list[BlockInput] = []

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        if args:
            hidden, args = args[0], tuple(args[1:])
        elif "hidden_states" in kwargs:  # a model that passes the hidden states by name
            hidden = kwargs.pop("hidden_states")
        else:
            raise CastError(f"cannot find the hidden states among the inputs of {type(module).__name__}")
        captured.append(BlockInput(hidden=hidden, args=args, kwargs=kwargs))
        raise _StopForward

    handle = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i in range(0, calib_ids.shape[0], batch_size):
            ids = calib_ids[i : i + batch_size].to(device)  # (B, L)
            try:
                model(input_ids=ids, use_cache=False)
            except _StopForward:
                continue
            raise CastError("the model's forward never reached its first decoder block")
    finally:
        handle.remove()
    return captured


def _block_output(out: Any) -> torch.Tensor:
    # transformers ≥ 5 blocks return the hidden states; older ones a tuple whose first item they are
    return out[0] if isinstance(out, (tuple, list)) else out


def run_block(block: nn.Module, inp: BlockInput) -> torch.Tensor:
    return _block_output(block(inp.hidden, *inp.args, **inp.kwargs))


def _stat_hook(acc: LayerInputs, accumulate: Accumulate):
    def hook(module, args, output):
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1]).float()  # (..., C) -> (tokens, C)
        acc.stat = accumulate(acc.stat, x)
        acc.tokens += x.shape[0]

    return hook


def _prune_block(block, block_targets, inputs, accumulate, prune_layer, *, need_outputs: bool):
    """Calibrate and prune one block's targets; return the pruned block's outputs as the next inputs."""
    stats = [LayerInputs() for _ in block_targets]
    handles = [t.module.register_forward_hook(_stat_hook(s, accumulate)) for t, s in zip(block_targets, stats)]
    try:
        if block_targets:
            for inp in inputs:
                run_block(block, inp)
    finally:
        for h in handles:
            h.remove()
    for t, s in zip(block_targets, stats):
        prune_layer(t, s)
        s.stat = None  # free the statistic (a C×C Hessian) as soon as its layer is pruned
    if not need_outputs:
        return []
    return [BlockInput(run_block(block, inp), inp.args, inp.kwargs) for inp in inputs]


@torch.no_grad()
def prune_blockwise(
    model: nn.Module,
    targets: list,
    calib_ids: torch.Tensor,
    *,
    accumulate: Accumulate,
    prune_layer: Callable[[Any, LayerInputs], None],
    batch_size: int = 1,
    device: str | torch.device | None = None,
    progress: bool = False,
    desc: str = "prune",
) -> None:
    """Walk the decoder blocks in order: calibrate each block's targets, ``prune_layer`` them, move on.

    ``targets`` are :class:`cast_llm.targets.Target` objects; ``accumulate`` builds the per-target input
    statistic (e.g. :func:`~cast_llm.prune.wanda.accumulate_col_sq_norm`); ``prune_layer(target, inputs)``
    prunes one target in place. ``device`` is where the blocks run (default: where the model is).
    If ``prune_layer`` raises, the blocks before it stay pruned: the caller must not save the model.
    """
    if calib_ids.ndim != 2 or calib_ids.shape[0] == 0:
        raise CastError(f"calibration ids must be a non-empty (samples, seq_len) tensor, got {tuple(calib_ids.shape)}")
    prefix, blocks = decoder_blocks(model, [t.fqn for t in targets])
    device = torch.device(device) if device is not None else _module_device(model)
    home = _module_device(model)  # where the model lives; everything goes back there at the end
    by_block = targets_by_block(prefix, targets)
    with block_walk(model, blocks, desc=desc, progress=progress) as tick:
        _move_outside_blocks(model, blocks, device)
        try:
            inputs = capture_block_inputs(model, blocks, calib_ids, batch_size=batch_size, device=device)
        finally:
            _move_outside_blocks(model, blocks, home)
        for index, block in enumerate(blocks):
            block_home = _module_device(block)
            block.to(device)
            try:
                inputs = _prune_block(block, by_block.get(index, []), inputs, accumulate, prune_layer,
                                      need_outputs=index + 1 < len(blocks))
            finally:
                block.to(block_home)
            tick()
