"""The run folder of a training or fine-tuning job: its marker, its lock, and what may be replaced in it.

A run folder (``--output-dir``) holds ``cast_run.json`` (the marker: kind, config, and the list of every
file and folder the run wrote), ``config.yaml``, ``metrics.jsonl``, ``results.json``, ``tensorboard/``,
``checkpoints/`` and, at the end, the exported model. Rules, so that the tool never destroys what it did
not write:

* a folder that is the ``--model`` (or lies inside it) is refused, whatever the flags;
* a non-empty folder that is not a cast-llm run is refused when it holds model weights, even with
  ``--overwrite`` (other files are left alone: the run writes beside them);
* ``--overwrite`` removes only the files and folders the marker lists as written by the previous run;
* a lock (``.cast-llm.lock``, an ``flock``) refuses a second job on a folder in use; the operating
  system releases it when the holder dies, so a crashed run never leaves it stuck.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from cast_llm.errors import CastError
from cast_llm.io import RunDir, atomic_write_json, read_json

__all__ = ["RUN_MARKER", "LOCK_FILE", "RunLock", "is_run_dir", "prepare_run_dir", "record_written", "written_files"]

RUN_MARKER = RunDir.MARKER
LOCK_FILE = RunDir.LOCK
# what every run writes besides the exported model (always its own, listed in the marker too)
RUN_FILES = RunDir.OWN
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.ckpt", "*.h5", "*.msgpack",
                   "*.safetensors.index.json")


def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return (path / RUN_MARKER).is_file() or (path / RunDir.EXPORT_MARKER).is_file()


def _holds_weights(path: Path) -> list[str]:
    found = []
    for pattern in WEIGHT_PATTERNS:
        found += [p.name for p in path.glob(pattern)]
    if (path / "config.json").is_file():
        found.append("config.json")
    return sorted(set(found))


def written_files(path: Path) -> list[str]:
    """Names (relative to the run folder) of everything the run in ``path`` recorded as written by it."""
    marker = read_json(Path(path) / RUN_MARKER)
    export = read_json(Path(path) / RunDir.EXPORT_MARKER)  # the files of the model the run exported
    return list(dict.fromkeys(list(RUN_FILES) + list(marker.get("written", [])) + list(export.get("files", []))))


def record_written(path: Path, names: list[str]) -> None:
    """Add ``names`` (files or folders of the run folder) to the marker's list of what the run wrote."""
    marker_path = Path(path) / RUN_MARKER
    marker = read_json(marker_path)
    marker["written"] = sorted(set(marker.get("written", [])) | set(names))
    atomic_write_json(marker_path, marker)


class RunLock:
    """An exclusive lock on a run folder for the lifetime of a job (``flock`` on ``.cast-llm.lock``).

    Released by :meth:`release` or, if the process dies, by the operating system. The lock file holds the
    holder's pid, host and start time, for the message of a refused second job.
    """

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_FILE
        self.fd: int | None = None
        self.unsupported: str | None = None  # why the filesystem could not lock (then the job runs unlocked)

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock, but say so once
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # the filesystem cannot lock (Lustre mounted with noflock, NFSv3 without lockd): not "in use"
                self.unsupported = f"{e.strerror or e} (errno {e.errno})"
                return self
            holder = read_json(self.path)
            who = (f" (pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')})"
                   if holder else "")
            raise CastError(f"--output-dir {self.path.parent} is in use by another cast-llm job{who}; wait for it "
                            "to finish or choose another folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it (both resolved)."""
    try:
        a.resolve().relative_to(b.resolve())
        return True
    except ValueError:
        return False


def prepare_run_dir(out: Path, *, resume: bool, overwrite: bool, is_main: bool, model: str | None = None,
                    kind: str = "run") -> Path:
    """Validate (and, on the main process, create or clear) a run folder. An existing folder is reused only
    for a resume or with ``overwrite``, and never when it is the model's own folder or a non-run folder
    holding model weights. Call it with the folder's :class:`RunLock` held."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CastError(f"--output-dir {out} exists and is a file")
    if model is not None and Path(model).exists() and _inside(out, Path(model)):
        raise CastError(f"--output-dir {out} is the model's own folder (--model {model}) or inside it; writing there "
                        "would destroy the model: choose another folder")
    entries = [p for p in out.iterdir() if p.name != LOCK_FILE] if out.is_dir() else []
    is_run = is_run_dir(out)
    if resume:
        if not is_run:
            raise CastError(f"--resume: {out} is not a cast-llm {kind} folder (no {RUN_MARKER})")
        return out
    if entries:
        weights = [] if is_run else _holds_weights(out)
        if weights:
            raise CastError(f"--output-dir {out} is not a cast-llm run and holds model files ({', '.join(weights[:3])}); "
                            "cast-llm never replaces files it did not write: choose another folder")
        if not overwrite:
            what = f"holds a cast-llm {kind}" if is_run else "is not empty (and not a cast-llm run)"
            fix = ("--overwrite to replace it, --resume to continue it" if is_run
                   else "--overwrite to write beside its files (none of them is touched)")
            raise CastError(f"--output-dir {out} already exists and {what}; pass {fix}, or choose another folder")
        if is_main and is_run:  # remove only what the previous run recorded as its own
            for name in written_files(out) + [RUN_MARKER, "cast_llm.json"]:
                p = out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.exists() or p.is_symlink():
                    p.unlink()
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    return out


def write_marker(out: Path, info: dict[str, Any]) -> None:
    """Create or update the run marker (keeping its list of written files)."""
    path = Path(out) / RUN_MARKER
    old = read_json(path)
    atomic_write_json(path, {**info, "written": old.get("written", [])})
