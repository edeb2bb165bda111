"""Files the tool writes: atomically (a temporary file, fsync, rename), with checksums, and JSON lines.

Every writer of the package goes through these, so that a run killed at any instant — ``kill -9``, a full
disk, a node that dies — leaves either the previous version of a file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["sha256_file", "fsync_path", "atomic_write", "atomic_write_bytes", "atomic_write_text",
           "atomic_write_json", "atomic_dir", "append_jsonl", "read_jsonl", "truncate_jsonl", "read_json"]

FILE_MODE = 0o644  # what a user expects of a model or log file (mkstemp would give 0600)


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


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any], *, mode: int = FILE_MODE) -> Path:
    """Create or replace ``path`` with what ``write(f)`` writes to a binary file object; all or nothing.

    On any error (a full disk, ``write`` raising) the temporary file is removed and ``path`` is left as it
    was; the error propagates.
    """
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
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
    except (OSError, json.JSONDecodeError):
        return {} if default is None else default


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it to ``final`` only when the block succeeds.

    Yields the temporary folder (``final`` + ``.tmp``); every file in it is fsynced before the rename. If the
    block raises, the temporary folder is removed and ``final`` is untouched. An existing ``final`` is
    replaced only with ``replace=True`` (it is removed after the new one is complete, then renamed over).
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    with Path(path).open("a") as f:
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
