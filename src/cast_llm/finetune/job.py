"""``cast-llm finetune``: the fine-tuning job of the one training loop (method.md §7 "Fine-tuning").

The loop (:mod:`cast_llm.train.loop`) brings the run folder and its lock, accelerate (one CPU, one GPU, or
DDP under ``accelerate launch``), the progress bar, ``metrics.jsonl``, atomic code-free checkpoints with
exact resume, preemption, one-line errors. This job brings the task: examples (prompt/completion, plain
text, or classification) from :mod:`cast_llm.finetune.data`, the task's loss
(:func:`~cast_llm.finetune.evaluate.batch_loss`), held-out metrics before, every ``eval_every`` steps and
after, and the export (verified N:M, or knowingly dense) with the sparsity report. The mode
(:data:`cast_llm.finetune.MODES`: lora, sparse, dense) is the loop's training method.
"""

from __future__ import annotations

from typing import Any

from cast_llm import __version__
from cast_llm.data import BatchSampler
from cast_llm.deploy.export import (
    format_sparsity_report,
    save_hf_checkpoint,
    save_sparse_checkpoint,
    sparsity_report,
)
from cast_llm.finetune import get_mode
from cast_llm.finetune.config import FinetuneConfig
from cast_llm.finetune.data import check_data_source, collate, load_task_data
from cast_llm.finetune.evaluate import batch_loss, evaluate, exact_match
from cast_llm.models import check_seq_len, load_model, load_tokenizer
from cast_llm.optim.schedule import FINETUNE_WARMUP
from cast_llm.sparsity.mask import pack_mask, unpack_mask
from cast_llm.targets import find_targets
from cast_llm.train.loop import Job, run

RUN_KIND = "cast-llm-finetune"


def load_task_model(cfg: FinetuneConfig, data, tokenizer):
    """The causal LM, or a sequence-classification head (new, seeded) on the same backbone."""
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


def _supports(targets) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {t.fqn: (tuple(t.weight.shape), pack_mask(t.weight.detach().cpu() != 0)) for t in targets}


def support_changes(before: dict, targets) -> int:
    """How many target entries changed between zero and non-zero since ``before`` (0 = same masks)."""
    changed = 0
    for t in targets:
        shape, packed = before[t.fqn]
        changed += int((unpack_mask(packed, shape) != (t.weight.detach().cpu() != 0)).sum())
    return changed


class FinetuneJob(Job):
    command = "finetune"
    kind = "fine-tuning run"
    marker_kind = RUN_KIND
    default_warmup = FINETUNE_WARMUP
    tokens_per_step = None  # examples vary in length: the log counts the tokens it saw

    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.method = get_mode(cfg.mode)
        self.desc = f"finetune {cfg.mode}"

    def check_inputs(self) -> None:
        """``--data`` and ``--eval-data`` exist, before the run folder is made."""
        check_data_source(self.cfg.data, "--data")
        if self.cfg.eval_data:
            check_data_source(self.cfg.eval_data, "--eval-data")

    def setup(self, ctx, resuming: bool) -> dict[str, Any]:
        cfg, say = self.cfg, ctx.say
        results: dict[str, Any] = {}
        self.tokenizer = tokenizer = load_tokenizer(cfg.model)
        self.data = data = load_task_data(cfg, tokenizer)
        model = load_task_model(cfg, data, tokenizer)
        check_seq_len(model, cfg.seq_len, cfg.model)
        targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        self.rows_before = sparsity_report(model, n=cfg.n, m=cfg.m, targets=targets)
        self.method.check_input(self.rows_before, cfg)
        self.supports_before = _supports(targets)
        self.was_nm = all(r.is_nm for r in self.rows_before)
        self.device, self.pad_id = ctx.device, tokenizer.pad_token_id
        self.eval_bs = cfg.eval_batch_size or cfg.batch_size
        self.total_steps = cfg.max_steps
        say(f"{cfg.mode} fine-tuning of {cfg.model} ({_sparsity_line(self.rows_before, cfg)}) for {cfg.task} on "
            f"{cfg.data}: {len(data.train)} train / {len(data.val)} held-out {data.kind} examples; "
            f"{self.total_steps} steps × {cfg.batch_size * cfg.grad_accum * ctx.world} examples on {ctx.world} "
            f"process(es), {ctx.device}")
        for note in _data_notes(data, cfg):
            say(note)
        model.to(ctx.device)
        if not resuming and cfg.baseline_eval and data.val:
            results["before"] = self.measure(model)
            say(f"before: {_metrics_line(results['before'])}")
        self.sampler = BatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed, rank=ctx.rank,
                                    world_size=ctx.world)
        self.model, self.teacher = model, None
        return results

    def measure(self, m) -> dict[str, Any]:
        cfg, data = self.cfg, self.data
        r = evaluate(m, data.val, task=cfg.task, batch_size=self.eval_bs, pad_id=self.pad_id, device=self.device)
        if data.kind == "instruction" and cfg.exact_match_examples:
            em = exact_match(m, self.tokenizer, data.val[: cfg.exact_match_examples],
                             max_new_tokens=cfg.exact_match_max_tokens, batch_size=self.eval_bs, device=self.device)
            r.update(exact_match=em["exact_match"], exact_match_examples=em["examples"],
                     exact_match_samples=em["samples"])
        return r

    def batch(self, step: int, micro: int):
        idx = self.sampler.indices(step * self.cfg.grad_accum + micro).tolist()
        return {k: v.to(self.device) for k, v in collate([self.data.train[i] for i in idx], self.pad_id).items()}

    def loss(self, model, teacher, batch):
        loss, _, _ = batch_loss(model, batch, self.cfg.task)
        return loss, {}, int(batch["attention_mask"].sum())

    def log_extra(self, ctx, step: int, raw) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.eval_every or step % cfg.eval_every or step == self.total_steps:
            return {}
        val = evaluate(raw, self.data.val, task=cfg.task, batch_size=self.eval_bs, pad_id=self.pad_id,
                       device=self.device)
        return {f"val_{k}": v for k, v in val.items() if k in ("loss", "accuracy", "perplexity")}

    def before_finalize(self, ctx, raw) -> dict[str, Any]:
        self.trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
        if self.cfg.mode == "lora" and not self.cfg.lora_masked_forward and self.data.val:
            return {"after_unmerged": self.measure(raw)}  # plain LoRA: the trained model differs from the merged one
        return {}

    def finish(self, ctx, final, results) -> dict[str, Any]:
        cfg, data = self.cfg, self.data
        final_targets = find_targets(final, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        rows_after = sparsity_report(final, n=cfg.n, m=cfg.m, targets=final_targets)
        changed = support_changes(self.supports_before, final_targets)
        meta = {"base_model": cfg.model, "task": cfg.task, "data": cfg.data, "steps": self.total_steps,
                "mask_changed_entries": changed, **self.method.export_metadata(cfg)}
        if ctx.is_main:
            _export(final, self.tokenizer, ctx.out, self.method, cfg, final_targets, rows_after, self.was_nm, meta,
                    ctx.say)
        after = self.measure(final) if data.val else {}
        entries: dict[str, Any] = {}
        if ctx.is_main:
            entries = dict(
                after=after, mode=cfg.mode, task=cfg.task, model=cfg.model, data=cfg.data, data_kind=data.kind,
                label_names=data.label_names, steps=self.total_steps, trainable_parameters=self.trainable,
                examples_trained=self.total_steps * cfg.batch_size * cfg.grad_accum * ctx.world,
                sparsity=_sparsity_summary(self.rows_before, rows_after, changed, cfg),
                wall_time_s=round(ctx.elapsed(), 1), output_dir=str(ctx.out),
            )
            ctx.say(summary_table({**results, **entries}))
            cls = "AutoModelForSequenceClassification" if cfg.task == "classification" else "AutoModelForCausalLM"
            ctx.say(f"fine-tuned model written to {ctx.out} (plain transformers loads it: {cls}.from_pretrained('{ctx.out}'))")
        return entries


def finetune(cfg: FinetuneConfig, *, log=print) -> dict[str, Any]:
    """Run one fine-tuning job described by ``cfg``; returns the results written to ``results.json``."""
    cfg.validate()
    return run(FinetuneJob(cfg), log=log)


def _export(final, tokenizer, out, mode, cfg, targets, rows, was_nm, meta, say) -> None:
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
        notes.append("note: no held-out examples (--eval-fraction 0 and no --eval-data): no before/after metrics")
    return notes


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
