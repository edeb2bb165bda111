"""WikiText-2 inside the product: the packaged copy, its checksum and licence, and the resolution order
(an explicit file, then $CAST_WIKITEXT2, then the packaged copy; nothing else)."""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import stat
from importlib import resources
from pathlib import Path

import pytest

from cast_llm.errors import CastError
from cast_llm.eval import ppl
from cast_llm.eval.ppl import (
    WIKITEXT2_RESOURCE,
    WIKITEXT2_SHA256,
    describe_wikitext2,
    packaged_wikitext2_file,
    wikitext2_file,
    wikitext2_source,
    wikitext2_text,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "cast_llm" / "resources" / "wikitext2"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Each test gets its own cache folder and no $CAST_WIKITEXT2 from the environment."""
    monkeypatch.setenv("CAST_LLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CAST_WIKITEXT2", raising=False)


@pytest.fixture(scope="module")
def packaged_bytes() -> bytes:
    return gzip.decompress(resources.files("cast_llm").joinpath(WIKITEXT2_RESOURCE).read_bytes())


def test_packaged_text_matches_the_checksum_in_the_code_and_the_readme(packaged_bytes):
    digest = hashlib.sha256(packaged_bytes).hexdigest()
    assert digest == WIKITEXT2_SHA256
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"\b[0-9a-f]{64}\b", readme) == [WIKITEXT2_SHA256]


def test_packaged_text_is_what_the_readme_says(packaged_bytes):
    text = packaged_bytes.decode("utf-8")
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    assert f"{len(text):,} characters" in readme and f"{len(packaged_bytes):,} bytes" in readme
    assert f"{text.count(chr(10)):,} lines" in readme
    assert text.startswith("\n\n = Robert Boulter = \n") and "\r" not in text
    assert f"{(DATA / 'test.txt.gz').stat().st_size:,} bytes" in readme


def test_licence_and_provenance_travel_with_the_data():
    licence = (DATA / "LICENSE").read_text(encoding="utf-8")
    assert "Attribution-ShareAlike 3.0" in licence
    assert "https://creativecommons.org/licenses/by-sa/3.0/" in licence
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    assert "Merity" in readme and "CC BY-SA 3.0" in readme and "Share-alike" in readme


def test_pyproject_ships_the_data_in_the_wheel():
    table = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[tool.setuptools.package-data]")[1]
    line = re.search(r"^cast_llm\s*=\s*\[(.*)\]", table, re.M).group(1)  # no tomllib on Python 3.10
    patterns = re.findall(r'"([^"]+)"', line)
    for name in ("test.txt.gz", "README.md", "LICENSE"):
        rel = f"resources/wikitext2/{name}"
        assert any(Path(rel).match(p) for p in patterns), (rel, patterns)
        assert (DATA / name).is_file()


def test_packaged_copy_is_the_default_and_is_decompressed_once(tmp_path, packaged_bytes):
    src = wikitext2_source()
    assert src.origin == "packaged" and src.description.startswith(f"packaged copy (sha256 {WIKITEXT2_SHA256[:12]}")
    assert src.path.parent == tmp_path / "cache" / "data"
    assert src.path.read_bytes() == packaged_bytes
    assert stat.S_IMODE(src.path.stat().st_mode) == 0o644
    mtime = src.path.stat().st_mtime_ns
    assert wikitext2_file() == src.path and src.path.stat().st_mtime_ns == mtime  # reused, not rewritten
    assert wikitext2_text() == packaged_bytes.decode("utf-8")
    assert not [p for p in src.path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_damaged_cache_file_is_rewritten(packaged_bytes):
    path = packaged_wikitext2_file()
    path.write_text("truncated", encoding="utf-8")
    assert packaged_wikitext2_file() == path and path.read_bytes() == packaged_bytes


def test_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("CAST_LLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wikitext2_file().parent == tmp_path / "xdg" / "cast-llm" / "data"


def test_unwritable_cache_falls_back_to_the_temporary_folder(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("CAST_LLM_CACHE", str(blocker))  # mkdir below a file fails
    monkeypatch.setattr(ppl.tempfile, "tempdir", str(tmp_path / "tmp"))
    path = wikitext2_file()
    assert path.is_relative_to(tmp_path / "tmp") and hashlib.sha256(path.read_bytes()).hexdigest() == WIKITEXT2_SHA256


def test_resolution_order_explicit_then_env_then_packaged(monkeypatch, tmp_path):
    env_file, explicit = tmp_path / "env.txt", tmp_path / "explicit.txt"
    env_file.write_text("from the environment", encoding="utf-8")
    explicit.write_text("given explicitly", encoding="utf-8")
    assert wikitext2_source().origin == "packaged"
    monkeypatch.setenv("CAST_WIKITEXT2", str(env_file))
    assert wikitext2_text() == "from the environment"
    assert describe_wikitext2() == f"$CAST_WIKITEXT2={env_file}"
    assert wikitext2_text(explicit) == "given explicitly" and describe_wikitext2(explicit) == str(explicit)
    assert wikitext2_source(str(explicit)).origin == "file"


@pytest.mark.parametrize("where", ["explicit", "env"])
def test_a_missing_file_is_an_error_not_a_silent_fallback(monkeypatch, tmp_path, where):
    missing = tmp_path / "nope.txt"
    if where == "env":
        monkeypatch.setenv("CAST_WIKITEXT2", str(missing))
    with pytest.raises(CastError) as e:
        wikitext2_source(missing if where == "explicit" else None)
    msg = str(e.value)
    assert "\n" not in msg and str(missing) in msg
    assert ("CAST_WIKITEXT2" in msg) and ("packaged" in msg)


def test_a_corrupt_package_copy_is_refused(monkeypatch):
    monkeypatch.setattr(ppl, "WIKITEXT2_SHA256", "0" * 64)
    with pytest.raises(CastError, match="reinstall cast-llm"):
        wikitext2_source()


def test_no_code_looks_outside_the_install():
    for rel in ("eval/ppl.py", "cli/eval_ppl.py", "models/loading.py"):
        src = (ROOT / "src" / "cast_llm" / rel).read_text(encoding="utf-8")
        assert "shared/" not in src and "SHARED_WIKITEXT" not in src, rel
        assert not re.search(r"parents\[\d\]", src), rel
        assert "load_dataset" not in src, rel  # WikiText-2 is never fetched from a hub


def test_the_packaged_copy_needs_no_network(monkeypatch):
    import socket

    def refuse(*a, **k):
        raise AssertionError("network access while resolving WikiText-2")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert os.path.getsize(wikitext2_file()) == 1_296_370


def test_no_file_of_the_project_points_outside_the_repository():
    """The product is self-contained: no code, doc, --help text or script names a path beside the checkout
    (the development machine keeps reference material in a folder next to it; users do not have it)."""
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    pattern = re.compile(r"\.\./shared|/shared/(docs|data)|work/shared")
    offenders = []
    for rel in files:
        path = ROOT / rel
        if rel.startswith("tests/") or not path.is_file() or path.suffix in (".png", ".gz", ".safetensors"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{rel}:{n}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not offenders, "paths outside the repository: " + ", ".join(offenders[:20])
