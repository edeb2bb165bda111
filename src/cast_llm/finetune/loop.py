"""The one fine-tuning loop behind ``cast-llm finetune`` (method.md §7), for every mode and task.

Same conventions as ``cast-llm train`` (:mod:`cast_llm.train.trainer`, whose run-folder handling, JSONL
helpers and atomic checkpoints it reuses): ``accelerate`` (one CPU, one GPU, or DDP under ``accelerate
launch``), a progress bar, ``metrics.jsonl``, atomic verified checkpoints and exact resume (model or
adapter state, AdamW state, LR schedule, RNG states; the data position is the step), one-line errors.

Per optimizer step: ``grad_accum`` micro-batches (forward, :func:`~cast_llm.finetune.evaluate.batch_loss`,
backward), ``mode.before_step`` (sparse: mask the gradients), clipping, AdamW, ``mode.after_step``
(sparse: re-mask weights and moments), the LR schedule. Around it: held-out metrics before, every
``eval_every`` steps, and after; at the end ``mode.finalize`` (LoRA: save the adapter, merge as
``W + M ⊙ ΔW``, unload), export (verified N:M, or knowingly dense), and the sparsity report.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from cast_llm.errors import CastError
from cast_llm.finetune.config import FINGERPRINT_KEYS, FinetuneConfig
from cast_llm.finetune.data import collate, load_task_data
from cast_llm.finetune.evaluate import batch_loss, evaluate, exact_match
from cast_llm.train.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from cast_llm.train.trainer import (
    RUN_MARKER,
    _truncate_jsonl,
    _write_json,
    build_accelerator,
    prepare_run_dir,
)

RUN_KIND = "cast-llm-finetune"


def prepare_finetune_dir(cfg: FinetuneConfig, is_main: bool) -> Path:
    """:func:`~cast_llm.train.trainer.prepare_run_dir`, plus removal of a replaced run's adapter folder."""
    out = Path(cfg.output_dir)
    adapter = out / "adapter"
    if is_main and cfg.overwrite and not cfg.resume and (out / RUN_MARKER).is_file() \
            and (adapter / "adapter_config.json").is_file():
        shutil.rmtree(adapter)
    return prepare_run_dir(cfg, is_main)


def load_task_model(cfg: FinetuneConfig, data, tokenizer):
    """The causal LM, or a sequence-classification head (new, seeded) on the same backbone."""
    from cast_llm.models import load_model

    if cfg.task == "classification":
        from transformers import AutoModelForSequenceClassification

        names = data.label_names
        model = load_model(cfg.model, auto_class=AutoModelForSequenceClassification, num_labels=len(names),
                           id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    else:
        model = load_model(cfg.model)
    if model.config.pad_token_id is None:  # the classifier pools the last non-pad token: it must know pad
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def param_groups(model, weight_decay: float) -> list[dict]:
    """Trainable parameters; decoupled weight decay on matrices only (not on norms, biases)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _supports(targets) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    from cast_llm.sparsity.mask import pack_mask

    return {t.fqn: (tuple(t.weight.shape), pack_mask(t.weight.detach().cpu() != 0)) for t in targets}


def support_changes(before: dict, targets) -> int:
    """How many target entries changed between zero and non-zero since ``before`` (0 = same masks)."""
    from cast_llm.sparsity.mask import unpack_mask

    changed = 0
    for t in targets:
        shape, packed = before[t.fqn]
        changed += int((unpack_mask(packed, shape) != (t.weight.detach().cpu() != 0)).sum())
    return changed


def finetune(cfg: FinetuneConfig, *, log=print) -> dict[str, Any]:
    """Run one fine-tuning job described by ``cfg``; returns the results written to ``results.json``."""
    from accelerate.utils import set_seed
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from cast_llm.config import dump_yaml
    from cast_llm.data import BatchSampler
    from cast_llm.export import sparsity_report
    from cast_llm.finetune.modes import get_mode
    from cast_llm.models import check_seq_len, load_tokenizer
    from cast_llm.targets import find_targets

    cfg.validate()
    t_start = time.perf_counter()
    accelerator, _ = build_accelerator(cfg)
    is_main, world = accelerator.is_main_process, accelerator.num_processes
    out = prepare_finetune_dir(cfg, is_main)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)
    say = log if is_main else (lambda *a, **k: None)
    mode = get_mode(cfg.mode)

    # ---- data, model, the N:M check
    tokenizer = load_tokenizer(cfg.model)
    data = load_task_data(cfg, tokenizer)
    model = load_task_model(cfg, data, tokenizer)
    check_seq_len(model, cfg.seq_len, cfg.model)
    targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    rows_before = sparsity_report(model, n=cfg.n, m=cfg.m, targets=targets)
    mode.check_input(rows_before, cfg)
    supports_before = _supports(targets)
    was_nm = all(r.is_nm for r in rows_before)
    device, pad_id = accelerator.device, tokenizer.pad_token_id
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    total_steps = cfg.max_steps
    say(f"{cfg.mode} fine-tuning of {cfg.model} ({_sparsity_line(rows_before, cfg)}) for {cfg.task} on "
        f"{cfg.data}: {len(data.train)} train / {len(data.val)} held-out {data.kind} examples; "
        f"{total_steps} steps × {cfg.batch_size * cfg.grad_accum * world} examples on {world} process(es), {device}")
    for note in _data_notes(data, cfg):
        say(note)

    def measure(m) -> dict[str, Any]:
        r = evaluate(m, data.val, task=cfg.task, batch_size=eval_bs, pad_id=pad_id, device=device)
        if data.kind == "instruction" and cfg.exact_match_examples:
            em = exact_match(m, tokenizer, data.val[: cfg.exact_match_examples], max_new_tokens=cfg.max_new_tokens,
                             batch_size=eval_bs, device=device)
            r.update(exact_match=em["exact_match"], exact_match_examples=em["examples"],
                     exact_match_samples=em["samples"])
        return r

    model.to(device)
    checkpoints = list_checkpoints(out) if cfg.resume else []
    results: dict[str, Any] = {}
    if checkpoints and (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
    elif cfg.baseline_eval and data.val:
        results["before"] = measure(model)
        say(f"before: {_metrics_line(results['before'])}")

    # ---- mode, optimizer, schedule, resume
    model = mode.prepare(model, targets, cfg)
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.peak_lr)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.03 * total_steps))
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps,
                                                            min_lr_rate=cfg.min_lr_ratio)
    model, optimizer = accelerator.prepare(model, optimizer)
    raw = accelerator.unwrap_model(model)
    raw_opt = getattr(optimizer, "optimizer", optimizer)
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    sampler = BatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed, rank=accelerator.process_index,
                           world_size=world)
    cfg_dict = asdict(cfg)
    fp = {k: cfg_dict[k] for k in FINGERPRINT_KEYS}
    start_step = 0
    if checkpoints:
        states, meta = load_checkpoint(checkpoints[-1], fp)
        mode.load_model_state(raw, states["model"])
        optimizer.load_state_dict(states["optimizer"])
        scheduler.load_state_dict(states["scheduler"])
        mode.load_extra_state(states.get("mode"))
        set_rng_state(states["rng"])
        start_step = meta["step"]
        say(f"resumed from {checkpoints[-1]} at step {start_step}")
    if is_main:
        dump_yaml(cfg, out / "config.yaml")
        _write_json(out / RUN_MARKER, {"kind": RUN_KIND, "mode": cfg.mode, "task": cfg.task, "config": cfg_dict})
        _truncate_jsonl(out / "metrics.jsonl", start_step)

    def checkpoint(step: int) -> None:
        _verify(mode, raw, targets, cfg)  # re-verify N:M (and the masks) at every save
        states = {"model": mode.model_state(raw), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "rng": rng_state(), "mode": mode.extra_state()}
        if is_main:
            save_checkpoint(out, step, states, {"fingerprint": fp}, keep=cfg.keep_checkpoints)
            _write_json(out / "results.json", results)
        accelerator.wait_for_everyone()

    # ---- the loop
    bar = None
    if is_main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc=f"finetune {cfg.mode}", unit="step", dynamic_ncols=True)
    window = _new_window()
    for step in range(start_step, total_steps):
        for micro in range(cfg.grad_accum):
            idx = sampler.indices(step * cfg.grad_accum + micro).tolist()
            batch = {k: v.to(device) for k, v in collate([data.train[i] for i in idx], pad_id).items()}
            sync = micro == cfg.grad_accum - 1
            ctx = accelerator.no_sync(model) if (not sync and world > 1) else _nullcontext()
            with ctx, accelerator.autocast():
                loss, _, _ = batch_loss(model, batch, cfg.task)
                if not torch.isfinite(loss.detach()):
                    raise CastError(f"loss became {float(loss)} at step {step + 1}; stopped (checkpoints so far: "
                                    f"{len(list_checkpoints(out))}); lower --lr or check the data")
                accelerator.backward(loss / cfg.grad_accum)
            window["loss"] += float(loss.detach()) / cfg.grad_accum
            window["tokens"] += int(batch["attention_mask"].sum())
        mode.before_step(raw)
        if cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        mode.after_step(raw, raw_opt)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        window["n"] += 1
        if done % cfg.log_every == 0 or done == total_steps or (cfg.eval_every and done % cfg.eval_every == 0):
            rec = _record(done, window, scheduler)
            if cfg.eval_every and done % cfg.eval_every == 0 and done != total_steps:
                val = evaluate(raw, data.val, task=cfg.task, batch_size=eval_bs, pad_id=pad_id, device=device)
                rec.update({f"val_{k}": v for k, v in val.items() if k in ("loss", "accuracy", "perplexity")})
            if is_main:
                with (out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", **({"val": f"{rec['val_loss']:.3f}"} if "val_loss" in rec else {}))
            window = _new_window()
        if cfg.save_every and done % cfg.save_every == 0 and done != total_steps:
            checkpoint(done)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    # ---- finish: (LoRA) adapter + masked merge, verified export, after-metrics, sparsity report
    if cfg.mode == "lora" and not cfg.lora_masked_forward and data.val:
        results["after_unmerged"] = measure(raw)  # plain LoRA: the trained model differs from the merged one
    _verify(mode, raw, targets, cfg)
    final = mode.finalize(raw, out, is_main)
    accelerator.wait_for_everyone()
    final_targets = find_targets(final, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    rows_after = sparsity_report(final, n=cfg.n, m=cfg.m, targets=final_targets)
    changed = support_changes(supports_before, final_targets)
    meta = {"base_model": cfg.model, "task": cfg.task, "data": cfg.data, "steps": total_steps,
            "mask_changed_entries": changed, **mode.metadata()}
    if is_main:
        _export(final, tokenizer, out, mode, cfg, final_targets, rows_after, was_nm, meta, say)
    after = measure(final) if data.val else {}
    if is_main:
        results.update(
            after=after, mode=cfg.mode, task=cfg.task, model=cfg.model, data=cfg.data, data_kind=data.kind,
            label_names=data.label_names, steps=total_steps, trainable_parameters=trainable,
            examples_trained=total_steps * cfg.batch_size * cfg.grad_accum * world,
            sparsity=_sparsity_summary(rows_before, rows_after, changed, cfg),
            wall_time_s=round(time.perf_counter() - t_start, 1), output_dir=str(out),
        )
        _write_json(out / "results.json", results)
        say(summary_table(results))
        cls = "AutoModelForSequenceClassification" if cfg.task == "classification" else "AutoModelForCausalLM"
        say(f"fine-tuned model written to {out} (plain transformers loads it: {cls}.from_pretrained('{out}'))")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def _verify(mode, model, targets, cfg) -> None:
    from cast_llm.export import verify_nm

    mode.verify(model)
    if mode.keeps_nm:
        verify_nm(model, n=cfg.n, m=cfg.m, targets=targets)


def _export(final, tokenizer, out, mode, cfg, targets, rows, was_nm, meta, say) -> None:
    from cast_llm import __version__
    from cast_llm.export import format_sparsity_report, save_hf_checkpoint, save_sparse_checkpoint

    if mode.keeps_nm:
        save_sparse_checkpoint(final, tokenizer, out, n=cfg.n, m=cfg.m, method=mode.method_name, targets=targets,
                               metadata=meta)
    else:
        zeros, numel = sum(r.zeros for r in rows), sum(r.numel for r in rows)
        bad = sum(not r.is_nm for r in rows)
        say(f"warning: --mode dense: the fine-tuned model is dense ({zeros / max(numel, 1):.2%} of target weights "
            f"zero; {bad} of {len(rows)} targets {'no longer' if was_nm else 'not'} {cfg.n}:{cfg.m}); it is "
            "written as a dense model (config.json sparsity.pattern = none)")
        info = {"pattern": "none", "method": mode.method_name, "base_pattern": f"{cfg.n}:{cfg.m}" if was_nm else "none",
                "targets": [r.name for r in rows], "target_sparsity": zeros / max(numel, 1),
                "cast_llm_version": __version__, **meta}
        save_hf_checkpoint(final, tokenizer, out, info, kind="dense-model")
    say("sparsity of the exported model:")
    say(format_sparsity_report(rows, n=cfg.n, m=cfg.m, per_layer=cfg.per_layer_report))


def _sparsity_line(rows, cfg) -> str:
    zeros, numel = sum(r.zeros for r in rows), sum(r.numel for r in rows)
    nm = all(r.is_nm for r in rows)
    return f"{zeros / max(numel, 1):.2%} of {len(rows)} target layers zero, {'' if nm else 'not '}{cfg.n}:{cfg.m}"


def _sparsity_summary(before, after, changed, cfg) -> dict[str, Any]:
    def one(rows):
        zeros, numel = sum(r.zeros for r in rows), sum(r.numel for r in rows)
        return {"target_sparsity": zeros / max(numel, 1), "targets": len(rows),
                "not_nm": [r.name for r in rows if not r.is_nm], "is_nm": all(r.is_nm for r in rows)}

    return {"pattern": f"{cfg.n}:{cfg.m}", "before": one(before), "after": one(after),
            "mask_changed_entries": changed,
            "per_layer_after": {r.name: round(r.sparsity, 6) for r in after}}


def _data_notes(data, cfg) -> list[str]:
    notes = []
    if data.truncated:
        notes.append(f"note: {data.truncated} example(s) longer than --seq-len {cfg.seq_len} were truncated")
    if data.dropped:
        notes.append(f"note: {data.dropped} example(s) dropped: the prompt alone fills --seq-len {cfg.seq_len}")
    if not data.val:
        notes.append("note: no held-out examples (--val-fraction 0 and no --eval-data): no before/after metrics")
    return notes


def _new_window() -> dict[str, Any]:
    return {"loss": 0.0, "n": 0, "tokens": 0, "t0": time.perf_counter()}


def _record(step: int, window: dict, scheduler) -> dict[str, Any]:
    dt = time.perf_counter() - window["t0"]
    return {"step": step, "loss": window["loss"] / max(window["n"], 1), "lr": scheduler.get_last_lr()[0],
            "tokens_per_s": window["tokens"] / dt if dt > 0 else math.nan}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _metrics_line(r: dict[str, Any]) -> str:
    parts = [f"held-out loss {r['loss']:.4f}"] if "loss" in r else []
    if "accuracy" in r:
        parts.append(f"accuracy {r['accuracy']:.2%} ({r['examples']} examples)")
    if "perplexity" in r:
        parts.append(f"ppl {r['perplexity']:.2f}")
    if "exact_match" in r:
        parts.append(f"exact match {r['exact_match']:.2%} ({r['exact_match_examples']} items)")
    return ", ".join(parts) or "n/a"


def summary_table(results: dict[str, Any]) -> str:
    """Before / after metrics and sparsity as a small text table."""
    cols = [("before", results.get("before") or {})]
    if results.get("after_unmerged"):
        cols.append(("LoRA unmerged", results["after_unmerged"]))
    cols.append(("after (exported)", results.get("after") or {}))
    sp = results.get("sparsity", {})
    rows = [("held-out loss", "loss", "{:.4f}"), ("held-out accuracy", "accuracy", "{:.2%}"),
            ("held-out perplexity", "perplexity", "{:.2f}"), ("exact match", "exact_match", "{:.2%}")]
    head = f"{'':<22}" + "".join(f"{name:>18}" for name, _ in cols)
    lines = [head, "-" * len(head)]
    for label, key, fmt in rows:
        if any(key in c for _, c in cols):
            lines.append(f"{label:<22}" + "".join(f"{fmt.format(c[key]) if key in c else 'n/a':>18}" for _, c in cols))
    if sp:
        def cell(s):
            return f"{s['target_sparsity']:.2%} {'N:M' if s['is_nm'] else 'dense'}"

        cells = [cell(sp["before"])] + ([""] if results.get("after_unmerged") else []) + [cell(sp["after"])]
        lines.append(f"{'target sparsity':<22}" + "".join(f"{c:>18}" for c in cells))
        lines.append(f"({sp['pattern']} check; {sp['mask_changed_entries']:,} target entries changed between zero "
                     f"and non-zero; {results.get('steps')} steps, {results.get('wall_time_s')} s)")
    return "\n".join(lines)
