"""LoRA fine-tuning that keeps an N:M model exactly N:M (method.md §7): merge as ``W + M ⊙ (B A)·s``.

peft's own merge adds the dense low-rank update ``ΔW = B A · s`` (``s = alpha / r``) to ``W`` and so fills
every pruned zero: the merged model is dense. Here every peft LoRA layer whose base weight is an N:M
target gets

* ``M``, the support of its frozen base weight (``W ≠ 0``), kept as the non-persistent buffer
  ``cast_nm_mask`` in the base weight's own layout (so GPT-2 ``Conv1D``, stored ``(in, out)``, needs no
  special case: ``get_delta_weight`` already returns ``ΔW`` in that layout when ``fan_in_fan_out``);
* a peft LoRA *variant* whose ``merge`` / ``unmerge`` add / subtract ``M ⊙ ΔW``, so peft's ``merge()``,
  ``unmerge()`` and ``merge_and_unload()`` keep the pattern, and merging stays reversible.

The support rather than a fresh ``nm_mask(W)``: it is exactly the set of weights the input model has, so
"same mask before and after" holds by construction, and a model sparser than N:M stays that sparse.

With ``masked_forward`` (the default) the variant also *trains* through the masked update,
``y = W x + (M ⊙ ΔW) dropout(x)``, so the merged model computes exactly what was trained. The price: the
``out × in`` update is formed in every forward and its gradient costs a dense weight-gradient matmul, about
the compute of full fine-tuning (the optimizer state stays LoRA-sized). Without it (plain LoRA, cheaper),
the merge drops the part of ``B A`` that falls on pruned positions and the merged model differs from the
trained one; ``cast-llm finetune`` reports both so the difference is visible.

After ``PeftModel.from_pretrained(sparse_base, adapter_dir)`` call :func:`attach_nm_masks_` (or use
:func:`sparse_merge_`), otherwise peft's plain merge densifies the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cast_llm.errors import CastError
from cast_llm.finetune.modes import FinetuneMode
from cast_llm.io import atomic_dir
from cast_llm.sparsity.mask import is_nm
from cast_llm.targets import find_targets

MASK_NAME = "cast_nm_mask"


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(fqn, layer) of every peft LoRA layer over a 2-D weight (Linear / Conv1D)."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and getattr(module.get_base_layer(), "weight", None) is not None \
                and module.get_base_layer().weight.dim() == 2 and hasattr(module, "lora_A"):
            yield name, module


def masked_delta(layer: nn.Module, adapter: str) -> torch.Tensor:
    """``M ⊙ ΔW`` in the base weight's layout (just ``ΔW`` for a layer without a mask: a dense layer)."""
    delta = layer.get_delta_weight(adapter)
    mask = getattr(layer, MASK_NAME, None)
    return delta if mask is None else delta.masked_fill(~mask, 0)


def _variant_base():
    from peft.tuners.lora.layer import LoraVariant

    return LoraVariant


class _MaskedMergeMixin:
    """peft LoRA-variant hooks (static, as peft calls them) for the masked merge / unmerge."""

    def supports_lora_conversion(self) -> bool:  # M ⊙ (B A) is not low rank any more
        return False

    @staticmethod
    def init(module, adapter_name: str, **kwargs) -> None:
        pass

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        return orig_weight + masked_delta(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data += masked_delta(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        return orig_weight.data - masked_delta(module, active_adapter).to(orig_weight.dtype)


def _variants():
    """(masked-merge-only, masked-forward) variant classes, built on peft's LoraVariant on first use."""
    base = _variant_base()

    class MaskedMergeLora(_MaskedMergeMixin, base):
        """Plain LoRA forward ``W x + B A dropout(x) s``; masked merge."""

        @staticmethod
        def forward(module, active_adapter, x, result, **kwargs):
            lora_a, lora_b = module.lora_A[active_adapter], module.lora_B[active_adapter]
            return result + lora_b(lora_a(module.lora_dropout[active_adapter](x))) * module.scaling[active_adapter]

    class MaskedForwardLora(_MaskedMergeMixin, base):
        """Forward through the masked update ``W x + (M ⊙ ΔW) dropout(x)``; masked merge."""

        @staticmethod
        def forward(module, active_adapter, x, result, **kwargs):
            delta = masked_delta(module, active_adapter)  # base layout; Conv1D: (in, out)
            weight = delta.t() if module.fan_in_fan_out else delta  # (out, in) for F.linear
            return result + F.linear(module.lora_dropout[active_adapter](x), weight.to(x.dtype))

    return MaskedMergeLora, MaskedForwardLora


def _weight_is_nm(layer, n: int, m: int) -> bool:
    w = layer.get_base_layer().weight.detach()
    return is_nm(w.t() if layer.fan_in_fan_out else w, n, m)


@torch.no_grad()
def attach_nm_masks_(model: nn.Module, *, targets=None, n: int = 2, m: int = 4, masked_forward: bool = True) -> int:
    """Give every LoRA layer over an N:M weight its support mask and the masked-merge variant; returns the count.

    ``targets`` (from :func:`cast_llm.targets.find_targets` on the base model, before wrapping) names the
    layers by their weight Parameter; without it, every LoRA layer whose base weight is N:M along its input
    dimension is taken. Must run before any merge (the mask is read from the un-merged base weight).
    """
    merge_only, forward = _variants()
    variant = forward if masked_forward else merge_only
    wanted = None if targets is None else {id(t.weight) for t in targets}
    count = 0
    for name, layer in lora_layers(model):
        weight = layer.get_base_layer().weight
        if wanted is not None and id(weight) not in wanted:
            continue
        if wanted is None and not _weight_is_nm(layer, n, m):
            continue
        if layer.merged:
            raise CastError(f"LoRA layer {name} is merged; unmerge it before attaching N:M masks")
        layer.register_buffer(MASK_NAME, weight.detach() != 0, persistent=False)
        for adapter in layer.lora_A:
            layer.lora_variant[adapter] = variant()
        count += 1
    return count


@torch.no_grad()
def sparse_merge_(model: nn.Module, *, n: int = 2, m: int = 4) -> int:
    """Merge every active adapter as ``W ← W + M ⊙ ΔW`` (reversible by :func:`sparse_unmerge_`).

    Layers without a mask get one first if their base weight is N:M, so this is safe on a model loaded
    with plain peft. Returns the number of layers merged.
    """
    count = 0
    for _, layer in lora_layers(model):
        if getattr(layer, MASK_NAME, None) is None and _weight_is_nm(layer, n, m):
            layer.register_buffer(MASK_NAME, layer.get_base_layer().weight.detach() != 0, persistent=False)
        weight = layer.get_base_layer().weight
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A and adapter not in layer.merged_adapters:
                weight.data += masked_delta(layer, adapter).to(weight.dtype)
                layer.merged_adapters.append(adapter)
                count += 1
    return count


@torch.no_grad()
def sparse_unmerge_(model: nn.Module) -> int:
    """Undo :func:`sparse_merge_` (``W ← W − M ⊙ ΔW``; pruned weights were never touched, so they stay 0)."""
    count = 0
    for _, layer in lora_layers(model):
        weight = layer.get_base_layer().weight
        while layer.merged_adapters:
            adapter = layer.merged_adapters.pop()
            weight.data -= masked_delta(layer, adapter).to(weight.dtype)
            count += 1
    return count


def merge_and_unload_sparse(peft_model: nn.Module, *, n: int = 2, m: int = 4) -> nn.Module:
    """The plain base model with the adapters merged as ``W + M ⊙ ΔW`` and the LoRA modules removed."""
    sparse_merge_(peft_model, n=n, m=m)
    return peft_model.unload()


def build_lora_model(model: nn.Module, targets, cfg) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters (r, alpha, dropout, target modules from ``cfg``) and N:M masks."""
    from peft import LoraConfig, TaskType, get_peft_model

    modules = cfg.target_module_list or [t.fqn for t in targets]
    lcfg = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=modules,
        fan_in_fan_out=any(t.transposed for t in targets), bias="none",
        task_type=TaskType.SEQ_CLS if cfg.task == "classification" else TaskType.CAUSAL_LM,
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, lcfg)
    except ValueError as e:
        raise CastError(f"--lora-target-modules {cfg.lora_target_modules or '(N:M targets)'}: "
                        f"{str(e).splitlines()[0][:300]}") from None
    attach_nm_masks_(peft_model, targets=targets, masked_forward=cfg.lora_masked_forward)
    return peft_model


class LoraMode(FinetuneMode):
    """Train LoRA adapters (and a new classification head); export ``W + M ⊙ ΔW`` plus the adapter alone."""

    name = "lora"

    def prepare(self, model, targets, cfg):
        return build_lora_model(model, targets, cfg)

    def model_state(self, model) -> dict:
        """Only the trainable tensors: the frozen base is reloaded from MODEL (the fingerprint pins it)."""
        trainable = {k for k, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in model.state_dict().items() if k in trainable}

    def load_model_state(self, model, state: dict) -> None:
        trainable = {k for k, p in model.named_parameters() if p.requires_grad}
        if set(state) != trainable:
            raise CastError("checkpoint does not hold this run's LoRA parameters (different --lora-* settings?)")
        model.load_state_dict(state, strict=False)

    def finalize(self, model, optimizer, *, out, is_main: bool):
        if self.cfg.save_adapter and is_main:
            save_adapter(model, out / "adapter")
        merged = merge_and_unload_sparse(model, n=self.cfg.n, m=self.cfg.m)
        self.targets = find_targets(merged, n=self.cfg.n, m=self.cfg.m, skip_incompatible=self.cfg.skip_incompatible)
        FinetuneMode.verify(self, merged)
        return merged

    def export_metadata(self, cfg) -> dict:
        c = self.cfg
        return {"lora": {"r": c.lora_r, "alpha": c.lora_alpha, "dropout": c.lora_dropout,
                         "target_modules": c.target_module_list or "N:M targets",
                         "masked_forward": c.lora_masked_forward,
                         "merge": "W + M*(B A)*alpha/r, M = support of W",
                         "adapter": "adapter/" if c.save_adapter else None}}


def save_adapter(peft_model, path: Path) -> None:
    """Write the un-merged adapter (peft format) atomically: into a temporary folder, then renamed."""
    with atomic_dir(path, replace=True) as tmp:
        peft_model.save_pretrained(tmp)
