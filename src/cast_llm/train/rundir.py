"""The run folder of a training or fine-tuning job: its marker, its lock, and what may be replaced in it.

A run folder (``--output-dir``) holds ``cast_run.json`` (the marker: kind, config, and the list of every
file and folder the run wrote), ``config.yaml``, ``metrics.jsonl``, ``results.json``, ``tensorboard/``,
``checkpoints/`` and, at the end, the exported model. Rules, so that the tool never destroys what it did
not write:

* a folder that is the ``--model`` (or lies inside it) is refused, whatever the flags;
* a folder that is, lies inside or contains one of the job's inputs (data, mask file, WikiText file) is refused;
* a non-empty folder that is not a cast-llm run is refused when it holds model weights or any file the run
  would write, even with ``--overwrite`` (other files are left alone: the run writes beside them);
* ``--overwrite`` replaces only the files and folders the marker lists as written by the previous run, each a
  plain name of an entry of the folder (links moved or unlinked, never followed): they are moved into
  ``.cast-llm-previous/`` and deleted only once the new run has finished (a new run killed early leaves
  the previous one there, whole);
* ``--resume auto`` on a finished run changes nothing (:func:`finished_result`);
* a lock (``.cast-llm.lock``, an ``flock``) refuses a second job on a folder in use; the operating
  system releases it when the holder dies, so a crashed run never leaves it stuck.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from cast_llm.errors import CastError
from cast_llm.io import (
    RunDir,
    atomic_write_json,
    is_plain_name,
    overlap,
    read_json,
    read_json_object,
    remove_entry,
)

__all__ = ["RUN_MARKER", "LOCK_FILE", "RunLock", "is_run_dir", "prepare_run_dir", "record_written", "written_files",
           "finished_result", "kept_checkpoints", "say_if_finished", "set_aside", "drop_previous", "PREVIOUS",
           "read_results", "write_results", "write_marker"]

RUN_MARKER = RunDir.MARKER
LOCK_FILE = RunDir.LOCK
PREVIOUS = ".cast-llm-previous"  # the run an --overwrite replaces, kept until the new one has finished
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
    """Names (entries of the run folder) of everything the run in ``path`` recorded as written by it; a
    CastError when a marker lists anything but a plain name of an entry of the folder (``../x``, ``/home/u``:
    a marker cast-llm did not write), before anything is removed."""
    path = Path(path)
    listed = list(RUN_FILES)
    for name, key in ((RUN_MARKER, "written"), (RunDir.EXPORT_MARKER, "files")):  # the run's, its model's
        if not os.path.lexists(path / name):
            continue
        if (path / name).is_symlink():
            raise CastError(f"{path / name} is a link, not a marker cast-llm wrote; remove it yourself or choose "
                            "another --output-dir")
        names = read_json_object(path / name, "the run's marker", fix="choose another --output-dir").get(key, [])
        bad = [n for n in names if not is_plain_name(n)] if isinstance(names, list) else [names]
        if bad:
            raise CastError(f"{path / name} lists {bad[0]!r}, which is not a plain name of a file in the folder: "
                            "this marker was not written by cast-llm; nothing was removed: choose another "
                            "--output-dir")
        listed += names
    return list(dict.fromkeys(listed))


# what a run writes into its folder besides RUN_FILES: the exported model (a non-run folder holding any of these
# is refused: they would be replaced); the weights themselves are WEIGHT_PATTERNS
EXPORT_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                "chat_template.jinja", "README.md", RunDir.EXPORT_MARKER, RUN_MARKER)


def say_if_finished(args) -> bool:
    """For ``train`` / ``finetune``: with ``--resume`` (``auto`` or not) and without ``--overwrite`` on a folder
    whose run finished, print "already finished: RESULT" and return True (the command then exits 0, before
    any option is resolved: a re-submitted job script needs no budget flag to be told so)."""
    out, resume = getattr(args, "output_dir", None), getattr(args, "resume", None)
    done = finished_result(Path(out)) if out and resume and not getattr(args, "overwrite", False) else None
    if done is None or kept_checkpoints(Path(out)):  # kept ones (--keep-checkpoints-after): resumed as before
        return False
    if os.environ.get("RANK", "0") == "0":
        print(f"already finished: {done}; nothing to resume (`--resume auto --overwrite` trains it again from "
              "the beginning)")
    return True


def kept_checkpoints(path: Path) -> bool:
    """Whether the run folder still holds a complete checkpoint (a finished run that kept them resumes from its
    last one: its export and evaluation run again, nothing is trained and nothing deleted)."""
    return any(RunDir(path).checkpoints.glob(f"step-*/{RunDir.CHECKPOINT_META}"))


def finished_result(path: Path) -> str | None:
    """What the finished run in ``path`` produced, in a few words (None: not a run, or not finished). A run is
    finished once its final ``results.json`` (which names the output folder) and its exported model are there."""
    path = Path(path)
    if not is_run_dir(path) or not (path / RunDir.EXPORT_MARKER).is_file():
        return None
    results = read_json(path / RunDir.RESULTS)
    if not isinstance(results, dict) or not results.get("output_dir"):
        return None
    what = [str(results[k]) for k in ("method", "mode", "pattern") if isinstance(results.get(k), str)]
    ppl = results.get("perplexity") if isinstance(results.get("perplexity"), dict) else {}
    for split, label in (("heldout", "test"), ("wikitext2", "WikiText-2")):
        entry = ppl.get(split) if isinstance(ppl.get(split), dict) else {}
        value = entry.get("sparse")
        value = value.get("perplexity") if isinstance(value, dict) else value  # a figure, or a PplResult's dict
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            what.append(f"{label} ppl {value:.2f}")
    if isinstance(results.get("steps"), int):
        what.append(f"{results['steps']} steps")
    return f"{', '.join(what) or 'a finished run'}; the model is {path} ({RunDir.RESULTS})"


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

    def _open(self, flags: int) -> int:
        """The lock file opened without following a link (``O_NOFOLLOW``), checked to be a regular file of
        this user before anything is written to it; a CastError otherwise (naming the file)."""
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CastError(f"{self.path} is a link: cast-llm never writes through a link planted in a run "
                                "folder; remove it, or choose another --output-dir") from None
            raise
        st = os.fstat(fd)
        why = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"belongs to another user (uid {st.st_uid})" if hasattr(os, "getuid") and st.st_uid != os.getuid()
               else None)
        if why:
            os.close(fd)
            raise CastError(f"{self.path} {why}: it is not a lock cast-llm made; remove it, or choose another "
                            "--output-dir")
        return fd

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock, but say so once
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open(os.O_RDWR | os.O_CREAT)  # no O_TRUNC: nothing is changed before the checks
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                # the filesystem cannot lock (Lustre mounted with noflock, NFSv3 without lockd): not "in use"
                self.unsupported = f"{e.strerror or e} (errno {e.errno})"
                return self
            raw = os.pread(fd, 4096, 0)
            os.close(fd)
            try:
                holder = json.loads(raw.decode("utf-8"))
            except ValueError:
                holder = None
            who = (f" (pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')})"
                   if isinstance(holder, dict) else "")
            raise CastError(f"--output-dir {self.path.parent} is in use by another cast-llm job{who}; wait for it "
                            "to finish or choose another folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self.fd = fd
        return self

    @staticmethod
    def held(folder: Path) -> bool:
        """Whether a live job holds the lock of ``folder``: probed without creating, writing or following
        anything (a folder that is only read, e.g. by ``cast-llm report``, is left exactly as it was)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return False
        path = Path(folder) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:  # none, a link, unreadable: no job of ours holds it
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        finally:
            os.close(fd)  # (drops the shared lock, if taken)
        return False

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
                    kind: str = "run", inputs: dict[str, str | None] | None = None) -> Path:
    """Validate (and, on the main process, create or clear) a run folder. An existing folder is reused only
    for a resume or with ``overwrite``, and never when it is, lies inside or contains one of the job's
    ``inputs`` (``{flag: path}``: the model, the data, a mask file, …) or is a non-run folder holding model
    weights or any file the run writes. Call it with the folder's :class:`RunLock` held."""
    out = Path(out)
    if os.path.lexists(out) and not out.is_dir():
        raise CastError(f"--output-dir {out} exists and is not a folder")
    if model is not None and Path(model).exists() and _inside(out, Path(model)):
        raise CastError(f"--output-dir {out} is the model's own folder (--model {model}) or inside it; writing there "
                        "would destroy the model: choose another folder")
    for flag, given in (inputs or {}).items():
        how = overlap(out, given) if given and Path(given).expanduser().exists() else None
        if how is not None:
            raise CastError(f"--output-dir {out} {how} {flag} {given}: the run would write over its own input; "
                            "choose another --output-dir")
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
        taken = [] if is_run else sorted(p.name for p in entries if p.name in (*RUN_FILES, *EXPORT_NAMES))
        if taken:
            raise CastError(f"--output-dir {out} is not a cast-llm run and holds {', '.join(taken[:5])}, which the "
                            "run would write over; cast-llm never replaces files it did not write: move "
                            f"{'it' if len(taken) == 1 else 'them'} or choose another folder")
        if not overwrite:
            what = f"holds a cast-llm {kind}" if is_run else "is not empty (and not a cast-llm run)"
            fix = ("--overwrite to replace it, --resume to continue it" if is_run
                   else "--overwrite to write beside its files (none of them is touched)")
            raise CastError(f"--output-dir {out} already exists and {what}; pass {fix}, or choose another folder")
        if is_run:  # replace only what the previous run recorded as its own (checked on every process)
            names = written_files(out) + [RUN_MARKER, RunDir.EXPORT_MARKER]
            if is_main:
                set_aside(out, names)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    return out


def set_aside(out: Path, names: list[str]) -> None:
    """``--overwrite``: move the previous run's own entries ``names`` (plain names, checked) into
    :data:`PREVIOUS` inside the folder (renames: nothing is copied), where they stay until the new run has
    finished (:func:`drop_previous`); a run killed before that leaves them there, whole. When :data:`PREVIOUS`
    is already there, the entries now in the folder are those of a replacement that never finished: they
    are removed, and the run set aside first is kept. Links are moved or unlinked, never followed."""
    out = Path(out)
    previous = out / PREVIOUS
    keep = not os.path.lexists(previous)
    if keep:
        previous.mkdir()
    for name in dict.fromkeys(names):
        if not os.path.lexists(out / name):
            continue
        if keep:
            os.replace(out / name, previous / name)
        else:
            remove_entry(out, name)


def drop_previous(out: Path) -> bool:
    """Delete the run an ``--overwrite`` set aside (:func:`set_aside`), now that the new one has finished;
    True if there was one. A link of that name is unlinked, never followed."""
    out = Path(out)
    if not os.path.lexists(out / PREVIOUS):
        return False
    remove_entry(out, PREVIOUS)
    return True


def write_marker(out: Path, info: dict[str, Any]) -> None:
    """Create or update the run marker (keeping its list of written files)."""
    path = Path(out) / RUN_MARKER
    old = read_json(path)
    atomic_write_json(path, {**info, "written": old.get("written", [])})


def read_results(out: Path) -> dict[str, Any]:
    """The ``results.json`` a resumed run's earlier segments wrote (empty when there is none); a hand-edited one
    that is not a JSON object is a one-line CastError, not a traceback."""
    path = RunDir(out).results
    if not path.is_file():
        return {}
    return read_json_object(path, "the run's results", fix="restore it, or remove it to resume without the earlier "
                            "segments' figures")


def write_results(out: Path, results: dict[str, Any]) -> None:
    """The one writer of a run's ``results.json`` (atomic: a reader sees the previous version or this one).
    The loop writes it with every checkpoint, after the steps, after the export and at the end; ``cast-llm
    train`` again when it adds the decode speeds and the report's path."""
    atomic_write_json(RunDir(out).results, results)
