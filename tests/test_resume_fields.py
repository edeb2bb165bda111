"""What a resume must match is marked on the config fields (option(resume=...)), and the checkpoint's
fingerprint is derived from those marks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cast_llm.config import FORMER_NAMES, option, resume_keys, undecided_resume_fields
from cast_llm.errors import CastError
from cast_llm.finetune.config import FinetuneConfig
from cast_llm.train.checkpoint import fingerprint, load_checkpoint, save_checkpoint
from cast_llm.train.config import TrainConfig

# the hand list train/checkpoint.py held before the marks (FINGERPRINT_KEYS, 46 names)
OLD_TRAIN_KEYS = {
    "model", "data", "method", "max_steps", "tokens", "batch_size", "grad_accum", "seq_len", "lr", "l1_decay",
    "beta1", "beta2", "eps", "weight_decay", "warmup_steps", "lr_schedule", "min_lr_ratio", "mask_interval", "n",
    "m", "scaling", "scale_groups", "kd", "eta", "temperature", "seed", "val_fraction", "test_fraction",
    "max_documents", "fixed_mask", "init_mask", "mask_file", "calib_samples", "mask_learner", "srste_decay",
    "maskllm_tau", "maskllm_kappa", "maskllm_prior", "maskllm_lr", "paper_exact", "warm_start", "repair_fraction",
    "final_prune", "warm_start_mix", "regrow_factor", "regrow_fraction",
}


@pytest.mark.parametrize("cls", [TrainConfig, FinetuneConfig])
def test_every_setting_of_a_resumable_run_says_whether_a_resume_must_match_it(cls):
    """A field added to a job's config without option(resume="must_match") or option(resume="free") fails here."""
    assert undecided_resume_fields(cls) == []


def test_a_field_without_a_decision_is_found_and_a_wrong_rule_refused():
    @dataclasses.dataclass
    class Job:
        lr: float = option(1e-3, "lr", resume="must_match")
        log_every: int = option(10, "log", resume="free")
        new_knob: int = option(0, "forgot to decide")

    assert undecided_resume_fields(Job) == ["new_knob"]
    assert resume_keys(Job) == ("lr",)
    with pytest.raises(ValueError, match="must_match"):
        option(0, "typo", resume="must-match")


def test_the_marks_keep_the_old_hand_list_and_add_what_it_forgot():
    """The train fingerprint is the 46 names it had, plus grad_clip, decay_mode and sparse_update (each changes the training:
    a resume with another value would silently be another run); finetune's 25 are unchanged."""
    keys = {FORMER_NAMES.get(k, k) for k in resume_keys(TrainConfig)}  # (--temperature is now --kd-temperature)
    assert keys - OLD_TRAIN_KEYS == {"grad_clip", "decay_mode", "sparse_update"} and OLD_TRAIN_KEYS <= keys
    assert set(resume_keys(FinetuneConfig)) == {
        "model", "mode", "task", "data", "eval_data", "eval_fraction", "max_examples", "max_steps", "batch_size",
        "grad_accum", "seq_len", "lr", "weight_decay", "warmup_steps", "lr_schedule", "min_lr_ratio", "grad_clip",
        "n", "m", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_masked_forward", "seed"}
    cfg = TrainConfig(output_dir="x", max_steps=3, lr=1e-3)
    fp = fingerprint(cfg)
    assert list(fp) == list(resume_keys(TrainConfig)) and fp["lr"] == 1e-3 and fp["max_steps"] == 3


def test_resume_compares_what_the_checkpoint_recorded(tmp_path):
    """A changed must-match setting is refused, naming it; one the checkpoint does not record (written before
    the setting was marked) is not compared, as the version that wrote it did not."""
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=3)
    recorded = {k: v for k, v in fingerprint(cfg).items() if k != "decay_mode"}  # an older checkpoint's
    ck = save_checkpoint(tmp_path, 1, {"model": {"w": torch.zeros(2)}}, {"fingerprint": recorded})
    load_checkpoint(ck, fingerprint(dataclasses.replace(cfg, decay_mode="additive")))
    with pytest.raises(CastError, match="grad_clip: checkpoint 1.0 vs now 0.5"):
        load_checkpoint(ck, fingerprint(dataclasses.replace(cfg, grad_clip=0.5)))
    load_checkpoint(ck, fingerprint(dataclasses.replace(cfg, log_every=1, eval_every=2)))  # free settings
    # a setting renamed since: the checkpoint's fingerprint under its former name is still compared
    old = {FORMER_NAMES.get(k, k): v for k, v in fingerprint(cfg).items()}
    assert "temperature" in old and "kd_temperature" not in old
    ck = save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(2)}}, {"fingerprint": old})
    load_checkpoint(ck, fingerprint(cfg))
    with pytest.raises(CastError, match="kd_temperature: checkpoint 1.0 vs now 2.0"):
        load_checkpoint(ck, fingerprint(dataclasses.replace(cfg, kd_temperature=2.0)))
