"""Every checked kernel path of cast-llm, found where it is declared: no list of them to keep.

A path registers itself when the module that declares it is imported — ``kernels.register(CheckedPath(...))``
beside its kernel (``optim/functional.py``, ``nn/scaled_weight.py``, ``deploy/sparse24/kernels.py``, ...). A run
imports only the modules it uses, so only their paths are in :data:`~cast_llm.kernels.registry.REGISTRY`;
``cast-llm doctor`` must list all of them. :func:`load_all` imports every module of the package whose source
builds a :class:`~cast_llm.kernels.registry.CheckedPath`: found by reading the package's files (a text search,
then the syntax tree to confirm a ``CheckedPath(...)`` call, so a docstring naming it does not count).

Why this and not the alternatives: a declared list of modules (in the registry or in ``doctor``) is the hand
list that went stale — a new path is missing from ``doctor`` until someone remembers it — and the registry,
on the core floor, would name modules of the floors above it; importing the whole package would drag in the
command line, the trainer and their heavy libraries. Reading the files costs a few milliseconds and finds a
new path the moment its module is saved. ``tests/test_doctor.py`` checks the outcome against every module
imported one by one.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

__all__ = ["declaring_modules", "load_all"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # src/cast_llm


def _builds_a_checked_path(source: str) -> bool:
    if "CheckedPath(" not in source:
        return False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "CheckedPath":
                return True
    return False


def declaring_modules() -> list[str]:
    """The dotted names of the modules whose source builds a ``CheckedPath`` (sorted)."""
    found = []
    for path in sorted(_PACKAGE_ROOT.rglob("*.py")):
        parts = list(path.relative_to(_PACKAGE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__main__":  # importing one runs the command line
            continue
        if _builds_a_checked_path(path.read_text(encoding="utf-8")):
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def load_all() -> list[str]:
    """Import every module that declares a checked path (each registers its paths on import); returns their
    names."""
    modules = declaring_modules()
    for name in modules:
        importlib.import_module(name)
    return modules
