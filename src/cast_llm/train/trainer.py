"""``cast-llm train``: sparsity-aware training of a causal LM into an N:M model (method.md §5, Algorithm 2).

The job of the one training loop (:mod:`cast_llm.train.loop`) for every training method: packed text from
``--data`` (a seeded, resumable batch order), the student and — when distilling — its frozen dense teacher,
the loss of Eq. 13, the mask statistics observers, and at the end the verified N:M export with the
dense / one-shot / sparse perplexities (:class:`Evaluator`) and a summary.

Before anything is loaded (:meth:`PretrainJob.before_launch`), the model is built empty from its config:
the memory plan is made from it, ``--global-batch`` is split over the processes with the largest
micro-batch the plan fits, a run the plan says cannot fit stops with the options that would, and the
process groups' timeouts are set from the work they must cover (:mod:`cast_llm.plan.startup`). Under
``--fsdp`` only rank 0 then loads the weights (the others receive their shards from it); the baseline
evaluation runs on rank 0 alone, in the training precision; the export is written in the model's own dtype.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch

from cast_llm.data import BatchSampler, prepare, steps_for_tokens
from cast_llm.data.sources import source_files
from cast_llm.deploy.export import save_sparse_checkpoint
from cast_llm.distill import causal_kd_loss
from cast_llm.distill.head import fused_head_loss, head_inputs
from cast_llm.distill.teacher import TeacherForward, no_packed_sequence_check
from cast_llm.eval.evaluator import Evaluator
from cast_llm.eval.ppl import wikitext2_source
from cast_llm.machine import process_rss
from cast_llm.models import (
    check_seq_len,
    empty_model,
    load_model,
    load_tokenizer,
    max_positions,
    native_dtype,
)
from cast_llm.plan import fmt_size
from cast_llm.plan.batch import split_global_batch
from cast_llm.sparsity.mask import magnitude_mask
from cast_llm.targets import find_targets
from cast_llm.train import fsdp as fsdp2
from cast_llm.train.config import TrainConfig
from cast_llm.train.loop import Job, run
from cast_llm.train.memory import device_capacity, plan_for_run, refuse_if_too_large
from cast_llm.train.memory_options import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    teacher_dtype,
)
from cast_llm.train.methods import get_method
from cast_llm.train.observers import default_observers, with_masks_applied
from cast_llm.train.summary import mask_movement, options_used


# ------------------------------------------------------------------------------------------------- the loss
def lm_loss(student_logits, teacher_logits, input_ids, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Eq. 13 on next-token prediction; returns (loss, ce, kd), the parts detached on the logits' device for the
    log (read on log steps only: no host synchronisation per micro-batch; kd is 0.0 without a teacher).

    Without a teacher it is the chunked loss at η = 0 (plain CE, the same mean over the shifted tokens): a
    plain ``F.cross_entropy`` would keep fp32 log-probabilities of every token for backward (N × V × 4
    bytes, 16 GiB for 32k tokens of a 128k vocabulary)."""
    eta = cfg.eta if teacher_logits is not None else 0.0
    out = causal_kd_loss(student_logits, teacher_logits, input_ids, eta=eta, temperature=cfg.kd_temperature,
                         chunk_size=cfg.kd_chunk_size)
    if teacher_logits is None:
        return out.loss, out.ce, 0.0
    return out.loss, out.ce, out.kd


# --------------------------------------------------------------------------------------------------- train
class PretrainJob(Job):
    """Sparsity-aware (pre-)training of a causal LM on packed text, distilled from its dense self (Eq. 13)."""

    command = "train"
    kind = "run"
    marker_kind = "cast-llm-run"

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.method = get_method(cfg.method, mask_learner=cfg.mask_learner)
        self.desc = f"{cfg.method} {cfg.n}:{cfg.m}"
        self.say = lambda *a, **k: None

    def check_inputs(self) -> None:
        """``--data`` (and an explicit ``--wikitext-file``) exist, before the plan and the run folder."""
        source_files(self.cfg.data)  # raises for a missing file or folder, an unsupported type, a missing corpus
        if self.cfg.wikitext_file:
            wikitext2_source(self.cfg.wikitext_file)

    def before_launch(self, *, world: int, device_type: str, precision: str):
        """The model built empty (config only), the plan made from it, the batch split over the processes, a
        run that cannot fit refused, the timeouts set (see the module docstring); no weights are read. What
        this settles (the micro-batch and accumulation, the FSDP2 precision that runs) makes the run's config
        from here on: a new ``self.cfg``, derived from the one given (which is left as it was)."""
        cfg = self.cfg
        if cfg.fsdp:
            fsdp2.check_supported(cfg)
        self.fsdp_precision = fsdp2.precision_mode(cfg, precision)  # what runs; config.yaml records it too
        if self.fsdp_precision in ("policy", "autocast"):
            cfg = replace(cfg, fsdp_precision=self.fsdp_precision)
        self.framework = process_rss() if device_type == "cpu" else 0  # the plan's "framework" on a CPU
        self.skeleton = empty_model(cfg.model)
        check_seq_len(self.skeleton, cfg.seq_len, cfg.model)
        self.native_dtype = native_dtype(cfg.model)
        device = torch.device(device_type)
        native = torch.finfo(self.native_dtype).bits // 8

        def plan(batch_size: int, grad_accum: int):
            return plan_for_run(replace(cfg, batch_size=batch_size, grad_accum=grad_accum), self.skeleton,
                                world=world, device=device, precision=precision, framework=self.framework,
                                native_bytes=native)

        capacity = device_capacity(device, world)
        batch_size, grad_accum = split_global_batch(
            cfg.global_batch, world, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
            fits=lambda b, a: plan(b, a)[0].fits(capacity))
        self.cfg = cfg = replace(cfg, batch_size=batch_size, grad_accum=grad_accum)
        self.memory_plan, self.startup_plan, self.plan_lines = plan(cfg.batch_size, cfg.grad_accum)
        if cfg.memory_check:
            refuse_if_too_large(self.memory_plan, device, world, startup=self.startup_plan)
        return self.startup_plan.timeouts

    def setup(self, ctx, resuming: bool) -> dict[str, Any]:
        cfg, say, dist = self.cfg, ctx.say, ctx.distribution
        self.say = say
        for line in self.plan_lines:
            say(line)
        if cfg.global_batch:
            say(f"batch: --global-batch {cfg.global_batch} = micro-batch {cfg.batch_size} × --grad-accum "
                f"{cfg.grad_accum} × {ctx.world} process(es)")
        self.tokenizer = load_tokenizer(cfg.model)
        skeleton = self.skeleton
        targets = find_targets(skeleton, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        skipped = targets.skipped
        if skipped:
            say(f"leaving {len(skipped)} layer(s) dense (width not a multiple of {cfg.m}): "
                f"{', '.join(t.fqn for t in skipped)}")
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * ctx.world
        self.total_steps = cfg.max_steps or steps_for_tokens(cfg.tokens, self.tokens_per_step)
        # the budget's windows (one epoch of distinct text when the source holds them), read once into the cache
        self.data = prepare(cfg.data, self.tokenizer, cfg.seq_len,
                            train_sequences=self.total_steps * self.tokens_per_step // cfg.seq_len,
                            val_sequences=cfg.val_sequences, test_sequences=cfg.test_sequences,
                            val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction,
                            calib_samples=cfg.calib_samples, min_train_sequences=cfg.batch_size * ctx.world,
                            max_documents=cfg.max_documents, cache_root=cfg.data_cache,
                            progress=cfg.progress and ctx.is_main, say=say)
        say(f"data split: {self.data.split_note} (split {self.data.split_sha256[:12]})")
        self.sampler = BatchSampler(self.data.train.shape[0], cfg.batch_size, seed=cfg.seed, rank=ctx.rank,
                                    world_size=ctx.world)
        self.evaluator = Evaluator(cfg, self.tokenizer, self.data.test, max_positions(skeleton), val=self.data.val,
                                   train_tokens=self.total_steps * self.tokens_per_step, say=say)
        if hasattr(self.method, "prune_probe"):  # a method with a final prune of a dense-forward model (CAST)
            self.method.prune_probe = lambda model, label: self._prune_probe(ctx, model, label)
        self.device = ctx.device
        say(f"model {cfg.model}: {sum(p.numel() for p in skeleton.parameters()) / 1e6:.1f}M parameters, "
            f"{len(targets)} {cfg.n}:{cfg.m} targets; data {cfg.data}: {self.data.train.shape[0]} train / "
            f"{self.data.val.shape[0]} validation / {self.data.test.shape[0]} test sequences of {cfg.seq_len}; "
            f"{self.total_steps} steps × "
            f"{self.tokens_per_step} tokens on {ctx.world} process(es), {ctx.device}")
        say(f"evaluation: {self.evaluator.describe()} (--wikitext-windows 0: the full protocol)")
        results: dict[str, Any] = {"perplexity": {"heldout": {}, "wikitext2": {}}}
        kd = self.method.uses_kd(cfg)
        tdtype = teacher_dtype(cfg, ctx.precision)
        # The dense model: every process under DDP (each GPU holds it); under FSDP2 rank 0 alone — and on a
        # resume only for the teacher (the student's weights are in the checkpoint)
        loads = dist.loads_weights(resuming) or (cfg.fsdp and ctx.is_main and resuming and kd)
        with dist.waiting_for_main("loading the model and evaluating it"), ctx.phases("load the model"):
            dense = load_model(cfg.model, dtype=tdtype if (cfg.fsdp and resuming) else torch.float32) \
                if loads else None
            if ctx.is_main and dense is not None:
                say(f"loaded {cfg.model} on {'rank 0 alone' if cfg.fsdp else 'every process'} "
                    f"({fmt_size(sum(p.numel() * p.element_size() for p in dense.parameters()))} in host memory)")
            if not resuming and cfg.baseline_eval and ctx.is_main:
                with ctx.phases("baseline evaluation (rank 0)"):
                    results["perplexity"] = self._baseline(ctx, dense, targets)
        # the teacher: the dense model, before anything changes the student (and before it leaves the host)
        self.teacher = None
        if kd:
            with ctx.phases("teacher: sharded from rank 0" if cfg.fsdp else "teacher: copied"):
                self.teacher = dist.build_teacher(dense, cfg, tdtype, say)
        if cfg.fsdp:
            model = dense if (dense is not None and not resuming) else skeleton
            del dense  # on a resume rank 0's copy served the teacher only
        else:
            model = dense
        if cfg.activation_checkpointing != "none":
            enable_activation_checkpointing(model, cfg.activation_checkpointing)
        self.model = model
        return results

    def _baseline(self, ctx, model, targets) -> dict[str, dict[str, Any]]:
        """Where every run starts from, on rank 0 in the training precision: the dense model, and (without a
        warm start, which measures its own) its one-shot magnitude N:M; perplexities by split."""
        cfg = self.cfg
        ppl: dict[str, dict[str, Any]] = {"heldout": {}, "wikitext2": {}}
        with self.on_device(ctx, model):
            dense = self.evaluator.both(model, "dense model (the original)")
            for split in ("heldout", "wikitext2"):
                ppl[split]["dense"] = dense[split]
            if not cfg.use_warm_start:
                mags = {t.fqn: magnitude_mask(t.weight, t.transposed, cfg.n, cfg.m)
                        for t in find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)}
                magnitude = with_masks_applied(
                    model, mags, lambda m: self.evaluator.both(m, f"one-shot magnitude {cfg.n}:{cfg.m}"))
                for split in ("heldout", "wikitext2"):
                    ppl[split]["magnitude"] = magnitude[split]
        return ppl

    def _prune_probe(self, ctx, model, label: str) -> float | None:
        """The validation perplexity of the model as it stands (the method's final prune: just before and just
        after it), on the main process in the training precision; None under FSDP2 (the model is sharded)."""
        if self.cfg.fsdp or not ctx.is_main or self.evaluator.val.shape[0] == 0:
            return None
        with ctx.accelerator.autocast(), torch.no_grad():
            ppl = self.evaluator.validation(model, label)
        if ppl is not None:
            self.say(f"{label}: validation ppl {ppl:.2f}")
        return ppl

    def on_device(self, ctx, model):
        """Evaluate ``model`` on the device in the training precision (autocast). Under FSDP2 rank 0's whole
        copy goes back to the host afterwards: the device is for the shards; without FSDP2 it stays."""
        import contextlib

        @contextlib.contextmanager
        def ctxmgr():
            home = next(model.parameters()).device
            model.to(ctx.device)
            try:
                with ctx.accelerator.autocast(), torch.no_grad():
                    yield
            finally:
                if self.cfg.fsdp:
                    model.to(home)
        return ctxmgr()

    def after_prepare(self, ctx, model, resuming: bool) -> dict[str, Any]:
        """A warm start begins from the one-shot pruned model: measure it (the baseline the run must beat)."""
        cfg = self.cfg
        if resuming or not cfg.baseline_eval or not cfg.use_warm_start or not ctx.is_main:
            return {}
        name = {"sparsegpt": "SparseGPT", "wanda": "Wanda"}.get(cfg.effective_init_mask, cfg.effective_init_mask)
        with ctx.phases("one-shot evaluation (rank 0)"), self.on_device(ctx, model):
            start = self.evaluator.both(model, f"one-shot {name} {cfg.n}:{cfg.m} (the warm start)")
        model.train()
        return {"perplexity": {split: {"oneshot": start[split]} for split in ("heldout", "wikitext2")},
                "oneshot_method": cfg.effective_init_mask}

    def batch(self, step: int, micro: int) -> torch.Tensor:
        rows = self.data.train[self.sampler.index_list(step * self.cfg.grad_accum + micro)]
        if self.device.type == "cuda":  # from pinned memory, asynchronously: the host does not wait for the copy
            return rows.pin_memory().to(self.device, non_blocking=True)
        return rows.to(self.device)

    def loss(self, model, teacher, batch):
        if self.cfg.fused_head:
            return self._fused_loss(model, teacher, batch)
        with no_packed_sequence_check():  # no KV cache, and no host read for the packed-sequence check
            logits = model(input_ids=batch, use_cache=False).logits
        t_logits = None
        if teacher is not None:
            if self.teacher_forward is None or self.teacher_forward.teacher is not teacher:
                # inference_mode, no KV cache, on CUDA one graph replay (distill/teacher.py)
                self.teacher_forward = TeacherForward(teacher, cuda_graph=self.cfg.teacher_cuda_graph,
                                                      sharded=self.cfg.fsdp, say=self.say)
            t_logits = self.teacher_forward(batch)
        loss, ce, kd = lm_loss(logits, t_logits, batch, self.cfg)
        return loss, {"ce": ce, "kd": kd}, batch.numel()

    def _fused_loss(self, model, teacher, batch):
        """--fused-head: the models return their LM heads' inputs; the loss forms the logits chunk by chunk."""
        cfg = self.cfg
        with head_inputs(model, teacher):
            with no_packed_sequence_check():
                hidden = model(input_ids=batch, use_cache=False).logits
            t_hidden = None
            if teacher is not None:
                with torch.no_grad():
                    with no_packed_sequence_check():
                        t_hidden = teacher(input_ids=batch, use_cache=False).logits
        weight = getattr(model, "module", model).get_output_embeddings().weight
        with fsdp2.unsharded_head(teacher) as t_weight:
            out = fused_head_loss(hidden, weight, t_hidden, t_weight, batch, eta=cfg.eta if teacher is not None
                                  else 0.0, temperature=cfg.kd_temperature, chunk_size=cfg.kd_chunk_size)
        return out.loss, {"ce": out.ce, "kd": out.kd if teacher is not None else 0.0}, batch.numel()

    def observers(self, ctx) -> list:
        if self.cfg.fsdp:  # the per-layer analysis observers need whole tensors; mask statistics are summed
            ctx.say("FSDP2: per-layer statistics, weight tracking and ratio histograms are off (whole-model mask "
                    "statistics are logged)")
            return [fsdp2.ShardedMaskStats(ctx.device)]
        return default_observers(self.cfg)

    def finish(self, ctx, final, results) -> dict[str, Any]:
        cfg = self.cfg
        entries: dict[str, Any] = {}
        tokens_trained = self.total_steps * self.tokens_per_step
        self.teacher = self.teacher_forward = None  # its device memory goes to the final evaluation
        if ctx.is_main:
            disable_activation_checkpointing(final)  # nothing of it belongs in the exported model
            final.to(self.native_dtype)  # the model's own dtype (a bf16 model is exported in bf16, not fp32)
            final_targets = find_targets(final, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
            with ctx.phases("export (rank 0)"):
                save_sparse_checkpoint(final, self.tokenizer, ctx.out, n=cfg.n, m=cfg.m, method=cfg.method,
                                       targets=final_targets,
                                       metadata={"tokens_trained": tokens_trained, "steps": self.total_steps,
                                                 "seq_len": cfg.seq_len, "base_model": cfg.model,
                                                 "data": cfg.data, **self.method.export_metadata(cfg)})
            t0 = time.perf_counter()
            with ctx.phases("final evaluation (rank 0)"), self.on_device(ctx, final):
                sparse = self.evaluator.both(final, f"{cfg.method} {cfg.n}:{cfg.m} (the exported model)",
                                             validation=True)
            entries["final_eval_s"] = round(time.perf_counter() - t0, 2)
            entries["perplexity"] = {split: {"sparse": sparse[split]} for split in ("heldout", "validation", "wikitext2")}
            if sparse["wikitext2"] is not None:  # window by window: its figure on any first windows, model-free
                entries["wikitext2_window_nll"] = sparse["wikitext2_window_nll"]
            entries.update(
                method=cfg.method, model=cfg.model, data=cfg.data, pattern=f"{cfg.n}:{cfg.m}", steps=self.total_steps,
                tokens_trained=tokens_trained, seq_len=cfg.seq_len, eval_seq_len=self.evaluator.eval_len,
                heldout_sequences=int(self.evaluator.test.shape[0]),
                validation_sequences=int(self.evaluator.val.shape[0]),
                data_split={"kind": self.data.split, "note": self.data.split_note,
                            "sha256": self.data.split_sha256, "train_sequences": int(self.data.train.shape[0]),
                            "documents_read": self.data.documents},
                wikitext_windows=self.evaluator.windows,
                wikitext_windows_total=self.evaluator.windows_total,
                wikitext_file=self.evaluator.wiki_source,
                wall_time_s=round(ctx.elapsed(), 1), output_dir=str(ctx.out), threads=torch.get_num_threads(),
                export_dtype=str(self.native_dtype).removeprefix("torch."),
            )
            if cfg.fsdp:
                entries["fsdp_precision"] = self.fsdp_precision
            entries["options"] = options_used(cfg)
            entries["init_mask"] = cfg.effective_init_mask
            entries["masks"] = mask_movement(ctx.out)  # did the masks move? (summary, report, README)
            entries["nm_check"] = {"targets": len(final_targets), "pattern": f"{cfg.n}:{cfg.m}", "exact": True}
        return entries


def train(cfg: TrainConfig, *, log=print) -> dict[str, Any]:
    """Run one training job described by ``cfg``; returns the results written to ``results.json`` (empty on
    every process but the main one). Its last screen: :func:`cast_llm.train.summary.summary_table`; its HTML
    report: :func:`cast_llm.report.build_report` (``cast-llm train`` shows and writes both). ``cfg`` itself is
    never changed: what the launch settles goes into a config derived from it (the run's ``config.yaml``)."""
    cfg.validate()
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        # `accelerate launch --use_fsdp …` (or an accelerate config with FSDP): cast-llm applies FSDP2 itself
        # (train/fsdp.py); accelerate's own wrapping would shard the model a second time, so it is switched off
        os.environ["ACCELERATE_USE_FSDP"] = "false"
        cfg = replace(cfg, fsdp=True)
    return run(PretrainJob(cfg), log=log)
