"""Atomic, verifiable, code-free training checkpoints for exact resume.

A checkpoint is a folder ``checkpoints/step-XXXXXXXX`` holding the training state — model (or adapter),
optimizer (masks included), LR schedule, RNG states, observers; the data position is the step — each as
``NAME.json`` + ``NAME.safetensors`` (:mod:`cast_llm.train.state_io`: no pickle, so loading a checkpoint
never runs code), and ``meta.json`` with the config fingerprint and a sha256 of every file. It is written
into ``step-….tmp`` and renamed into place only when complete, so a run killed at any instant leaves the
previous checkpoint intact; old checkpoints are removed only after the new one is complete. Loading checks
the fingerprint and the checksums and refuses a corrupt, incompatible or pickle-bearing checkpoint with a
message naming the file.

Every folder a save creates carries :data:`SAVE_MARKER` from its first instant, so that a ``*.tmp``
left by a save that was killed is known to be ours: :func:`remove_stale_partials` removes those (and only
those) when a run starts. Under FSDP2 every rank hashes the files it wrote and verifies, when resuming, the
files it reads: no rank reads another's shards.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cast_llm.config import FORMER_NAMES, resume_keys
from cast_llm.errors import CastError
from cast_llm.io import RunDir, atomic_dir, fsync_path, is_plain_name, publish_dir, sha256_file
from cast_llm.train.state_io import StateFormatError, load_state, save_state

__all__ = ["CheckpointWriteError", "UnsafeCheckpointError", "fingerprint", "rng_state", "set_rng_state",
           "list_checkpoints", "save_checkpoint", "save_sharded_checkpoint", "load_checkpoint", "SAVE_MARKER",
           "remove_stale_partials", "latest_meta", "checkpoint_root", "checkpoint_dir"]

# files a checkpoint of ours never holds: pickle-based formats can run code when loaded
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")
# written first into every folder a checkpoint save creates, so that a partial one (``step-N.tmp``, ``step-N.old``)
# that holds it is known to be ours (removed when a run starts); not a file of the checkpoint (meta.json lists none)
SAVE_MARKER = ".cast-llm-checkpoint"
CHECKPOINT_META = RunDir.CHECKPOINT_META  # meta.json: the fingerprint, the step and every file's checksum


class CheckpointWriteError(CastError):
    """Writing a checkpoint failed (disk full, I/O error); the previous checkpoint is intact."""


class UnsafeCheckpointError(CastError):
    """A checkpoint folder holds a file that could run code when loaded (a pickle)."""


def fingerprint(cfg) -> dict[str, Any]:
    """The settings of the job's config ``cfg`` that a resume must match (its fields marked
    ``resume="must_match"``: :func:`cast_llm.config.resume_keys`), as the checkpoint records them."""
    values = asdict(cfg)
    return {k: values[k] for k in resume_keys(type(cfg))}


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def checkpoint_root(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """The folder of checkpoint ``step`` of a run folder (``checkpoints/step-XXXXXXXX``)."""
    return checkpoint_root(run_dir) / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first (a folder being written ends in ``.tmp``)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit() and (p / CHECKPOINT_META).is_file())


def latest_meta(run_dir: Path) -> dict[str, Any]:
    """The ``meta.json`` of the newest complete checkpoint of ``run_dir`` as written (empty when there is
    none or it cannot be read: loading the checkpoint reports that)."""
    found = list_checkpoints(run_dir) if Path(run_dir).is_dir() else []
    if not found:
        return {}
    try:
        meta = json.loads((found[-1] / CHECKPOINT_META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _mark(folder: Path, step: int) -> None:
    (folder / SAVE_MARKER).write_text(json.dumps({"writer": "cast-llm", "step": step}))


def remove_stale_partials(run_dir: Path) -> tuple[list[Path], int]:
    """Remove the partial checkpoint folders (``step-N.tmp`` / ``step-N.old``) that a killed save of ours
    left in ``run_dir/checkpoints``; folders without our marker are left alone. Returns (removed, bytes)."""
    root = checkpoint_root(run_dir)
    removed, size = [], 0
    if not root.is_dir():
        return removed, size
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name.startswith("step-") and p.suffix in (".tmp", ".old") \
                and (p / SAVE_MARKER).is_file():
            size += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed, size


def _rotate(run_dir: Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _write_meta(folder: Path, meta: dict[str, Any], step: int, extra: dict[str, Any] | None = None,
                files: dict[str, str] | None = None) -> None:
    """``meta.json`` with the sha256 of every file (``files``: digests already computed, by their writers)."""
    if files is None:
        files = {f.name: sha256_file(f) for f in sorted(folder.iterdir())
                 if f.is_file() and f.name not in (CHECKPOINT_META, SAVE_MARKER)}
    (folder / CHECKPOINT_META).write_text(json.dumps({**meta, "step": step, "files": dict(sorted(files.items())),
                                                  **(extra or {})}, indent=2, default=str))


def save_checkpoint(run_dir: Path, step: int, states: dict[str, Any], meta: dict[str, Any], *,
                    keep: int = 2) -> Path:
    """Write ``states`` (name -> state tree) atomically as checkpoint ``step``; keep the ``keep`` newest.

    Raises :class:`CheckpointWriteError` when the write fails (the previous checkpoints are untouched).
    """
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_dir(final, replace=True) as tmp:
            _mark(tmp, step)
            for name, obj in states.items():
                save_state(tmp / name, obj)
            _write_meta(tmp, meta, step)
    except OSError as e:
        raise CheckpointWriteError(f"writing checkpoint {final} failed ({e.strerror or e}); the previous "
                                   "checkpoint is intact") from None
    _rotate(run_dir, keep)
    return final


def _rank_name(name: str, rank: int) -> str:
    return f"{name}-rank{rank:05d}"


def save_sharded_checkpoint(
    run_dir: Path,
    step: int,
    shared: dict[str, Any],
    per_rank: dict[str, Any],
    meta: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    first_error: Callable[[str | None], str | None],
    gather: Callable[[Any], list[Any]],
    keep: int = 2,
) -> Path:
    """Atomic checkpoint of a sharded (FSDP2) run: every rank writes ``NAME-rankRRRRR.*`` for each entry of
    ``per_rank`` (its own shards), rank 0 also ``NAME.*`` for ``shared``, all into the same ``*.tmp`` folder
    (a filesystem every rank sees), and hashes what it wrote — the ranks hash in parallel, each its own
    bytes. Only when every rank has written, synced and hashed its files does rank 0 write ``meta.json``
    (every rank's digests, ``sharded.world_size``) and rename the folder into place. An error on any rank,
    rank 0's publishing included, raises :class:`CheckpointWriteError` on every rank with that rank's
    message (``first_error``: agreed collectively) and the previous checkpoint stays. Collective: every rank
    must call it.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f"{final.name}.tmp")
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _mark(tmp, step)
        except OSError as e:
            error = f"{tmp}: {e.strerror or e}"
    error = first_error(error)  # (a barrier too: nobody writes before the folder exists)
    if error is not None:
        raise CheckpointWriteError(f"writing checkpoint {final} failed ({error}); the previous checkpoint is intact")
    digests: dict[str, str] = {}
    try:
        written = []
        for name, obj in per_rank.items():
            written += save_state(tmp / _rank_name(name, rank), obj)
        if rank == 0:
            for name, obj in shared.items():
                written += save_state(tmp / name, obj)
        for f in written:
            fsync_path(f)
            digests[Path(f).name] = sha256_file(f)
    except OSError as e:
        error = f"{e.strerror or e}"
    error = first_error(error)
    if error is None:
        every = gather(digests)
        if rank == 0:
            try:
                files = {k: v for d in every for k, v in d.items()}
                expected = {f"{_rank_name(n, r)}{x}" for n in per_rank for r in range(world_size)
                            for x in (".json", ".safetensors")} | {f"{n}{x}" for n in shared
                                                                  for x in (".json", ".safetensors")}
                missing = sorted(expected - {f.name for f in tmp.iterdir()})
                if missing:
                    raise CastError(f"files of other ranks are missing in {tmp} ({missing[:3]}); --fsdp "
                                    "checkpoints need an --output-dir every process can see")
                _write_meta(tmp, meta, step, {"sharded": {"world_size": world_size}}, files=files)
                fsync_path(tmp / CHECKPOINT_META)
                publish_dir(tmp, final, replace=True)
                _rotate(run_dir, keep)
            except (OSError, CastError) as e:
                error = str(e) if isinstance(e, CastError) else f"{e.strerror or e}"
        error = first_error(error)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"writing checkpoint {final} failed ({error}); the previous checkpoint is intact")
    return final


def _refuse_pickles(path: Path) -> None:
    bad = sorted(f.name for f in path.iterdir() if f.suffix.lower() in PICKLE_SUFFIXES)
    if bad:
        raise UnsafeCheckpointError(
            f"checkpoint {path} holds {', '.join(bad)}: a pickle file, which can run code when loaded. cast-llm "
            "checkpoints never contain pickles (it was made by hand or by an old version); refusing to load it")


def _check_meta(path: Path, meta: Any) -> None:
    """A one-line CastError unless ``meta.json`` has the shape :func:`save_checkpoint` writes: an object with an
    integer ``step``, a ``fingerprint`` object, ``files`` mapping plain file names of the folder to digests,
    and ``sharded`` null or ``{"world_size": int}`` (a hand-made one is refused before anything is read)."""
    why = None
    if not isinstance(meta, dict):
        why = f"it holds a JSON {type(meta).__name__}, not an object"
    elif not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool) or meta["step"] < 0:
        why = f"its step {meta.get('step')!r} is not a step number"
    elif not isinstance(meta.get("fingerprint", {}), dict):
        why = "its fingerprint is not an object"
    elif not isinstance(meta.get("files", {}), dict) or not all(
            is_plain_name(k) and isinstance(v, str) for k, v in meta.get("files", {}).items()):
        why = "its files are not plain names of the folder's files with their checksums"
    elif meta.get("sharded") is not None and not (isinstance(meta["sharded"], dict) and isinstance(
            meta["sharded"].get("world_size"), int) and meta["sharded"]["world_size"] > 0):
        why = "its sharded entry is not {\"world_size\": N}"
    if why:
        raise CastError(f"checkpoint {path} is corrupt: meta.json is not what cast-llm writes ({why}); delete this "
                        "checkpoint folder to resume from an older one")


def load_checkpoint(path: Path, expected_fingerprint: dict[str, Any], *,
                    rank: int | None = None, world_size: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify and load a checkpoint folder; returns (states, meta). Never unpickles anything.

    ``rank``/``world_size`` (FSDP2 runs): load a sharded checkpoint's shared files and this rank's own
    ``NAME-rankRRRRR.*`` files (returned under ``NAME``); the number of processes must be the same.
    """
    path = Path(path)
    _refuse_pickles(path)
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text())
    except (OSError, ValueError) as e:  # (a UnicodeDecodeError is a ValueError)
        raise CastError(f"checkpoint {path} is corrupt: cannot read meta.json ({e}); delete it to use an older one") from None
    _check_meta(path, meta)
    got = meta.get("fingerprint", {})
    # (a setting renamed since: compared under the name the checkpoint recorded)
    got = {**{new: got[old] for new, old in FORMER_NAMES.items() if old in got and new not in got}, **got}
    # a setting the checkpoint does not record was not one a resume had to match when it was written (a version
    # before the setting was marked must_match): it is not compared, as that version would not have
    diff = {k: (got[k], v) for k, v in expected_fingerprint.items() if k in got and got[k] != v}
    if diff:
        detail = "; ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise CastError(f"checkpoint {path} belongs to a different run configuration ({detail}); "
                        "resume with the same settings or start a new --output-dir")
    sharded = meta.get("sharded")
    if (sharded is None) != (rank is None):
        kind = "sharded (--fsdp)" if sharded else "unsharded"
        raise CastError(f"checkpoint {path} is {kind}; resume it with the same --fsdp setting it was written with")
    if sharded and sharded["world_size"] != world_size:
        raise CastError(f"checkpoint {path} was written by {sharded['world_size']} processes (--fsdp); resume it "
                        f"with the same number of processes (now {world_size})")
    files = meta.get("files", {})
    for fname, digest in files.items():
        if rank is not None and "-rank" in fname and int(fname.split("-rank")[-1].split(".")[0]) != rank:
            continue  # another rank's shard: that rank verifies it (each reads and hashes only its own)
        f = path / fname
        if not f.is_file() or sha256_file(f) != digest:
            raise CastError(f"checkpoint {path} is corrupt: {fname} is missing or its checksum does not match; "
                            "delete this checkpoint folder to resume from an older one")
    states = {}
    for fname in files:
        if not fname.endswith(".json"):
            continue
        name = fname.removesuffix(".json")
        if "-rank" in name:
            base, _, r = name.rpartition("-rank")
            if rank is None or int(r) != rank:
                continue
            name = base
        try:
            states[name] = load_state(path / fname.removesuffix(".json"))
        except StateFormatError as e:
            raise CastError(f"checkpoint {path} is corrupt: {e}") from None
    return states, meta
