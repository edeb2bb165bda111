"""Checked kernel paths: every custom kernel proves itself against its reference before a run relies on it.

* :mod:`.registry` — kernel path → candidates → probe → verdict;
* :mod:`.switch` — ``auto`` / ``reference`` (``--kernels``, ``CAST_LLM_KERNELS``), ``CAST_LLM_COMPILE``, and where
  each kind of candidate can run;
* :mod:`.verdicts` — the verdicts kept between runs, per GPU, driver and library versions;
* :mod:`.environment` — what ``cast-llm doctor`` reports about the machine;
* :mod:`.discovery` — every module that declares a path, found in the package's source (``cast-llm doctor``
  imports them all with :func:`load_all`: no hand list).

The paths themselves are declared and registered beside their kernels: :mod:`cast_llm.optim.functional`
(``adams.update``, ``adams.masks``), :mod:`cast_llm.distill.loss` (``kd.loss``; its candidates in
:mod:`cast_llm.distill.paths`), :mod:`cast_llm.nn.scaled_weight` (``scaled_weight.layer``),
:mod:`cast_llm.nn.scaled_group` (``scaled_weight.block``), :mod:`cast_llm.distill.teacher`
(``teacher.cuda_graph``), :mod:`cast_llm.deploy.sparse24.kernels` (``sparse24.gemm``, ``sparse24.cpu_gemm.*``)
and :mod:`cast_llm.deploy.sparse24.decode` (``sparse24.decode_graph``).
"""

from cast_llm.kernels.discovery import load_all
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
           "apply_flag", "choose", "compile_enabled", "examine", "implementation", "load_all", "mode", "record", "register", "reset", "reset_mode", "restricted",
           "seconds_per_call", "set_mode", "taken", "why_not"]
