"""``cast-llm train``: CAST (and baseline) training on any Hugging Face causal LM."""

from __future__ import annotations

import argparse

from cast_llm.cli.options import add_config_command, resolve_options


def build_config(args: argparse.Namespace):
    """defaults < (with --resume: the run's config.yaml) < --preset < --config YAML < flags typed; a budget
    typed on the command line replaces the preset's / file's budget of the other kind."""
    from cast_llm.config import cli_layer, load_yaml
    from cast_llm.train.config import PRESETS, TrainConfig

    cfg = resolve_options(TrainConfig, args, presets=PRESETS, run_folder=True, one_of=("tokens", "max_steps"))
    given = set(cli_layer(args, TrainConfig))
    if getattr(args, "config", None):
        given |= {k.replace("-", "_") for k in load_yaml(args.config)}
    refuse_replaced_grad_accum(cfg, given, getattr(args, "preset", None))
    return cfg


def refuse_replaced_grad_accum(cfg, given: set[str], preset: str | None) -> None:
    """A --grad-accum the user gave (typed or in a --config file) is never silently replaced by the accumulation
    a --global-batch derives at launch (the launch treats 1 as "derive it": the default cannot tell them apart)."""
    import os

    from cast_llm.errors import CastError
    from cast_llm.plan.batch import split_global_batch

    if "grad_accum" not in given or not cfg.global_batch:
        return
    source = "" if "global_batch" in given or not preset else f" (from --preset {preset})"
    if cfg.batch_size == 0:
        raise CastError(f"--grad-accum {cfg.grad_accum} with --global-batch {cfg.global_batch}{source} and --batch-size "
                        "0: the accumulation follows from the largest micro-batch that fits; give --batch-size N "
                        "instead, or leave --grad-accum out")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # the launch's own split (grad_accum 1: "derive it", so that it never refuses the contradiction itself)
        _, need = split_global_batch(cfg.global_batch, world, batch_size=cfg.batch_size, grad_accum=1, fits=None)
    except CastError:
        return  # a split that does not divide: the launch refuses it, naming the split
    if need != cfg.grad_accum:
        raise CastError(f"--grad-accum {cfg.grad_accum} contradicts --global-batch {cfg.global_batch}{source} with "
                        f"--batch-size {cfg.batch_size} on {world} process(es), which needs --grad-accum {need}; "
                        "give one of them")


def run(args: argparse.Namespace) -> int:
    from cast_llm.cli.prepare_data import refuse_cache_in_inputs
    from cast_llm.train.rundir import say_if_finished, write_results
    from cast_llm.train.summary import summary_table
    from cast_llm.train.trainer import train

    if say_if_finished(args):  # --resume on a finished run: nothing to do, nothing touched
        return 0
    cfg = build_config(args)
    refuse_cache_in_inputs(cfg.data_cache, {"--data": cfg.data, "--model": cfg.model})
    results = train(cfg)
    if results.get("output_dir"):  # the main process, once the run is complete
        if cfg.speed_check and measure_speed(results):
            write_results(results["output_dir"], results)
        if cfg.report:
            results["report"] = write_report(results["output_dir"])
            write_results(results["output_dir"], results)
        print(summary_table(results))
    return 0


def measure_speed(results: dict) -> bool:
    """The exported 2:4 model's decode speed and resident memory against dense, on this CPU, into ``results``
    (``decode_payoff``, and ``speeds`` for the model card); False (with one line) where it cannot be measured."""
    nm = results.get("nm_check") or {}
    if nm.get("pattern") != "2:4":
        return False
    from cast_llm.deploy.model_card import refresh_run_card
    from cast_llm.errors import CastError
    from cast_llm.inference import payoff

    print("measuring the exported model's decode speed, dense and 2:4 (two fresh processes) ...", flush=True)
    try:
        p = payoff(results["output_dir"])
    except CastError as e:
        print(f"warning: {e}; the run itself is complete")
        return False
    results["decode_payoff"] = p
    s24 = p["sparse24"]
    where = f"this CPU, bf16, {s24['threads']} threads, {s24['new_tokens']} new tokens after {s24['prompt_tokens']}"
    results["speeds"] = [
        {"what": "decode, 2:4 layers", "value": round(p["sparse24"]["decode_tokens_per_s"], 1), "unit": "tokens/s",
         "measured_on": where},
        {"what": "decode, dense", "value": round(p["dense"]["decode_tokens_per_s"], 1), "unit": "tokens/s",
         "measured_on": where},
    ]
    refresh_run_card(results["output_dir"], results)
    return True


def write_report(out: str) -> str | None:
    """The run's HTML report (plots of loss, S_t, flip rates, perplexities); its path, or None if it failed."""
    try:
        from cast_llm.report import build_report

        return str(build_report([out], None, html=True).html)
    except Exception as e:  # a report is a convenience: never lose a finished run over it
        print(f"warning: the HTML report could not be written ({type(e).__name__}: {e}); "
              f"`cast-llm report {out} --html` tries again")
        return None


def register(sub) -> None:
    from cast_llm.train.config import PRESETS, SECTIONS, TrainConfig

    add_config_command(
        sub, "train", TrainConfig, func=run, presets=PRESETS, config_file=True, sections=SECTIONS,
        preset_help="named hyperparameters: the paper's for each model family, or sized for a CPU",
        help="sparsity-aware training to an N:M model (CAST)",
        description="Train a dense causal LM into an N:M (default 2:4) sparse model with CAST: AdamS, "
        "learnable weight scaling and distillation from the dense model. Multi-GPU: "
        "`accelerate launch [--multi_gpu] -m cast_llm.cli train ...` or `accelerate launch $(which cast-llm) train ...`.",
    )
