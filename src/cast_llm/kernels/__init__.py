"""Checked kernel paths: every custom kernel proves itself against its reference before a run relies on it.

* :mod:`.registry` — kernel path → candidates → probe → verdict;
* :mod:`.switch` — ``auto`` / ``reference`` (``--kernels``, ``CAST_LLM_KERNELS``), ``CAST_LLM_COMPILE``, and where
  each kind of candidate can run;
* :mod:`.verdicts` — the verdicts kept between runs, per GPU, driver and library versions;
* :mod:`.environment` — what ``cast-llm doctor`` reports about the machine.

The paths themselves are declared beside their kernels: ``cast_llm.optim.checked_paths`` (AdamS update and
mask refresh), ``cast_llm.distill.paths`` (the KD loss), ``cast_llm.nn.checked_paths`` (the scaled-weight
backward, per layer and per block), ``cast_llm.distill.teacher`` (the teacher's CUDA graph),
``cast_llm.deploy.sparse24.checked`` (the 2:4 GEMMs and the decoder's CUDA graph).
"""

from cast_llm.kernels.registry import (
    COMPILE_ENV,
    MODE_ENV,
    MODES,
    REFERENCE,
    REGISTRY,
    Candidate,
    Check,
    CheckedPath,
    apply_flag,
    choose,
    compile_enabled,
    examine,
    implementation,
    mode,
    record,
    register,
    reset,
    reset_mode,
    restricted,
    seconds_per_call,
    set_mode,
    taken,
    why_not,
)

__all__ = ["COMPILE_ENV", "MODE_ENV", "MODES", "REFERENCE", "REGISTRY", "Candidate", "Check", "CheckedPath",
           "apply_flag", "choose", "compile_enabled", "examine", "implementation", "mode", "record", "register", "reset", "reset_mode", "restricted",
           "seconds_per_call", "set_mode", "taken", "why_not"]
