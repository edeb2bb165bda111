"""CAST (method.md §5, Algorithm 2): dense forward with learnable weight scaling, AdamS on all parameters,
masks recomputed every ``mask_interval`` steps, KD from the frozen dense model (handled by the loop).

The ablations of method.md §6 are switches of this method:

* ``--no-kd``: no teacher;  ``--no-scaling``: no weight scaling;
* ``--fixed-mask``: AdamS keeps the initial mask (``mask_interval = 0``);
* ``--mask-learner srste``: SR-STE (sparse STE forward + SR-STE decay, AdamW) learns the masks instead of
  AdamS — exactly SR-STE with CAST's KD and scaling defaults, so :func:`~cast_llm.train.methods.get_method`
  returns :class:`~cast_llm.train.methods.srste.CastSRSTEMethod` for it, not this class;
* ``--init-mask wanda|sparsegpt``: AdamS starts from that one-shot mask instead of Eq. 6's.

Beyond the paper, for budgets too short for the decay to finish (docs/training.md; off with
``--paper-exact``):

* ``--warm-start``: start from the ``--init-mask`` one-shot *model* (pruned weights exactly 0, SparseGPT's
  reconstructed kept weights), not only its mask. AdamS never has to decay large weights. The forward stays
  dense, so a pruned weight the gradient wants back could regrow and flip the mask while α_t is small — but
  it moves ~lr per step, and at short budgets the mask stays the one-shot one (measured: method.md §10).
* ``--warm-start-mix f``: begin from ``(1-f)·one-shot + f·dense`` (pruned entries at f of their dense value).
* ``--regrow-factor k --regrow-fraction p``: the pruned entries' updates × k during the first p of the steps.
* ``--repair-fraction f``: for the last ``f`` of the steps the masks are frozen, the model is pruned (as
  ``--final-prune`` says) and trained as the sparse model it will be exported as: pruned entries are reset
  to exactly 0 after every step, so the dense forward is the sparse forward.
* ``--final-prune compensated``: the prune keeps the learned masks but moves the kept weights with
  SparseGPT's OBS update on calibration data (:func:`cast_llm.prune.compensate.compensated_prune_`),
  instead of Algorithm 1's plain ``W ← W ⊙ M``.
"""

from __future__ import annotations

import math

import torch

from cast_llm import dtensor
from cast_llm.data import calibration_samples
from cast_llm.errors import CastError
from cast_llm.nn import fold_scaling_, wrap_scaling_
from cast_llm.optim import AdamS
from cast_llm.optim.forecast import forecast_decay
from cast_llm.optim.schedule import TRAIN_WARMUP, schedule_lrs
from cast_llm.prune.compensate import compensated_prune_
from cast_llm.sparsity.stats import l1_mass
from cast_llm.targets import find_targets, param_groups
from cast_llm.train.methods.base import TrainingMethod
from cast_llm.train.methods.masks import initial_masks

MAX_FORECASTS = 20  # decay forecasts logged per run at most (see forecast_due)


def forecast_due(done: int, total_steps: int, log_every: int, most: int = MAX_FORECASTS) -> bool:
    """Whether the log step after ``done`` optimizer steps records a decay forecast: every log step of a run
    with at most ``most`` of them, else every k-th one (k = ⌈log steps / most⌉). A forecast costs about a
    second (a float64 simulation on the host; on a GPU also a few host syncs per layer), which on every
    10th step of a GPU run would add a third to the training time; ``most`` of them cost seconds per run.
    A function of the step alone, so a resumed run logs the same records."""
    log_every = max(1, int(log_every))
    every = max(1, math.ceil((total_steps // log_every) / most)) * log_every
    return done % every == 0


def _target_weights(model, cfg, *, clone: bool = False) -> dict[str, torch.Tensor]:
    """``{fqn: weight}`` of every N:M target (detached copies with ``clone=True``)."""
    targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
    return {t.fqn: (t.weight.detach().clone() if clone else t.weight) for t in targets}


def optimizer_step_count(optimizer) -> int:
    """Steps an optimizer has taken (the largest per-parameter ``step`` in its state)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(steps)) if steps else 0


class CastMethod(TrainingMethod):
    name = "cast"

    def __init__(self):
        self._init_masks = None  # a one-shot mask for AdamS to start from (--init-mask wanda|sparsegpt)
        self._start = "compute"  # who computes the one-shot start (prepare_model's ``start``)
        self._calib = None  # calibration sequences of the compensated prune
        self.repair_start = None  # optimizer steps done when the masked repair begins (None: no repair)
        self.prune_report: dict | None = None  # what the final prune removed (recorded in results.json)
        self.start_forecast: dict | None = None  # the decay forecast made before the first update
        self.regrow_steps = 0  # steps whose pruned-entry updates are scaled (--regrow-factor)
        self._before_step = None  # the sparse weights before the optimizer step (regrow phase only)
        # ``probe(model, label) -> float | None``: the job's validation perplexity of the model as it stands,
        # measured just before and just after the final prune (None: not measured; the job sets it)
        self.prune_probe = None

    def prepare_model(self, model, cfg, *, data=None, device=None, start="compute"):
        self.cfg, self._device = cfg, device
        self._start = start
        # the one-shot start is computed once (rank 0 under several processes; never again on a resume:
        # the checkpoint holds the weights and the masks it led to)
        if start in ("compute", "send") and (cfg.use_warm_start or cfg.effective_init_mask != "magnitude"):
            mix = cfg.effective_warm_start_mix if cfg.use_warm_start else 0.0
            dense = _target_weights(model, cfg, clone=True) if mix > 0 else None
            # Eq. 6 is what AdamS computes by itself at its first step; a warm start prunes the model too
            self._init_masks = initial_masks(model, cfg, data=data, device=device, apply=cfg.use_warm_start)
            if dense is not None:  # θ_0 = (1-f)·one-shot + f·dense: pruned entries start at f of their dense value
                with torch.no_grad():
                    for fqn, w in _target_weights(model, cfg).items():
                        w.mul_(1 - mix).add_(dense[fqn], alpha=mix)
                del dense
        if cfg.effective_final_prune == "compensated":
            if data is None:
                raise CastError("--final-prune compensated needs calibration data; pass the run's data")
            self._calib = calibration_samples(data, min(cfg.calib_samples, data.train.shape[0]), seed=cfg.seed)
        if cfg.use_scaling:
            targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
            fqns = {t.fqn for t in targets}
            wrap_scaling_(model, filter_fn=lambda mod, fqn: fqn in fqns, n_groups=cfg.scale_groups, m=cfg.m)

    def build_optimizer(self, model, cfg, total_steps: int):
        targets = find_targets(model, n=cfg.n, m=cfg.m, skip_incompatible=cfg.skip_incompatible)
        # λ once, AdamS's default, which the sparse groups take (the weight decay is per group: none on scales)
        groups = param_groups(model, targets=targets, weight_decay=cfg.weight_decay)
        self._names = {id(t.weight): t.fqn for t in targets}
        opt = AdamS(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            l1_decay=cfg.l1_decay,
            total_steps=total_steps,
            mask_interval=cfg.effective_mask_interval,
            n=cfg.n,
            m=cfg.m,
            weight_decay=cfg.weight_decay,
            mask_storage="packed" if cfg.packed_masks else "bool",
            decay_mode=cfg.decay_mode,
            update=cfg.sparse_update,
        )
        shared = self._start in ("send", "receive") and self.uses_one_shot_start
        if self._init_masks is not None or shared:
            for t in targets:  # AdamS keeps its own copy (its rows, under FSDP2): ours go one by one
                mask = self._init_masks.pop(t.fqn) if self._init_masks is not None else None
                opt.set_mask(t.weight, self._broadcast_mask(mask, t.weight) if shared else mask)
                del mask
        self._init_masks = None  # the start masks live on in AdamS alone
        self.total_steps = total_steps
        self._lrs = schedule_lrs(cfg, total_steps, cfg.lr, default_warmup=TRAIN_WARMUP)
        self.regrow_steps = round(cfg.regrow_steps_fraction * total_steps)
        self._before_step = None  # the sparse weights before the optimizer step (regrow phase only)
        fraction = cfg.effective_repair_fraction
        repair_steps = round(fraction * total_steps)
        self.repair_start = total_steps - repair_steps if repair_steps > 0 else None
        return opt

    @property
    def uses_one_shot_start(self) -> bool:
        return self.cfg.use_warm_start or self.cfg.effective_init_mask != "magnitude"

    @torch.no_grad()
    def _broadcast_mask(self, mask, weight) -> torch.Tensor:
        """Rank 0's one-shot mask of ``weight`` (None elsewhere) on every rank, whole (as bytes: gloo has no
        bool broadcast); under FSDP2 AdamS keeps only this rank's rows of it."""
        import torch.distributed as dist

        device = self._device  # the training device: the one the process group communicates on
        m8 = (mask.to(device, torch.uint8) if dist.get_rank() == 0
              else torch.empty(tuple(weight.shape), dtype=torch.uint8, device=device))
        dist.broadcast(m8, src=0)
        return m8.bool()

    def in_repair(self, step: int) -> bool:
        """Whether optimizer step ``step + 1`` belongs to the masked repair (``step`` = steps done)."""
        return self.repair_start is not None and step >= self.repair_start

    def begin_step(self, model, optimizer, step: int) -> None:
        if self.in_repair(step):
            for group in optimizer.param_groups:  # masks frozen from here on (a deterministic function of
                if group.get("sparse"):  # the step, so a resumed run freezes them again)
                    group["mask_interval"] = 0
            if step == self.repair_start:
                self.prune(model, optimizer, step=step)

    def in_regrow(self, step: int) -> bool:
        """Whether optimizer step ``step + 1`` scales the pruned entries' updates (``--regrow-factor``)."""
        return step < self.regrow_steps and not self.in_repair(step)

    def end_step(self, model, optimizer, step: int) -> None:
        if self._before_step is not None:
            # θ ← θ_before + k·(θ − θ_before) on the entries the step's mask prunes: their update scaled by k
            factor = self.cfg.regrow_factor
            with torch.no_grad():
                for p, mask in optimizer.masks().items():
                    local = dtensor.local(p)
                    before = self._before_step[p]
                    delta = (local - before).mul_(factor - 1).masked_fill_(mask, 0.0)
                    local.add_(delta)
            self._before_step = None
        if self.in_repair(step):
            optimizer.prune_()  # the pruned entries stay exactly 0: the dense forward is the sparse one

    @torch.no_grad()
    def prune(self, model, optimizer, *, step: int) -> None:
        """The final prune with the current masks: hard (``θ ← θ ⊙ m``) or compensated (OBS update of the
        kept weights on calibration data); records the L1 mass it removed in ``prune_report``."""
        masks = optimizer.masks()
        # L1 mass kept and in all, over this rank's rows (FSDP2: masks are local) and then over the ranks
        sums = torch.tensor(l1_mass([dtensor.local(w) for w in masks],
                                    list(masks.values())), dtype=torch.float64)
        if any(dtensor.is_dtensor(w) for w in masks) and torch.distributed.is_initialized():
            device = next(iter(masks)).device
            sums = sums.to(device)
            torch.distributed.all_reduce(sums)
            sums = sums.cpu()
        kept, total = sums.tolist()
        ratio = kept / total if total > 0 else 1.0
        removed = total - kept
        how = self.cfg.effective_final_prune
        # the dense-forward model the run trained, on the validation split, then the pruned one: how much of
        # the run's result the final cut costs (one validation pass each; the job's probe, None without one)
        before = self._probe(model, "the dense-forward model, just before the final prune")
        if how == "compensated":
            by_fqn = {self._names[id(p)]: mk for p, mk in masks.items()}
            compensated_prune_(model, by_fqn, self._calib, n=self.cfg.n, m=self.cfg.m, device=self._device,
                               progress=self.cfg.progress)
        optimizer.prune_()  # θ_T ← θ_T ⊙ m_T (Algorithm 1, last line); exact zeros after a compensated prune too
        after = self._probe(model, "the pruned model, just after the final prune")
        self.prune_report = {"step": step, "how": how, "sparse_weight_ratio": ratio,
                             "removed_l1": removed, "removed_fraction": 1.0 - ratio,
                             "validation_ppl_before": before, "validation_ppl_after": after}

    def _probe(self, model, label: str) -> float | None:
        if self.prune_probe is None:
            return None
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                return self.prune_probe(model, label)
        finally:
            model.train(was)

    def current_masks(self, model, optimizer) -> dict[str, torch.Tensor]:
        return {self._names[id(p)]: mask for p, mask in optimizer.masks().items()}

    # ---- will the decay finish? (optim/forecast.py; before the first update and on log steps)
    def _forecast(self, optimizer, suggest: bool):
        return forecast_decay(optimizer, self._lrs, target=self.cfg.forecast_target, suggest=suggest)

    def before_update(self, model, optimizer, step: int, ctx) -> None:
        if self.in_regrow(step):  # the weights the step starts from (the step's mask is known only after it)
            self._before_step = {p: dtensor.local(p).detach().clone()
                                 for p in optimizer.masks()}
        if step != 0 or self.cfg.fsdp:
            return
        if not self.forecasts:
            ctx.say("decay forecast: not made (it models Eq. 7's proportional decay; this run "
                    + ("decays additively)" if self.cfg.decay_mode != "proportional" else
                       "takes Adam's update, with no decay)"))
            return
        fc = self._forecast(optimizer, suggest=True)  # the first gradient is known: its noise sets σ
        self.start_forecast = fc.as_dict()
        ctx.say(fc.message(lr=self.cfg.lr, l1_decay=self.cfg.l1_decay))

    @property
    def forecasts(self) -> bool:
        """Whether the decay forecast describes this run (it models AdamS's proportional decay only)."""
        return self.cfg.decay_mode == "proportional" and self.cfg.sparse_update == "adams"

    def log_metrics(self, model, optimizer, step: int) -> dict:
        if self.cfg.fsdp or not self.forecasts or self.in_repair(step) or step + 1 >= self.total_steps:
            return {}
        if not forecast_due(step + 1, self.total_steps, self.cfg.log_every):
            return {}
        return {"forecast_sparse_weight_ratio": self._forecast(optimizer, suggest=False).sparse_weight_ratio}

    def extra_state(self):
        return {"prune_report": self.prune_report, "start_forecast": self.start_forecast}

    def load_extra_state(self, state) -> None:
        if state:
            self.prune_report, self.start_forecast = state.get("prune_report"), state.get("start_forecast")

    def results(self) -> dict:
        decay = {}
        if self.start_forecast is not None:
            decay["forecast_at_start"] = self.start_forecast
        if self.prune_report is not None:
            decay["final_prune"] = self.prune_report
        return {"decay": decay} if decay else {}

    def finalize(self, model, optimizer, *, out=None, is_main=True):
        if self.repair_start is None:  # (with a masked repair the prune happened when it began)
            self.prune(model, optimizer, step=optimizer_step_count(optimizer))
        optimizer.prune_()
        fold_scaling_(model)  # W ← Diag(A)(W ⊙ M): plain nn.Linear again, zero inference overhead
        return model

    def finalize_gathered(self, model, masks):
        # the gathered masks are those AdamS held at the end; the fold writes Diag(A)(W ⊙ M) with them
        fold_scaling_(model, {f"{fqn}.weight": mask for fqn, mask in masks.items()})
        return model

    def export_metadata(self, cfg):
        meta = super().export_metadata(cfg)
        meta["training"].update(cast_switches(cfg))
        return meta


def cast_switches(cfg) -> dict:
    """CAST's switches for the exported checkpoint's ``sparsity.training`` metadata (any mask learner)."""
    return dict(mask_learner=cfg.mask_learner, warm_start=cfg.use_warm_start,
                repair_fraction=cfg.effective_repair_fraction, final_prune=cfg.effective_final_prune,
                paper_exact=cfg.paper_exact,
                warm_start_mix=cfg.effective_warm_start_mix if cfg.use_warm_start else None,
                regrow_factor=cfg.regrow_factor if cfg.regrow_steps_fraction else None,
                regrow_fraction=cfg.regrow_steps_fraction or None)
