"""What the command modules share: a sub-command built from a config dataclass, and its options resolved.

The flags of a command are the fields of its config dataclass (:func:`cast_llm.config.add_arguments`:
``--help`` groups by section, choices and one default per flag); :func:`resolve_options` builds the config
from, lowest first, the dataclass defaults, the run's own ``config.yaml`` (``--resume``), a ``--preset``, a
``--config`` file, and the flags actually typed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from cast_llm.config import add_arguments, cli_layer, load_yaml, resolve, run_config_layer
from cast_llm.errors import CastError

CONFIG_HELP = "YAML file of options (keys as in a run's config.yaml); flags typed here override it"


def summary(doc: str) -> str:
    """The first paragraph of a command module's docstring, as ``--help`` prints it (no reST markup)."""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "'")


def add_config_command(subparsers, name: str, cls, *, func: Callable[[argparse.Namespace], int], help: str,
                       description: str, model: str | None = None, optional_model: bool = False,
                       presets: Mapping[str, dict] | None = None, preset_help: str = "",
                       config_file: bool = False, sections: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """Register sub-command ``name``: one flag per field of ``cls``, run by ``func(args)``.

    ``model``: the help of a positional ``MODEL`` that fills the field ``model`` (``optional_model``: it may
    be left out, for a ``--config`` file or ``--resume`` to supply it); ``presets``: a ``--preset`` naming one
    of these option sets; ``config_file``: a ``--config FILE`` of options.
    """
    p = subparsers.add_parser(name, help=help, description=description)
    if model is not None:
        extra = {"nargs": "?", "default": argparse.SUPPRESS} if optional_model else {}
        p.add_argument("model", metavar="MODEL", help=model, **extra)
    if presets is not None:
        p.add_argument("--preset", default=None, metavar="PRESET",
                       help=f"{preset_help} {{{', '.join(presets)}}}".strip())
    if config_file:
        p.add_argument("--config", default=None, metavar="FILE", help=CONFIG_HELP)
    add_arguments(p, cls, skip=("model",) if model is not None else (), sections=sections)
    p.set_defaults(func=func)
    return p


def resolve_options(cls, args: argparse.Namespace, *, presets: Mapping[str, dict] | None = None,
                    run_folder: bool = False, one_of: tuple[str, ...] = (),
                    base: tuple[str, dict] | None = None):
    """``cls`` from, lowest first: its defaults < ``base`` (a command's own defaults for ``cls``, named) <
    (``run_folder`` and ``--resume``: the run's ``config.yaml``) < ``--preset`` < ``--config`` file < the flags
    typed (and MODEL).

    ``one_of``: fields that are alternatives of each other (a budget in tokens or in steps): a layer that
    gives one of them drops the lower layers' values of all of them (a budget in the YAML file replaces the
    preset's, a budget typed replaces both).
    """
    cli = cli_layer(args, cls)
    layers = [base] if base else []
    layers += run_config_layer(cli) if run_folder else []
    preset = getattr(args, "preset", None)
    if preset:
        if preset not in (presets or {}):
            raise CastError(f"unknown --preset '{preset}' (choose from {', '.join(presets or {})})")
        layers.append((f"preset {preset}", presets[preset]))
    if getattr(args, "config", None):
        layers.append((args.config, load_yaml(args.config)))
    layers.append(("command line", cli))
    if one_of:
        for i, (_, d) in enumerate(layers):
            if any(k.replace("-", "_") in one_of for k in d):
                layers[:i] = [(src, {k: v for k, v in low.items() if k.replace("-", "_") not in one_of})
                              for src, low in layers[:i]]
    return resolve(cls, *layers)
