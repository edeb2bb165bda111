"""Files the tool writes: atomically (a temporary file, fsync, rename), with checksums, and JSON lines.

Every writer of the package goes through these, so that a run killed at any instant — ``kill -9``, a full
disk, a node that dies — leaves either the previous version of a file or the new one, never a torn one:

* one file: :func:`atomic_write` (and ``_bytes`` / ``_text`` / ``_json``);
* a whole folder under a temporary name, renamed into place: :func:`atomic_dir`, :func:`publish_dir`;
* files staged beside a folder that already holds others (a run folder receiving its exported model):
  :func:`staging_dir`, then :func:`move_into`, the completion marker last;
* JSON lines: :func:`append_jsonl`, :func:`read_jsonl`, :func:`truncate_jsonl` (a resumed run drops what a
  killed one wrote past its checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from cast_llm.errors import CastError

__all__ = ["RunDir", "FILE_MODE", "cache_dir", "sha256_file", "fsync_path", "atomic_write", "atomic_write_bytes",
           "atomic_write_text", "atomic_write_json", "atomic_dir", "publish_dir", "staging_dir", "move_into",
           "append_jsonl", "read_jsonl", "truncate_jsonl", "read_json", "read_json_object", "umask_mode",
           "is_plain_name", "remove_entry", "resolved", "overlap", "pretrained_kwargs"]

FILE_MODE = 0o644  # the mode of a file under the usual umask 022 (files get 0o666 & ~umask: umask_mode)


def cache_dir() -> Path:
    """Where cast-llm keeps what it derives once (converted models, the decompressed WikiText-2, token caches):
    ``$CAST_LLM_CACHE``, else ``$XDG_CACHE_HOME/cast-llm``, else ``~/.cache/cast-llm``."""
    env = os.environ.get("CAST_LLM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"  # XDG: ignore relative
    return base / "cast-llm"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """Flush a file (or a folder entry, where the OS allows it) to disk."""
    path = Path(path)
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on folders
        pass
    finally:
        os.close(fd)


def umask_mode(base: int = 0o666) -> int:
    """The mode a new file gets from ``open()`` under this process's umask (``base & ~umask``): what a user
    expects of a model or log file, where ``mkstemp`` alone would give 0600."""
    try:  # Linux: read it without changing it (os.umask is process-wide and racy between threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return base & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any], *, mode: int | None = None) -> Path:
    """Create or replace ``path`` with what ``write(f)`` writes to a binary file object; all or nothing.

    The temporary file comes from ``mkstemp`` beside ``path`` (a fresh name opened with ``O_EXCL``: a link
    planted under a predictable name is never followed), its mode from the umask unless ``mode`` says
    otherwise; the rename replaces a link at ``path`` itself, never its target. On any error (a full disk,
    ``write`` raising) the temporary file is removed and ``path`` is left as it was; the error propagates.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), umask_mode() if mode is None else mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: str | Path, default: Any = None) -> Any:
    """A JSON file's content, or ``default`` when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):  # (a UnicodeDecodeError is a ValueError)
        return {} if default is None else default


MAX_JSON_BYTES = 256 << 20  # no JSON file the tool reads comes near this; a larger one is not ours


def read_json_object(path: str | Path, what: str, *, fix: str = "") -> dict[str, Any]:
    """The JSON object in the file ``path``, or a one-line :class:`~cast_llm.errors.CastError` naming the file,
    ``what`` it should be (``"the model's config"``) and what is wrong: missing, not a regular file, larger
    than :data:`MAX_JSON_BYTES`, not UTF-8, not JSON, or JSON that is not an object. ``fix`` is appended
    (``"; pass another --model"``)."""
    p = Path(path)
    fix = f"; {fix}" if fix else ""
    try:
        st = p.stat()
        if not p.is_file():
            raise CastError(f"{p} ({what}) is not a regular file{fix}")
        if st.st_size > MAX_JSON_BYTES:
            raise CastError(f"{p} ({what}) is {st.st_size:,} bytes, too large for a JSON file{fix}")
        obj = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CastError(f"{p} ({what}) not found{fix}") from None
    except OSError as e:
        raise CastError(f"{p} ({what}) cannot be read: {e.strerror or e}{fix}") from None
    except UnicodeDecodeError as e:
        raise CastError(f"{p} ({what}) is not UTF-8 text (byte {e.start}){fix}") from None
    except (json.JSONDecodeError, RecursionError) as e:
        where = f": {e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise CastError(f"{p} ({what}) is not valid JSON{where}{fix}") from None
    if not isinstance(obj, dict):
        raise CastError(f"{p} ({what}) holds a JSON {type(obj).__name__}, not an object{fix}")
    return obj


def pretrained_kwargs(**kwargs) -> dict:
    """The keyword arguments of every ``from_pretrained`` of the package: ``kwargs`` with
    ``trust_remote_code=False``, so that no code from a model folder or hub repository ever runs (transformers
    then refuses such a model at once instead of asking "run custom code? [y/N]"). Here, below every user of
    it (deploy, models, plan), so that each imports it from one place."""
    return {**kwargs, "trust_remote_code": False}


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` (read from a marker file) names an entry directly inside a folder: a non-empty string
    with no separator, not ``.`` or ``..``, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and os.sep not in name and (os.altsep is None or os.altsep not in name))


def remove_entry(folder: str | Path, name: str) -> bool:
    """Remove the entry ``name`` (a plain name, :func:`is_plain_name`) of ``folder`` without following a link:
    a link is unlinked (its target untouched), a real folder removed with what it holds (``rmtree`` does not
    follow links inside), a file unlinked. False when there was nothing."""
    if not is_plain_name(name):
        raise ValueError(f"not a plain name: {name!r}")
    p = Path(folder) / name
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(p)
    else:
        p.unlink()
    return True


def resolved(path: str | Path) -> Path:
    """``path`` absolute with every link resolved (what it really names, existing or not)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def overlap(a: str | Path, b: str | Path) -> str | None:
    """How the paths ``a`` and ``b`` overlap once resolved: ``"is"`` (the same), ``"is inside"`` (``a`` within
    ``b``), ``"contains"`` (``b`` within ``a``); None when apart."""
    ra, rb = resolved(a), resolved(b)
    if ra == rb:
        return "is"
    if rb in ra.parents:
        return "is inside"
    if ra in rb.parents:
        return "contains"
    return None


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to ``final`` only when the block succeeds.

    Yields the temporary folder (``final`` + ``.tmp``); every file in it is fsynced before the rename. If the
    block raises, the temporary folder is removed and ``final`` is untouched. An existing ``final`` is
    replaced only with ``replace=True`` (:func:`publish_dir`).
    """
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        publish_dir(tmp, final, replace=replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_dir(tmp: str | Path, final: str | Path, *, replace: bool = False) -> Path:
    """Rename the complete folder ``tmp`` to ``final`` (same filesystem) and sync the parent folder.

    An existing ``final`` raises :class:`FileExistsError` (``tmp`` is left for the caller), unless
    ``replace=True``: then it is moved aside, the new folder renamed into place, and the old one removed.
    """
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        if not replace:
            raise FileExistsError(f"{final} exists")
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)
    return final


@contextlib.contextmanager
def staging_dir(beside: str | Path, *, prefix: str) -> Iterator[Path]:
    """A private temporary folder next to ``beside`` (on its filesystem, so that what is built in it can be
    renamed into place), created with its parents and always removed at the end of the block.

    Its name carries this host and process id (``PREFIX<host>-<pid>-…``); a process killed before the end of
    the block (SIGKILL, a power cut) leaves its folder behind, and the next staging folder made beside it
    with the same prefix removes it — only folders of this host whose process is gone, never another's."""
    beside = Path(beside)
    beside.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(beside.parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{_host()}-{os.getpid()}-", dir=beside.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _host() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_stale_staging(folder: str | Path, prefix: str) -> list[Path]:
    """Remove the staging folders in ``folder`` that :func:`staging_dir` made with ``prefix`` on this host for
    processes that no longer exist (what a killed run left); returns them."""
    pattern = re.compile(re.escape(f"{prefix}{_host()}-") + r"(\d+)-")
    removed = []
    for p in Path(folder).glob(f"{prefix}{_host()}-*"):
        match = pattern.match(p.name)
        if match and p.is_dir() and not _alive(int(match.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def move_into(src: str | Path, dst: str | Path, *, last: str | None = None) -> list[str]:
    """Move every file of ``src`` into ``dst`` (each move an atomic rename, mode from the umask); returns
    their names.

    ``last`` names a completion marker: any older copy in ``dst`` is removed first and the new one is moved
    last, so a folder whose move was interrupted never carries a marker and cannot be taken for complete.
    """
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if last is not None:
        (dst / last).unlink(missing_ok=True)
    files = sorted(p for p in src.iterdir() if p.name != last)
    moved = []
    for f in files + ([src / last] if last is not None else []):
        if f.exists():
            if f.is_file() and not f.is_symlink():
                os.chmod(f, umask_mode())
            os.replace(f, dst / f.name)
            moved.append(f.name)
    fsync_path(dst)
    return moved


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record; the file is opened without following a link (``O_NOFOLLOW``: a link planted under
    the name in a run folder is refused, never written through)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CastError(f"{path} is a link: cast-llm never writes through a link planted in its folder; "
                            "remove it") from None
        raise
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (a torn last line, from a killed writer, is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def truncate_jsonl(path: str | Path, keep_through: int) -> None:
    """Keep only the records with ``step <= keep_through`` (a resumed run writes the later ones again)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_jsonl(path) if r.get("step", 0) <= keep_through]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


class RunDir:
    """The file names of a run folder (``--output-dir`` of ``cast-llm train`` / ``finetune``), in one place for
    the trainer that writes them and every reader (report, scaling law, analysis, benchmarks, the GPU kit)::

        run = RunDir("runs/smollm2-cpu")
        read_json(run.results), read_jsonl(run.metrics)

    Names only: nothing is read or created here."""

    MARKER = "cast_run.json"  # the run's marker: kind, config, and every file it wrote
    CONFIG = "config.yaml"
    METRICS = "metrics.jsonl"
    RESULTS = "results.json"
    TENSORBOARD = "tensorboard"
    CHECKPOINTS = "checkpoints"
    LAYERS = "layers.jsonl"  # per-layer statistics (analysis)
    DYNAMICS = "dynamics.json"
    RATIO_HIST = "ratio_hist.npz"
    REPORT = "report.html"
    REPORT_ASSETS = "report"
    LOCK = ".cast-llm.lock"
    EXPORT_MARKER = "cast_llm.json"  # the exported model's own marker (its files)
    CHECKPOINT_META = "meta.json"  # in every complete checkpoint folder (CHECKPOINTS/step-N): fingerprint, checksums
    # what every run writes besides the exported model (always its own)
    OWN = (CONFIG, METRICS, RESULTS, TENSORBOARD, CHECKPOINTS, LAYERS, DYNAMICS, RATIO_HIST, REPORT, REPORT_ASSETS)

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    marker = property(lambda self: self.path / self.MARKER)
    config = property(lambda self: self.path / self.CONFIG)
    metrics = property(lambda self: self.path / self.METRICS)
    results = property(lambda self: self.path / self.RESULTS)
    tensorboard = property(lambda self: self.path / self.TENSORBOARD)
    checkpoints = property(lambda self: self.path / self.CHECKPOINTS)
    layers = property(lambda self: self.path / self.LAYERS)
    dynamics = property(lambda self: self.path / self.DYNAMICS)
    ratio_hist = property(lambda self: self.path / self.RATIO_HIST)
    report = property(lambda self: self.path / self.REPORT)
    lock = property(lambda self: self.path / self.LOCK)
    export_marker = property(lambda self: self.path / self.EXPORT_MARKER)
