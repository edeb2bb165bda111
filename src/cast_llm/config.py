"""Config as data: dataclasses are the single source of truth for CLI flags and YAML files.

Every field carries its help text in ``metadata["help"]``. :func:`add_arguments` generates ``--kebab-case``
flags from a dataclass; :func:`resolve` merges, in increasing precedence, the dataclass defaults, a preset,
a YAML file and the flags the user actually typed. Unknown keys and values of the wrong type are errors that
name the key and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from cast_llm.errors import CastError
from cast_llm.io import RunDir, atomic_write_text

# what a resumed run may do with a setting (option(resume=...)): "must_match" — the checkpoint's value, or the resume
# is refused (it would be another run); "free" — change it (logging, evaluation, where files go, how memory is spent)
RESUME_RULES = ("must_match", "free")
# options renamed (new field name -> the name it had): a config file or a checkpoint written before is told or read
FORMER_NAMES = {"kd_temperature": "temperature", "eval_fraction": "val_fraction",
                "exact_match_max_tokens": "max_new_tokens", "budgets": "tokens"}


def renamed_option(name: str) -> str | None:
    """The field name an option formerly called ``name`` has now (:data:`FORMER_NAMES`), else None."""
    return next((new for new, old in FORMER_NAMES.items() if old == name), None)


def option(default: Any, help: str, *, choices: tuple | None = None, parse=None, flag: str | None = None,
           min: float | None = None, max: float | None = None, min_exclusive: bool = False,
           section: str | None = None, nargs: str | None = None, const: Any = None, resume: str | None = None):
    """A dataclass field with its help text and how the CLI and the checks treat it.

    ``choices``: allowed values (listed in ``--help``); ``parse``: a value parser; ``flag``: the flag name;
    ``min`` / ``max``: the allowed range (``min_exclusive``: strictly above ``min``), checked for every
    source by :func:`check_ranges`; ``section``: the ``--help`` group; ``nargs`` / ``const``: as argparse's
    (a flag whose value is optional); ``resume``: one of :data:`RESUME_RULES` for the settings of a job that
    resumes from checkpoints (:func:`cast_llm.train.checkpoint.resume_keys`).
    """
    if resume is not None and resume not in RESUME_RULES:
        raise ValueError(f"option(resume=...) must be one of {RESUME_RULES}, got {resume!r}")
    md = {"help": help, "choices": choices, "parse": parse, "flag": flag, "min": min, "max": max,
          "min_exclusive": min_exclusive, "section": section, "nargs": nargs, "const": const, "resume": resume}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=md)
    return dataclasses.field(default=default, metadata=md)


# --dtype as every command spells it (fp32 / bf16 / fp16, each command with its own choices and default); torch's
# names are taken as the same (parse=dtype_name): `eval zeroshot --dtype bf16` and `export --dtype bfloat16` both work
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def dtype_name(value: Any) -> str:
    """A dtype as cast-llm's commands spell it (``bfloat16`` → ``bf16``); other text as given, for ``choices``."""
    text = str(value).strip().lower()
    return DTYPE_ALIASES.get(text, text)


def dtype_option(default: str, help: str, choices: tuple[str, ...], **kw):
    """A command's ``--dtype``: its own choices and default, in the one spelling (torch's names accepted)."""
    return option(default, help, choices=choices, parse=dtype_name, **kw)


# --kernels: cast_llm.kernels.MODES, kept here so that `cast-llm --help` imports no torch
KERNEL_MODES = ("auto", "reference")
KERNELS_HELP = ("auto: every custom kernel (Triton, torch.compile, cuSPARSELt, CUDA graphs) checks itself against "
                "its reference on first use and falls back to it (cast-llm doctor shows the verdicts); reference: "
                "torch operations only (the environment variable CAST_LLM_KERNELS does the same)")


# --activation-checkpointing: nothing recomputed, the cheap operators between the matmuls, or whole blocks
RECOMPUTE_MODES = ("none", "selective", "full")
# --fsdp-precision (bf16 runs under --fsdp): FSDP2's MixedPrecisionPolicy, or fp32 all-gathers under autocast
FSDP_PRECISIONS = ("auto", "policy", "autocast")


def recompute_mode(value) -> str:
    """``--activation-checkpointing`` as one of :data:`RECOMPUTE_MODES`; the old boolean spelling (the flag
    alone, YAML ``true`` / ``false``) means ``full`` / ``none``."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    text = str(value).strip().lower()
    if text in ("true", "yes", "on"):
        return "full"
    if text in ("false", "no", "off", ""):
        return "none"
    if text not in RECOMPUTE_MODES:
        raise ValueError(f"expected one of {', '.join(RECOMPUTE_MODES)} (the flag alone: full), got {value!r}")
    return text


def resume_keys(cls) -> tuple[str, ...]:
    """The settings of ``cls`` (a job's config dataclass) that a resume must match: its fields marked
    ``option(..., resume="must_match")``, in declaration order (the checkpoint's fingerprint)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("resume") == "must_match")


def undecided_resume_fields(cls) -> list[str]:
    """The fields of ``cls`` marked neither ``resume="must_match"`` nor ``resume="free"`` (a test keeps it empty
    for every config a run resumes with, so that a new setting is never left out of the fingerprint unseen)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("resume") not in RESUME_RULES]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def shown(cls, f: dataclasses.Field) -> tuple[str, str | None]:
    """The help text and ``--help`` section of field ``f`` as the command whose config is ``cls`` shows it.

    A setting is declared once, in an option group (its default, type, range, choices, resume rule); a command
    that takes the group may word its help for that command and place it in one of its ``--help`` sections,
    with the class attributes ``OPTION_TEXT = {name: help}`` and ``OPTION_SECTIONS = {name: section}`` (the
    nearest class on ``cls``'s MRO that names the field wins). Nothing but the words and the place changes.
    """
    text, section = f.metadata.get("help", ""), f.metadata.get("section")
    for k in reversed(cls.__mro__):  # the nearest class last, so that it wins
        text = vars(k).get("OPTION_TEXT", {}).get(f.name, text)
        section = vars(k).get("OPTION_SECTIONS", {}).get(f.name, section)
    return text, section


def check_ranges(cfg) -> None:
    """Raise a CastError naming the flag for every field whose value lies outside its ``min``/``max``."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or (lo is None and hi is None):
            continue
        strict = f.metadata.get("min_exclusive")
        if lo is not None and (v <= lo if strict else v < lo):
            raise CastError(f"{flag_name(f)} must be {'>' if strict else '≥'} {lo:g}, got {v:g}")
        if hi is not None and v > hi:
            raise CastError(f"{flag_name(f)} must be ≤ {hi:g}, got {v:g}")


def _default_text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


_SUFFIX = {"k": 1_000, "m": 1_000_000, "b": 1_000_000_000, "g": 1_000_000_000}


def parse_count(value: Any) -> int:
    """Parse a token count: ``20M``, ``1.5B``, ``500k``, ``12000`` (``_`` allowed)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a count, got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    s = str(value).strip().replace("_", "").lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmbg]?)", s)
    if not m:
        raise ValueError(f"expected a count such as 20M, 1.5B or 500k, got {value!r}")
    return int(float(m.group(1)) * _SUFFIX.get(m.group(2), 1))


_STEP = re.compile(r"\s*(\d+)\s*$")
_FRACTION = re.compile(r"\s*(\d*\.\d*)\s*$")


def parse_hist_steps(spec: str) -> str:
    """Validate a ``--ratio-hist-steps`` value and return it normalised (for the config's ``parse=``).

    Comma-separated items; an item with a decimal point is a fraction of the run in (0, 1] (``0.5``,
    ``1.0``), one without is an absolute step ≥ 1 (``500``). Empty = no histograms.
    """
    items = [s for s in str(spec).split(",") if s.strip()]
    out = []
    for item in items:
        if _STEP.match(item):
            v = int(item)
            if v < 1:
                raise ValueError(f"step {item.strip()!r} must be ≥ 1")
            out.append(str(v))
        elif _FRACTION.match(item) and item.strip() != ".":
            v = float(item)
            if not 0 < v <= 1:
                raise ValueError(f"fraction {item.strip()!r} must be in (0, 1] (write steps without a '.')")
            out.append(repr(v))
        else:
            raise ValueError(f"{item.strip()!r} is neither a step (500) nor a fraction of the run (0.5)")
    return ",".join(out)


def _base_type(tp):
    """``Optional[int]`` -> (int, True); ``int`` -> (int, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(cls, name: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the type of field ``name`` of ``cls``, or raise a CastError naming both."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    tp, optional = _base_type(_hints(cls)[name])
    key = name.replace("_", "-")
    try:
        if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
            if optional:
                return None
            raise ValueError("may not be empty")
        parse = f.metadata.get("parse")
        if parse is not None:
            out = parse(value)
        elif tp is bool:
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
                out = value.lower() in ("true", "yes", "1", "on")
            else:
                raise ValueError(f"expected true/false, got {value!r}")
        elif tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            out = int(value)
        elif tp is float:
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            out = float(value)
        elif tp is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(f"expected a string, got {value!r}")
            out = str(value)
        else:
            out = value
    except (ValueError, TypeError) as e:
        raise CastError(f"{source}: invalid value for '{key}': {e}") from None
    choices = f.metadata.get("choices")
    if choices and out not in choices:
        raise CastError(f"{source}: '{key}' must be one of {', '.join(map(str, choices))}, got {out!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = (),
                  sections: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per dataclass field, in ``--help`` groups that follow the fields' sections.

    Defaults are SUPPRESSed so that only typed flags override; the help shows the choices and the default
    once (a help text that already says what the default is, with "default", keeps its own words).
    ``sections``: the order of the groups (others follow in the order of their first field).
    """
    hints = _hints(cls)
    groups: dict[str | None, Any] = {name: parser.add_argument_group(name) for name in sections}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        text, section = shown(cls, f)
        if section not in groups:
            groups[section] = parser.add_argument_group(section) if section else parser
        target = groups[section]
        tp, _ = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        if choices:
            text += f" {{{', '.join(str(c) for c in choices)}}}"
        if "default" not in text.lower() and default is not None and not (tp is bool and default is False):
            text += f" (default: {_default_text(default)})"
        text = text.replace("%", "%%")  # argparse formats %
        if tp is bool and f.metadata.get("parse") is None:
            target.add_argument(flag_name(f), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        else:
            kw = {}
            if f.metadata.get("nargs"):
                kw.update(nargs=f.metadata["nargs"], const=f.metadata.get("const"))
            target.add_argument(flag_name(f), dest=f.name, default=argparse.SUPPRESS, metavar=f.name.upper(),
                                help=text, **kw)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise CastError(f"config file not found: {p} (pass an existing YAML file to --config)")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise CastError(f"config file {p} is not UTF-8 text (a YAML file of option: value is expected)") from None
    except yaml.YAMLError as e:
        raise CastError(f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CastError(f"config file {p} must hold a mapping of option: value, got {type(data).__name__}")
    return data


def resolve(cls, *layers: tuple[str, dict[str, Any]]):
    """Build ``cls`` from ``(source_name, mapping)`` layers, later layers overriding earlier ones.

    Keys may be written with ``-`` or ``_``. Unknown keys raise a CastError naming the key and the source.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for source, mapping in layers:
        for key, value in mapping.items():
            name = str(key).replace("-", "_")
            if name not in names:
                if (new := renamed_option(name)) in names:
                    raise CastError(f"{source}: option '{key}' is now '{new.replace('_', '-')}'")
                close = [n.replace("_", "-") for n in names if n.startswith(name[:3])]
                hint = f" (did you mean: {', '.join(sorted(close))}?)" if close else ""
                raise CastError(f"{source}: unknown option '{key}'{hint}")
            values[name] = coerce(cls, name, value, source)
    cfg = cls(**values)
    check_ranges(cfg)
    # a config class may define the hook validate() (the checks across fields); resolve takes any dataclass, and
    # the options of a command that has no such checks define none
    validate = getattr(cls, "validate", None)
    if validate is not None:
        validate(cfg)
    return cfg


def to_dict(cfg) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg, path: str | Path) -> None:
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def cli_layer(args: argparse.Namespace, cls) -> dict[str, Any]:
    """The options the user typed on the command line (SUPPRESSed defaults are absent)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def run_config_layer(cli: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """With ``--resume``: the run's own ``config.yaml`` as the lowest layer (so ``--resume`` alone continues
    a run with every setting it had; flags typed with it override it, and the checkpoint's fingerprint
    then refuses a change that would alter the run). Without it, or when there is nothing to continue (no
    complete checkpoint: ``--resume auto`` then starts afresh from the other layers): nothing."""
    if not cli.get("resume") or not cli.get("output_dir"):
        return []
    folder = Path(cli["output_dir"])
    path = RunDir(folder).config
    if not path.is_file() or not any(RunDir(folder).checkpoints.glob(f"step-*/{RunDir.CHECKPOINT_META}")):
        return []
    data = load_yaml(path)
    for key in ("resume", "overwrite"):  # how this invocation treats the folder is its own business
        data.pop(key, None)
    return [(f"{path} (the run's own settings)", data)]


# ---------------------------------------------------------------------------------------------------------------
# Option groups: a setting that several commands take is declared once, here or in its package's config module
# (cast_llm.data.config: the text and its windows), and each command's config derives from the groups it takes;
# a command words a setting for itself with OPTION_TEXT / OPTION_SECTIONS (:func:`shown`), never re-declares it.
# tests/test_config_groups.py fails on a field declared in two config dataclasses neither of which derives from
# the other.


@dataclasses.dataclass
class ModelSettings:
    model: str = option("smollm2-135m", "Hugging Face model folder / hub id / .gguf file, or the alias "
                                        "smollm2-135m", resume="must_match")


@dataclasses.dataclass
class NMSettings:
    """The N:M pattern: N weights kept in every group of M consecutive input weights."""

    n: int = option(2, "N of the N:M pattern (kept per group)", min=1, resume="must_match")
    m: int = option(4, "M of the N:M pattern (group size)", min=2, resume="must_match")

    def check_pattern(self) -> None:
        if not 1 <= self.n < self.m:
            raise CastError(f"need 1 ≤ n < m for an N:M pattern, got {self.n}:{self.m}")


@dataclasses.dataclass
class PatternSettings(NMSettings):
    """The N:M pattern and what becomes of a layer it does not fit."""

    skip_incompatible: bool = option(False, "leave layers whose width is not a multiple of m dense instead of "
                                            "failing", resume="free")


@dataclasses.dataclass
class OutputDirSettings:
    """``--output-dir``: the folder a command writes (the scaling-law sweep and eval zeroshot take it alone)."""

    output_dir: str | None = option(None, "run folder: checkpoints, logs, and the final model (required)",
                                    resume="free")


@dataclasses.dataclass
class OutputSettings(OutputDirSettings):
    """The folder a command writes, and whether it may replace an earlier output there."""

    overwrite: bool = option(False, "replace an earlier run in --output-dir (only files that run wrote are "
                                    "removed, and only once the new run has finished: until then they wait in "
                                    ".cast-llm-previous/; never the model's own folder or a folder of model "
                                    "weights)", resume="free")


@dataclasses.dataclass
class DeviceSettings:
    """``--device``: where a command runs its model (train and finetune take only auto, cpu or cuda: RunConfig)."""

    device: str = option("auto", "auto (cuda if available), cpu, cuda, cuda:N")


@dataclasses.dataclass
class SeedSettings:
    seed: int = option(0, "seed for data order, sampling and initialisation", resume="must_match")


@dataclasses.dataclass
class ProgressSettings:
    progress: bool = option(True, "show a progress bar", resume="free")


@dataclasses.dataclass
class KernelSettings:
    """``--kernels auto|reference``: every command that runs our kernels takes it."""

    kernels: str = option("auto", KERNELS_HELP, choices=KERNEL_MODES, resume="free")


@dataclasses.dataclass
class ThreadSettings:
    """``--threads``: torch's CPU threads, set by ``cast_llm.train.threads.setup_threads`` for every command that
    takes it (train and finetune through RunConfig, generate)."""

    threads: int = option(0, "CPU threads for torch (0 = automatic: the cores this process may use, less those "
                             "other processes are busy on); on a shared machine fewer threads avoid spinning "
                             "against other jobs", min=0, resume="free")


@dataclasses.dataclass
class PlotSettings:
    """``--plot PNG``: the commands whose result is a figure as well as a table (bench-inference, scaling-law)."""

    plot: str | None = option(None, "also draw the result into this PNG file")


@dataclasses.dataclass
class JsonSettings:
    json: bool = option(False, "print the result as one JSON object")
