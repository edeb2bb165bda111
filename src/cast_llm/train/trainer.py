"""The one training loop (method.md §5, Algorithm 2) shared by every training method.

Built on ``accelerate``: the same code runs on one CPU, one GPU, and many GPUs (DDP) under
``accelerate launch``. Per optimizer step: ``grad_accum`` micro-batches (forward of the student; forward of
the frozen teacher under ``no_grad`` when distilling; loss = Eq. 13), gradient clipping, one optimizer step,
one LR-schedule step. Around it: statistics every ``log_every`` steps (JSONL + TensorBoard), validation,
atomic checkpoints, and at the end prune → fold → verify N:M → export → final perplexities.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cast_llm.errors import CastError
from cast_llm.train.checkpoint import (
    fingerprint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from cast_llm.train.config import TrainConfig
from cast_llm.train.observers import StepContext, default_observers, with_masks_applied

RUN_MARKER = "cast_run.json"
RUN_FILES = ("config.yaml", "metrics.jsonl", "results.json", "tensorboard", "checkpoints", RUN_MARKER)


# ----------------------------------------------------------------------------------------------- run folder
def prepare_run_dir(cfg: TrainConfig, is_main: bool) -> Path:
    """Create / validate the run folder. An existing folder is reused only for --resume or --overwrite."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise CastError(f"--output-dir {out} exists and is a file")
    existing = out.is_dir() and any(out.iterdir())
    is_run = (out / RUN_MARKER).is_file() or (out / "cast_llm.json").is_file()
    if cfg.resume:
        if not is_run:
            raise CastError(f"--resume: {out} is not a cast-llm run folder (no {RUN_MARKER})")
        if not list_checkpoints(out):
            raise CastError(f"--resume: {out} holds no checkpoint yet; start it again without --resume "
                            "(with --overwrite) or use --save-every")
        return out
    if existing:
        if not cfg.overwrite:
            kind = "a cast-llm run" if is_run else "not a cast-llm run"
            raise CastError(f"--output-dir {out} already exists and is {kind}; pass --overwrite to replace it, "
                            "--resume to continue it, or choose another folder")
        if is_main:  # remove only what a run writes; never files we did not create
            for name in RUN_FILES + ("cast_llm.json", "config.json", "generation_config.json"):
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            for p in out.glob("*.safetensors*"):
                p.unlink()
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    return out


# ------------------------------------------------------------------------------------------------- the loss
def lm_loss(student_logits, teacher_logits, input_ids, cfg: TrainConfig) -> tuple[torch.Tensor, float, float]:
    """Eq. 13 on next-token prediction; returns (loss, ce, kd) with the parts as floats for logging."""
    if teacher_logits is None:
        ce = F.cross_entropy(student_logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
        return ce, float(ce.detach()), 0.0
    from cast_llm.distill import causal_kd_loss

    out = causal_kd_loss(student_logits, teacher_logits, input_ids, eta=cfg.eta, temperature=cfg.temperature,
                         chunk_size=cfg.kd_chunk_size)
    return out.loss, float(out.ce), float(out.kd)


# ----------------------------------------------------------------------------------------------- evaluation
class Evaluator:
    """Held-out and WikiText-2 perplexities of the (possibly wrapped) student, dense and hard-masked."""

    def __init__(self, cfg: TrainConfig, tokenizer, val: torch.Tensor, model_max: int | None):
        from cast_llm.eval.ppl import tokenize_text, wikitext2_file

        self.cfg = cfg
        self.val = val[: cfg.val_sequences] if cfg.val_sequences else val
        self.wiki_ids = None
        path = Path(cfg.wikitext_file) if cfg.wikitext_file else wikitext2_file()
        if cfg.wikitext_file and not path.is_file():
            raise CastError(f"--wikitext-file {path} does not exist (the shared WikiText-2 test file is expected "
                            "at ../shared/data/wikitext-2-raw/test.txt)")
        if path is not None:
            self.wiki_ids = tokenize_text(path.read_text(encoding="utf-8"), tokenizer)
            self.wiki_path = path
        self.eval_len = cfg.eval_seq_len or cfg.seq_len
        if model_max is not None and self.eval_len > model_max:
            raise CastError(f"--eval-seq-len {self.eval_len} is above the model maximum ({model_max})")

    def heldout(self, model) -> float | None:
        from cast_llm.eval.ppl import packed_perplexity

        if self.val.shape[0] == 0:
            return None
        return packed_perplexity(model, self.val, batch_size=self.cfg.batch_size, progress=self.cfg.progress,
                                 desc="eval held-out").perplexity

    def wikitext(self, model) -> float | None:
        from cast_llm.eval.ppl import perplexity

        if self.wiki_ids is None:
            return None
        return perplexity(model, self.wiki_ids, self.eval_len, batch_size=1,
                          max_windows=self.cfg.wikitext_windows or None, progress=self.cfg.progress,
                          desc="eval wikitext-2").perplexity

    def both(self, model) -> dict[str, float | None]:
        return {"heldout": self.heldout(model), "wikitext2": self.wikitext(model)}


# --------------------------------------------------------------------------------------------------- train
def _precision(cfg: TrainConfig, device_type: str) -> str:
    if cfg.precision == "auto":
        return "bf16" if device_type == "cuda" else "no"
    return "no" if cfg.precision == "fp32" else cfg.precision


def build_accelerator(cfg):
    """The Accelerator of a training or fine-tuning job: its device from ``cfg.device`` (``auto``: CUDA when
    visible) and its mixed precision from ``cfg.precision``; returns ``(accelerator, precision)``."""
    from accelerate import Accelerator

    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise CastError("--device cuda but no CUDA GPU is visible; use --device cpu")
    precision = _precision(cfg, "cpu" if cpu else "cuda")
    return Accelerator(cpu=cpu, mixed_precision=precision), precision


def _never(step: int) -> bool:
    return False


def lr_factor(cfg: TrainConfig, total_steps: int):
    """The lr multiplier as a function of the scheduler step k (optimizer step k+1 uses it).

    Linear warm-up ``k/W`` over ``W`` steps, then with ``p = (k−W)/(T−W)``: ``cosine`` ``r + (1−r)·½(1+cos πp)``, ``linear`` ``r + (1−r)(1−p)``, or ``constant`` 1, where
    ``r = min_lr_ratio``. (The cosine is the one of transformers' ``get_cosine_with_min_lr_schedule_with_warmup``,
    which earlier versions of the trainer used.)
    """
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.02 * total_steps))
    floor, kind = cfg.min_lr_ratio, cfg.lr_schedule

    def factor(k: int) -> float:
        if k < warmup:
            return float(k) / float(max(1, warmup))
        if kind == "constant":
            return 1.0
        p = float(k - warmup) / float(max(1, total_steps - warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * p)) if kind == "cosine" else 1.0 - p
        return max(0.0, floor + (1.0 - floor) * shape)

    return factor


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int):
    """The run's LR scheduler (stepped once per optimizer step by the loop)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, total_steps))


def schedule_lrs(cfg: TrainConfig, total_steps: int) -> list[float]:
    """γ_t for t = 1 … T, as the optimizer will see them."""
    f = lr_factor(cfg, total_steps)
    return [cfg.lr * f(k) for k in range(total_steps)]


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def train(cfg: TrainConfig, *, log=print) -> dict[str, Any]:
    """Run one training job described by ``cfg``; returns the results written to ``results.json``."""
    from accelerate.utils import set_seed

    from cast_llm.config import dump_yaml
    from cast_llm.data import BatchSampler, prepare, steps_for_tokens
    from cast_llm.models import check_seq_len, load_model, load_tokenizer, max_positions
    from cast_llm.targets import find_targets
    from cast_llm.train.methods import get_method

    cfg.validate()
    t_start = time.perf_counter()
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        # `accelerate launch --use_fsdp …` (or an accelerate config with FSDP): cast-llm applies FSDP2 itself
        # (train/fsdp.py); accelerate's own wrapping would shard the model a second time, so it is switched off
        os.environ["ACCELERATE_USE_FSDP"] = "false"
        cfg.fsdp = True
    accelerator, precision = build_accelerator(cfg)
    is_main = accelerator.is_main_process
    world = accelerator.num_processes
    out = prepare_run_dir(cfg, is_main)
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)
    say = log if is_main else (lambda *a, **k: None)
    method = get_method(cfg.method)
    if cfg.fsdp:
        from cast_llm.train import fsdp as fsdp2

        fsdp2.check_supported(cfg)

    # ---- model, teacher, data
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype=torch.float32)
    check_seq_len(model, cfg.seq_len, cfg.model)
    targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    skipped = getattr(targets, "skipped", [])
    if skipped:
        say(f"leaving {len(skipped)} layer(s) dense (width not a multiple of {cfg.m}): {', '.join(t.fqn for t in skipped)}")
    data = prepare(cfg.data, tokenizer, cfg.seq_len, seed=cfg.seed, val_fraction=cfg.val_fraction,
                   min_train_sequences=cfg.batch_size * world, max_documents=cfg.max_documents)
    sampler = BatchSampler(data.train.shape[0], cfg.batch_size, seed=cfg.seed, rank=accelerator.process_index,
                           world_size=world)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len * world
    total_steps = cfg.max_steps or steps_for_tokens(cfg.tokens, tokens_per_step)
    evaluator = Evaluator(cfg, tokenizer, data.val, max_positions(model))
    say(f"model {cfg.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(targets)} {cfg.n}:{cfg.m} targets; data {cfg.data}: {data.train.shape[0]} train / "
        f"{data.val.shape[0]} held-out sequences of {cfg.seq_len}; {total_steps} steps × {tokens_per_step} tokens "
        f"on {world} process(es), {accelerator.device}")

    checkpoints = list_checkpoints(out) if cfg.resume else []
    results: dict[str, Any] = {"perplexity": {"heldout": {}, "wikitext2": {}}}
    if checkpoints and (out / "results.json").is_file():
        results = json.loads((out / "results.json").read_text())
    elif cfg.baseline_eval:  # the starting points of every run: dense and one-shot magnitude N:M
        from cast_llm.sparsity.mask import nm_mask

        model.to(accelerator.device)
        dense = evaluator.both(model)
        mags = {t.fqn: nm_mask(t.weight.detach().t() if t.transposed else t.weight.detach(), cfg.n, cfg.m)
                for t in targets}
        mags = {t.fqn: (mags[t.fqn].t() if t.transposed else mags[t.fqn]) for t in targets}
        magnitude = with_masks_applied(model, mags, evaluator.both)
        for split in ("heldout", "wikitext2"):
            results["perplexity"][split].update(dense=dense[split], magnitude=magnitude[split])
        say(f"start: dense ppl {_fmt(dense)}; one-shot magnitude {cfg.n}:{cfg.m} ppl {_fmt(magnitude)}")

    teacher = None
    if method.uses_kd(cfg):
        teacher = copy.deepcopy(model).eval().requires_grad_(False)
        if precision == "bf16":  # the training dtype: half the memory of
            teacher.to(torch.bfloat16)  # fp32 weights, and no weight casts by autocast at every forward
    method.prepare_model(model, cfg, data=data, device=accelerator.device)
    model.train()
    if cfg.fsdp:  # shard before the optimizer is built: AdamS must hold the sharded (DTensor) parameters
        mesh = fsdp2.device_mesh(accelerator.device)
        for module in (model, teacher):
            if module is not None:
                transposed = [t.weight for t in find_targets(module, n=cfg.n, m=cfg.m,
                                                              skip_incompatible=cfg.skip_incompatible)
                              if t.transposed]
                fsdp2.shard_model(module, mesh, transposed_weights=transposed)
        say(f"FSDP2: student{' and teacher' if teacher is not None else ''} sharded over {world} processes "
            "(rows of every weight; N:M groups stay whole on one rank)")
    optimizer = method.build_optimizer(model, cfg, total_steps)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    # the scheduler is stepped by us once per optimizer step (accelerate's wrapper would step it per process)
    if not cfg.fsdp:  # (--fsdp: sharded above; accelerate only sets up processes, device and autocast)
        model, optimizer = accelerator.prepare(model, optimizer)
        if teacher is not None:
            teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
    raw = accelerator.unwrap_model(model)
    for module in (raw, teacher):
        _keep_output_dtype(module)
    raw_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it; methods need the AdamS itself

    cfg_dict = asdict(cfg)
    fp = fingerprint(cfg_dict)
    start_step = 0
    if cfg.fsdp:  # the per-layer analysis observers need whole tensors; mask statistics are summed over ranks
        observers = [fsdp2.ShardedMaskStats(accelerator.device)]
        say("FSDP2: per-layer statistics, weight tracking and ratio histograms are off (whole-model mask "
            "statistics are logged)")
    else:
        observers = default_observers(cfg)
    if checkpoints:
        if cfg.fsdp:
            states, meta = load_checkpoint(checkpoints[-1], fp, rank=accelerator.process_index, world_size=world)
            fsdp2.load_local_model_state(raw, states["model"])
            fsdp2.load_local_optimizer_state(optimizer, states["optimizer"])
        else:
            states, meta = load_checkpoint(checkpoints[-1], fp)
            raw.load_state_dict(states["model"])
            optimizer.load_state_dict(states["optimizer"])
        scheduler.load_state_dict(states["scheduler"])
        from cast_llm.train.checkpoint import set_rng_state

        set_rng_state(states["rng"])
        start_step = meta["step"]
        for ob in observers:
            ob.load_state_dict(states["observers"].get(ob.name, {}))
        say(f"resumed from {checkpoints[-1]} at step {start_step}")
    if is_main:
        dump_yaml(cfg, out / "config.yaml")
        _write_json(out / RUN_MARKER, {"kind": "cast-llm-run", "method": cfg.method, "config": cfg_dict})
        _truncate_jsonl(out / "metrics.jsonl", start_step)

    tb = None
    if is_main:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def checkpoint(step: int) -> None:
        if cfg.fsdp:  # every rank writes its own shards into the same folder, renamed into place at the end
            from cast_llm.train.checkpoint import save_sharded_checkpoint

            per_rank = {"model": fsdp2.local_model_state(raw), "optimizer": fsdp2.local_optimizer_state(optimizer),
                        "rng": rng_state(), "observers": {ob.name: ob.state_dict() for ob in observers}}
            save_sharded_checkpoint(out, step, {"scheduler": scheduler.state_dict()}, per_rank,
                                    {"fingerprint": fp, "tokens": step * tokens_per_step},
                                    rank=accelerator.process_index, world_size=world,
                                    barrier=accelerator.wait_for_everyone, keep=cfg.keep_checkpoints)
            if is_main:
                _write_json(out / "results.json", results)
            accelerator.wait_for_everyone()
            return
        states = {"model": raw.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "rng": rng_state(),
                  "observers": {ob.name: ob.state_dict() for ob in observers}}
        if is_main:
            save_checkpoint(out, step, states, {"fingerprint": fp, "tokens": step * tokens_per_step},
                            keep=cfg.keep_checkpoints)
            _write_json(out / "results.json", results)
        accelerator.wait_for_everyone()

    # ---- will AdamS's decay finish? (CAST with AdamS, not under FSDP2; forecast before the first update and
    # at every log step; docs/training.md "Budgets")
    forecaster = None
    if cfg.method == "cast" and cfg.mask_learner == "adams" and not cfg.fsdp:
        from cast_llm.optim.forecast import forecast_decay

        lrs = schedule_lrs(cfg, total_steps)

        def forecaster(opt, suggest=True):
            return forecast_decay(opt, lrs, target=cfg.forecast_target, suggest=suggest)

    # ---- the loop
    bar = None
    if is_main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc=f"{cfg.method} {cfg.n}:{cfg.m}", unit="step",
                   dynamic_ncols=True)
    window = {"loss": 0.0, "ce": 0.0, "kd": 0.0, "n": 0, "tokens": 0, "t0": time.perf_counter()}
    last_good = checkpoints[-1] if checkpoints else None
    for step in range(start_step, total_steps):
        method.begin_step(raw, raw_opt, step)
        for micro in range(cfg.grad_accum):
            idx = sampler.indices(step * cfg.grad_accum + micro)
            batch = data.train[idx].to(accelerator.device)
            sync = micro == cfg.grad_accum - 1
            if cfg.fsdp:
                fsdp2.set_gradient_sync(model, sync)
                ctx = _nullcontext()
            else:
                ctx = accelerator.no_sync(model) if (not sync and world > 1) else _nullcontext()
            with ctx, accelerator.autocast():
                logits = model(input_ids=batch).logits
                t_logits = None
                if teacher is not None:
                    with torch.no_grad():
                        t_logits = teacher(input_ids=batch).logits
                loss, ce, kd = lm_loss(logits, t_logits, batch, cfg)
                del logits, t_logits
                if not torch.isfinite(loss.detach()):
                    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written"
                    raise CastError(f"loss became {float(loss.detach())} at step {step + 1}; stopped ({where}); "
                                    "lower --lr or check the data")
                accelerator.backward(loss / cfg.grad_accum)
            window["loss"] += float(loss.detach()) / cfg.grad_accum
            window["ce"] += ce / cfg.grad_accum
            window["kd"] += kd / cfg.grad_accum
        if cfg.grad_clip > 0 and cfg.fsdp:  # torch's clip works on DTensor gradients: the global norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        elif cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if step == 0 and forecaster is not None:  # before the first update: the gradient noise is known
            fc = forecaster(raw_opt)
            results["decay"] = {"forecast_at_start": fc.as_dict()}
            say(fc.message(lr=cfg.lr, l1_decay=cfg.l1_decay))
        optimizer.step()
        method.end_step(raw, raw_opt, step)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        window["n"] += 1
        window["tokens"] += tokens_per_step

        is_log = done % cfg.log_every == 0 or done == total_steps
        ctx = StepContext(step=done, total_steps=total_steps, model=raw, is_log_step=is_log, run_dir=out,
                          is_main=is_main, cfg=cfg, evaluator=evaluator,
                          masks_fn=lambda: method.current_masks(raw, raw_opt))
        measured = {}
        for ob in observers:
            measured.update(ob.on_step(ctx) or {})
        if is_log:
            rec = _log_record(done, window, tokens_per_step, scheduler, accelerator)
            rec.update(measured)
            if forecaster is not None and done < total_steps and not getattr(method, "in_repair", _never)(step):
                rec["forecast_sparse_weight_ratio"] = forecaster(raw_opt, suggest=False).sparse_weight_ratio
            report = getattr(method, "prune_report", None)
            if report is not None and results.get("decay", {}).get("final_prune") != report:
                results.setdefault("decay", {})["final_prune"] = report
            if is_main:
                with (out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                for k, v in rec.items():
                    if k != "step" and isinstance(v, (int, float)) and v is not None:
                        tb.add_scalar(f"train/{k}", v, done)
            window = {"loss": 0.0, "ce": 0.0, "kd": 0.0, "n": 0, "tokens": 0, "t0": time.perf_counter()}
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                                flips=f"{rec['flip_rate']:.2%}")
        if cfg.save_every and done % cfg.save_every == 0 and done != total_steps:
            checkpoint(done)
            last_good = list_checkpoints(out)[-1] if is_main else last_good
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    # ---- finish: prune with the final masks, fold scales, verify N:M, export, evaluate
    end_ctx = StepContext(step=total_steps, total_steps=total_steps, model=raw, is_log_step=False, run_dir=out,
                          is_main=is_main, cfg=cfg, evaluator=evaluator,
                          masks_fn=lambda: method.current_masks(raw, raw_opt))
    for ob in observers:
        ob.on_end(end_ctx)
    if cfg.fsdp:
        raw = _finish_fsdp(cfg, raw, raw_opt, is_main, accelerator.device)
        teacher = optimizer = raw_opt = model = None
    else:
        method.finalize(raw, raw_opt)
        report = getattr(method, "prune_report", None)
        if report is not None:
            results.setdefault("decay", {})["final_prune"] = report
    model = raw
    accelerator.wait_for_everyone()
    tokens_trained = total_steps * tokens_per_step
    if is_main:
        from cast_llm.export import save_sparse_checkpoint

        final_targets = find_targets(raw, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        save_sparse_checkpoint(raw, tokenizer, out, n=cfg.n, m=cfg.m, method=cfg.method, targets=final_targets,
                               metadata={"tokens_trained": tokens_trained, "steps": total_steps,
                                         "seq_len": cfg.seq_len, "base_model": cfg.model, "data": cfg.data,
                                         **method.export_metadata(cfg)})
        sparse = evaluator.both(raw)
        for split in ("heldout", "wikitext2"):
            results["perplexity"][split]["sparse"] = sparse[split]
        results.update(
            method=cfg.method, model=cfg.model, data=cfg.data, pattern=f"{cfg.n}:{cfg.m}", steps=total_steps,
            tokens_trained=tokens_trained, seq_len=cfg.seq_len, eval_seq_len=evaluator.eval_len,
            heldout_sequences=int(evaluator.val.shape[0]), wikitext_windows=cfg.wikitext_windows or "all",
            wikitext_file=str(getattr(evaluator, "wiki_path", "")) or None,
            wall_time_s=round(time.perf_counter() - t_start, 1), output_dir=str(out),
        )
        _write_json(out / "results.json", results)
        tb.close()
        say(summary_table(results))
        say(f"sparse model written to {out} (plain transformers loads it: "
            f"AutoModelForCausalLM.from_pretrained('{out}'))")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return results


def _finish_fsdp(cfg: TrainConfig, model, optimizer, is_main: bool, device):
    """Gather the sharded student and its final masks on rank 0 into a plain model; prune and fold it there.

    Collective (every rank gathers); returns the plain, pruned, folded model on rank 0 and None elsewhere.
    Equal to ``CastMethod.finalize`` (``optimizer.prune_()`` then ``fold_scaling_``): the fold writes
    ``Diag(A)(W ⊙ M)`` with the same masks.
    """
    from cast_llm.nn import fold_scaling_
    from cast_llm.targets import find_targets
    from cast_llm.train import fsdp as fsdp2

    names = {id(t.weight): t.fqn for t in find_targets(model, n=cfg.n, m=cfg.m,
                                                      skip_incompatible=cfg.skip_incompatible)}
    masks = fsdp2.gather_masks(optimizer, names, is_main)
    full = fsdp2.full_model_state(model)
    if not is_main:
        return None
    plain = fsdp2.build_plain_student(cfg)
    plain.load_state_dict(full)
    del full
    fold_scaling_(plain, {f"{fqn}.weight": mask for fqn, mask in masks.items()})
    return plain.to(device)


def _keep_output_dtype(module) -> None:
    """Undo accelerate's mixed-precision forward wrapper (autocast + cast of every output to fp32).

    For a causal LM that cast is a second, twice as large copy of the full-vocabulary logits, for the
    student and for the teacher. The loop already runs forward, loss and backward under
    ``accelerator.autocast()`` and the losses compute in fp32 chunk by chunk, so the logits can stay in the
    autocast dtype: numerically identical (bf16 -> fp32 is exact, and the gradient went back to bf16 anyway).
    """
    if module is not None and "_original_forward" in module.__dict__:
        module.forward = module.__dict__.pop("_original_forward")


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fmt(d: dict[str, float | None]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in d.items() if v is not None)


def _log_record(step, window, tokens_per_step, scheduler, accelerator) -> dict[str, Any]:
    n = max(window["n"], 1)
    dt = time.perf_counter() - window["t0"]
    vals = torch.tensor([window["loss"] / n, window["ce"] / n, window["kd"] / n], device=accelerator.device)
    vals = accelerator.reduce(vals, reduction="mean") if accelerator.num_processes > 1 else vals
    return {
        "step": step,
        "tokens": step * tokens_per_step,
        "loss": float(vals[0]),
        "ce": float(vals[1]),
        "kd": float(vals[2]),
        "lr": scheduler.get_last_lr()[0],
        "tokens_per_s": window["tokens"] / dt if dt > 0 else math.nan,
    }


def _truncate_jsonl(path: Path, step: int) -> None:
    """Drop records written after ``step`` (a resumed run rewrites them identically)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def summary_table(results: dict[str, Any]) -> str:
    ppl = results["perplexity"]
    rows = [("dense", "dense"), ("magnitude", f"one-shot magnitude {results.get('pattern', '')}"),
            ("sparse", f"{results.get('method', '')} {results.get('pattern', '')}")]
    wl = results.get("eval_seq_len")
    head = f"{'model':<28} {'held-out ppl':>14} {'WikiText-2 ppl':>16}"
    lines = [head, "-" * len(head)]
    for key, label in rows:
        h, w = ppl["heldout"].get(key), ppl["wikitext2"].get(key)
        if h is None and w is None:
            continue
        lines.append(f"{label:<28} {_num(h):>14} {_num(w):>16}")
    lines.append(f"(held-out: {results.get('heldout_sequences')} sequences of {results.get('seq_len')}; "
                 f"WikiText-2: window {wl}, {results.get('wikitext_windows')} windows; "
                 f"{results.get('tokens_trained'):,} training tokens, {results.get('wall_time_s')} s)")
    decay = results.get("decay", {})
    start, pruned = decay.get("forecast_at_start"), decay.get("final_prune")
    if pruned:
        lines.append(f"final prune ({pruned['how']}, at step {pruned['step']}): sparse-weight ratio S_t "
                     f"{pruned['sparse_weight_ratio']:.3f}, so it removed {pruned['removed_fraction']:.1%} of the "
                     "target weights' L1 mass" + (f" (forecast at the start: S_T {start['sparse_weight_ratio']:.3f})"
                                                  if start else ""))
    return "\n".join(lines)


def _num(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"
