"""Atomic, verifiable training checkpoints for exact resume.

A checkpoint is a folder ``checkpoints/step-XXXXXXXX`` holding the model and optimizer state (masks
included), the LR schedule, RNG states, the data position (the step) and a ``meta.json`` with the config
fingerprint and a sha256 of every file. It is written into ``*.tmp`` and renamed into place only when
complete, so a run killed at any instant (even ``kill -9``) leaves the previous checkpoint intact. Loading
checks the fingerprint and the checksums and refuses a corrupt or incompatible checkpoint with a message.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cast_llm.errors import CastError

# config keys that must match for a resume to continue the same run (others, e.g. logging, may change)
FINGERPRINT_KEYS = (
    "model", "data", "method", "max_steps", "tokens", "batch_size", "grad_accum", "seq_len", "lr", "l1_decay",
    "beta1", "beta2", "eps", "weight_decay", "warmup_steps", "min_lr_ratio", "mask_interval", "n", "m", "scaling",
    "scale_groups", "kd", "eta", "temperature", "seed", "val_fraction", "max_documents",
    "fixed_mask", "init_mask", "calib_samples", "mask_learner", "srste_decay", "maskllm_tau", "maskllm_kappa",
    "maskllm_prior",
)


def fingerprint(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg_dict.get(k) for k in FINGERPRINT_KEYS if k in cfg_dict}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp"))


def save_checkpoint(
    run_dir: Path,
    step: int,
    states: dict[str, Any],
    meta: dict[str, Any],
    *,
    keep: int = 2,
    write: bool = True,
) -> Path:
    """Write ``states`` (name -> object for torch.save) atomically as checkpoint ``step``.

    ``write=False`` (non-zero ranks when states are replicated) only returns the path.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step-{step:08d}"
    if not write:
        return final
    tmp = root / f"step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {}
    for name, obj in states.items():
        path = tmp / f"{name}.pt"
        torch.save(obj, path)
        files[path.name] = _sha256(path)
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "files": files}, indent=2, default=str))
    for f in tmp.iterdir():  # data must be on disk before the rename makes the checkpoint visible
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    _publish(run_dir, tmp, final, keep)
    return final


def _publish(run_dir: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rename a complete ``*.tmp`` checkpoint folder into place, then drop all but the ``keep`` newest."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _rank_file(name: str, rank: int) -> str:
    return f"{name}-rank{rank:05d}.pt"


def save_sharded_checkpoint(
    run_dir: Path,
    step: int,
    shared: dict[str, Any],
    per_rank: dict[str, Any],
    meta: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    barrier,
    keep: int = 2,
) -> Path:
    """Atomic checkpoint of a sharded (FSDP2) run: every rank writes ``NAME-rankRRRRR.pt`` for each entry of
    ``per_rank`` (its own shards), rank 0 also ``NAME.pt`` for ``shared``; all into the same ``*.tmp`` folder
    (a filesystem every rank sees). Only when every rank has written and synced its files does rank 0
    checksum them all, write ``meta.json`` (with ``sharded.world_size``) and rename the folder into place.
    Collective: every rank must call it; ``barrier()`` synchronises the ranks.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    mine = {_rank_file(name, rank): obj for name, obj in per_rank.items()}
    if rank == 0:
        mine.update({f"{name}.pt": obj for name, obj in shared.items()})
    for fname, obj in mine.items():
        torch.save(obj, tmp / fname)
        with (tmp / fname).open("rb") as fh:
            os.fsync(fh.fileno())
    barrier()
    if rank == 0:
        expected = {_rank_file(name, r) for name in per_rank for r in range(world_size)} | {f"{n}.pt" for n in shared}
        present = {f.name for f in tmp.iterdir()}
        if expected - present:
            raise CastError(f"checkpoint {tmp}: files of other ranks are missing ({sorted(expected - present)[:3]}); "
                            "--fsdp checkpoints need an --output-dir every process can see")
        files = {f: _sha256(tmp / f) for f in sorted(expected)}
        meta = {**meta, "step": step, "files": files, "sharded": {"world_size": world_size}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        with (tmp / "meta.json").open("rb") as fh:
            os.fsync(fh.fileno())
        _publish(run_dir, tmp, final, keep)
    barrier()
    return final


def load_checkpoint(path: Path, expected_fingerprint: dict[str, Any], *,
                    rank: int | None = None, world_size: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify and load a checkpoint folder; returns (states, meta).

    ``rank``/``world_size`` (FSDP2 runs): load a sharded checkpoint's shared files and this rank's own
    ``NAME-rankRRRRR.pt`` files (returned under ``NAME``); the number of processes must be the same.
    """
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CastError(f"checkpoint {path} is corrupt: cannot read meta.json ({e}); delete it to use an older one") from None
    got = meta.get("fingerprint", {})
    diff = {k: (got.get(k), v) for k, v in expected_fingerprint.items() if got.get(k) != v}
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
    states = {}
    for fname, digest in meta.get("files", {}).items():
        name = fname.removesuffix(".pt")
        if sharded and "-rank" in name:
            name, _, r = name.rpartition("-rank")
            if int(r) != rank:
                continue
        f = path / fname
        if not f.is_file() or _sha256(f) != digest:
            raise CastError(f"checkpoint {path} is corrupt: {fname} is missing or its checksum does not match; "
                            "delete this checkpoint folder to resume from an older one")
        states[name] = torch.load(f, map_location="cpu", weights_only=False)
    return states, meta
