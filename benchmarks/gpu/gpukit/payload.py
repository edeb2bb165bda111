"""The preparation, on this machine (``prepare.sh``): what the GPU machine lacks — the wheels of the missing
pure-Python dependencies, the embedded SmolLM2-135M GGUF in parts, the embedded corpus, the WikiText-2 test
file — assigned to device calls so that each call's payload stays under the device's 64 MiB, written to the
ignored folder ``.gpu/`` (one folder per call, each with ``manifest.json``), and the exact device calls."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpukit.common import (
    GPU_DIR,
    KIT_VERSION,
    MANIFEST_RESERVE,
    PAYLOAD_LIMIT,
    REPO,
    RUN_SH,
    TREE_MARGIN,
    MiB,
    emit_json,
    human,
    now,
    sha256_file,
)
from gpukit.image import (
    EXTRA_NEEDS,
    IMAGE_PACKAGES,
    WHEEL_PLATFORMS,
    WHEELS,
    classify_imports,
    dist_name,
    third_party_imports,
)
from gpukit.stages.perf import PERF_TABLE


@dataclass
class Item:
    """One file to carry: ``role`` model / corpus / wikitext / wheel; ``dest`` relative to the kit folder."""

    role: str
    source: Path
    dest: str
    split: bool = False
    stub_package: str | None = None
    size: int = 0


def split_sizes(size: int, capacity: int) -> list[int]:
    """Near-equal part sizes, each at most ``capacity``."""
    n = max(1, -(-size // capacity))
    base, extra = divmod(size, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def plan_calls(items: list[Item], tree_bytes: int, *, limit: int = PAYLOAD_LIMIT, margin: int = TREE_MARGIN,
               part_bytes: int | None = None) -> list[dict]:
    """Assign every file (split ones as parts) to device calls so that each call's payload — the working tree,
    a margin for its growth, the manifest and the carried files — stays under ``limit``. Returns the calls:
    ``{"call": k, "parts": [{"item": i, "part": j, "offset", "size"}], "carried_bytes", "payload_bytes"}``."""
    capacity = limit - tree_bytes - margin - MANIFEST_RESERVE
    if capacity < MiB:
        raise ValueError(f"the working tree ({human(tree_bytes)}) leaves no room under {human(limit)} per call: "
                         "carry less or ignore large untracked files")
    if part_bytes:
        capacity = min(capacity, part_bytes)
    pieces = []  # (size, item index, part index, offset)
    for i, it in enumerate(items):
        if it.size > capacity and not it.split:
            raise ValueError(f"{it.source} ({human(it.size)}) does not fit one call and is not splittable")
        sizes = split_sizes(it.size, capacity) if it.split else [it.size]
        off = 0
        for j, s in enumerate(sizes):
            pieces.append((s, i, j, off))
            off += s
    calls: list[dict] = []
    for s, i, j, off in sorted(pieces, key=lambda p: (-p[0], p[1], p[2])):  # first fit, largest first
        for c in calls:
            if c["carried_bytes"] + s <= capacity:
                break
        else:
            c = {"call": len(calls) + 1, "parts": [], "carried_bytes": 0}
            calls.append(c)
        c["parts"].append({"item": i, "part": j, "offset": off, "size": s})
        c["carried_bytes"] += s
    for c in calls:
        c["parts"].sort(key=lambda p: (p["item"], p["part"]))
        c["payload_bytes"] = tree_bytes + c["carried_bytes"] + MANIFEST_RESERVE
    return calls


def write_parts(path: Path, pieces: list[tuple[Path, int, int]]) -> list[str]:
    """Copy byte ranges ``(dest, offset, size)`` of ``path`` into part files; returns their sha256."""
    shas = []
    with path.open("rb") as f:
        for dest, off, size in pieces:
            f.seek(off)
            h = hashlib.sha256()
            dest.parent.mkdir(parents=True, exist_ok=True)
            with dest.open("wb") as g:
                left = size
                while left:
                    b = f.read(min(left, 4 * MiB))
                    if not b:
                        raise OSError(f"{path} ended early")
                    h.update(b)
                    g.write(b)
                    left -= len(b)
            shas.append(h.hexdigest())
    return shas


def assemble(parts: list[Path], dest: Path, sha256: str, part_shas: list[str] | None = None) -> None:
    """Concatenate ``parts`` into ``dest`` (atomically) and verify every sha256; raise ValueError otherwise."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    h = hashlib.sha256()
    with tmp.open("wb") as g:
        for k, p in enumerate(parts):
            hp = hashlib.sha256()
            with p.open("rb") as f:
                while True:
                    b = f.read(4 * MiB)
                    if not b:
                        break
                    h.update(b)
                    hp.update(b)
                    g.write(b)
            if part_shas is not None and hp.hexdigest() != part_shas[k]:
                tmp.unlink(missing_ok=True)
                raise ValueError(f"{p.name}: sha256 {hp.hexdigest()[:12]}…, expected {part_shas[k][:12]}…")
    if h.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{dest.name}: reassembled sha256 {h.hexdigest()[:12]}…, expected {sha256[:12]}…")
    os.replace(tmp, dest)


def tree_bytes(root: Path = REPO) -> int:
    """Bytes of what a device call sends besides the carried paths: tracked and untracked-not-ignored files
    (``git ls-files -co --exclude-standard``) and a ``shared/`` folder inside the checkout."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    total = 0
    for n in names:
        p = root / n
        if n and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    shared = root / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file())
    return total


def source_items() -> list[Item]:
    """What the GPU machine lacks, found through the project's own resolution (never importing the embedded
    packages): the embedded model's GGUF, the embedded corpus, and the WikiText-2 file unless it travels with
    the working tree (packaged with cast_llm)."""
    sys.path.insert(0, str(REPO / "src"))
    from cast_llm.data import EMBEDDED_CORPORA, embedded_file
    from cast_llm.eval import ppl
    from cast_llm.models import ALIASES, embedded_gguf

    model = ALIASES["smollm2-135m"]
    corpus_pkg, corpus_rel, _ = EMBEDDED_CORPORA["wiki-summaries"]
    items = [Item("model", embedded_gguf("smollm2-135m"), f"pkgs/{model.package}/{model.filename}", split=True,
                  stub_package=model.package),
             Item("corpus", embedded_file("wiki-summaries"), f"pkgs/{corpus_pkg}/{corpus_rel}",
                  stub_package=corpus_pkg)]
    wiki = None
    if hasattr(ppl, "wikitext2_source"):  # packaged with cast_llm: it travels with src/ (nothing to carry)
        src = ppl.wikitext2_source()
        wiki = None if src.origin == "packaged" else src.path
    else:
        wiki = ppl.wikitext2_file()
        if wiki is None:
            raise SystemExit("prepare: no WikiText-2 test file found (set CAST_WIKITEXT2)")
    if wiki is not None and REPO not in Path(wiki).resolve().parents:
        items.append(Item("wikitext", Path(wiki).resolve(), "data/wikitext-2-raw/test.txt"))
    return items


def download_wheels(dest: Path) -> list[Path]:
    """The pinned wheels (pure Python, for the device's CPython 3.12 on x86-64), fetched once."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for dist, version in WHEELS.items():
        stem = dist.replace("-", "_")
        have = sorted(dest.glob(f"{stem}-{version}-*.whl"))
        if not have:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                   "3.12", "--implementation", "cp", "-d", str(dest), f"{dist}=={version}"]
            for plat in WHEEL_PLATFORMS:
                cmd[6:6] = ["--platform", plat]
            subprocess.run(cmd, check=True)
            have = sorted(dest.glob(f"{stem}-{version}-*.whl"))
        if len(have) != 1:
            raise SystemExit(f"prepare: expected one wheel of {dist}=={version} in {dest}, found {have}")
        out.append(have[0])
    return out


def wheel_requirements(whl: Path) -> list[str]:
    """Distribution names a wheel requires (its METADATA's Requires-Dist, without extras' lines)."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            spec = line.split(":", 1)[1].strip()
            if "extra ==" in spec.replace("extra==", "extra =="):
                continue
            reqs.append(re.split(r"[ ;<>=!~\[(]", spec, maxsplit=1)[0].lower().replace("_", "-"))
    return reqs


def git_source(root: Path = REPO) -> dict:
    def git(*a):
        r = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def device_commands(n_calls: int) -> tuple[list[str], str]:
    """The command of each carrying call and of the calls after them. The first call measures issue 21's
    targets (the stage ``perf``) before anything else; its steps that need the SmolLM2-135M weights (which take
    more than one call to arrive) wait for the call that completes them, which carries on with the correctness
    checks and, in the last carrying call, the comparison as far as its time allows. The calls after those
    repeat ``perf correctness quality``: finished steps are skipped, deferred ones run."""
    last = f"{RUN_SH} setup perf correctness quality"
    if n_calls <= 1:
        return [last], f"{RUN_SH} perf correctness quality"
    middle = [f"{RUN_SH} setup perf correctness"] * (n_calls - 2)
    return [f"{RUN_SH} setup perf", *middle, last], f"{RUN_SH} perf correctness quality"


def prepare(gpu_dir: Path, items: list[Item], *, tree: int, part_bytes: int | None = None,
            source: dict | None = None) -> dict:
    """Write ``gpu_dir/callK/`` (parts + manifest.json) and ``gpu_dir/manifest.json``; return the manifest."""
    for it in items:
        it.size = it.source.stat().st_size
    calls = plan_calls(items, tree, part_bytes=part_bytes)
    shas = {i: sha256_file(it.source) for i, it in enumerate(items)}
    files = []
    for i, it in enumerate(items):
        files.append({"name": it.source.name, "role": it.role, "size": it.size, "sha256": shas[i], "dest": it.dest,
                      "stub_package": it.stub_package, "parts": []})
    n_parts = {i: sum(1 for c in calls for p in c["parts"] if p["item"] == i) for i in range(len(items))}
    for old in gpu_dir.glob("call*"):
        if old.is_dir():
            shutil.rmtree(old)
    for c in calls:
        folder = gpu_dir / f"call{c['call']}"
        for p in c["parts"]:
            it = items[p["item"]]
            name = (f"{it.role}--{it.source.name}.part{p['part'] + 1}-of-{n_parts[p['item']]}" if it.split
                    else f"{it.role}--{it.source.name}")
            (sha,) = write_parts(it.source, [(folder / name, p["offset"], p["size"])])
            files[p["item"]]["parts"].append({"file": name, "size": p["size"], "sha256": sha, "call": c["call"],
                                              "index": p["part"]})
    for f in files:
        f["parts"].sort(key=lambda p: p["index"])
    commands, after = device_commands(len(calls))
    manifest = {
        "kit": KIT_VERSION, "created": now(), "source": source or {},
        "id": hashlib.sha256("".join(sorted(shas.values())).encode()).hexdigest()[:16],
        "limit_bytes": PAYLOAD_LIMIT, "tree_bytes": tree, "margin_bytes": TREE_MARGIN, "files": files,
        "calls": [{"call": c["call"], "carry": [f"{GPU_DIR}/call{c['call']}"], "command": commands[k],
                   "carried_bytes": c["carried_bytes"], "payload_bytes": c["payload_bytes"],
                   "files": [f"{items[p['item']].role}:{p['part'] + 1}" for p in c["parts"]]}
                  for k, c in enumerate(calls)],
        "after": {"command": after, "carry": []},
    }
    text = json.dumps(manifest, indent=2)
    for c in calls:
        (gpu_dir / f"call{c['call']}" / "manifest.json").write_text(text)
    (gpu_dir / "manifest.json").write_text(text)
    return manifest


def format_plan(manifest: dict) -> str:
    lines = ["", "GPU kit: the device calls to make, in order, back to back (a machine stays warm only ~30 s "
             "after a call; its disk, where the kit keeps everything, goes with it). Before call 1, write each "
             "predicted figure in docs/results/gpu/notes.md (the summary prints it beside the measurement):", ""]
    for c in manifest["calls"]:
        lines.append(f"  call {c['call']}: run(command={c['command']!r}, carry={c['carry']!r}, timeout_s=600)")
        lines.append(f"          payload ~{human(c['payload_bytes'])} = working tree {human(manifest['tree_bytes'])}"
                     f" + carried {human(c['carried_bytes'])} + manifest (limit {human(manifest['limit_bytes'])}; "
                     f"{human(manifest['margin_bytes'])} kept for the tree's growth); holds "
                     + ", ".join(c["files"]))
    a = manifest["after"]
    lines += [f"  then:   run(command={a['command'] + ' --session-left-s N'!r}, carry={a['carry']!r}, timeout_s=600)",
              "          repeated while its summary says 'pending' (N = budget_left_s of the device's status: it "
              "sizes the comparison; without it the kit assumes a 30-minute session that began with call 1)", "",
              "  Call 1 measures every target of issue 21 that needs no model weights (stage perf, one call of at "
              "most 10 minutes); a perf step that needs SmolLM2-135M's weights runs in the call that completes "
              "them. Each call prints what it measured and the next call to make. If a call answers that parts "
              "are missing (a fresh machine), carry them again as listed. After each call, here: "
              "python benchmarks/gpu/kit.py record FILES_AT (merges the call's files into docs/results/gpu/, "
              "docs/gpu.md)."]
    return "\n".join(lines)


def cmd_prepare(args) -> int:
    gpu_dir = REPO / GPU_DIR
    probe = subprocess.run(["git", "check-ignore", "-q", f"{GPU_DIR}/call1/x"], cwd=REPO)
    if probe.returncode != 0:
        print(f"prepare: {GPU_DIR}/ is not ignored by git: it would travel with every call (add it to "
              ".gitignore)", file=sys.stderr)
        return 2
    items = source_items()
    wheels = download_wheels(gpu_dir / "wheels") if not args.no_download else sorted((gpu_dir / "wheels").glob("*.whl"))
    for w in wheels:
        missing = [r for r in wheel_requirements(w) if r not in IMAGE_PACKAGES
                   and r not in {dist_name(x) for x in WHEELS}]
        if missing:
            print(f"prepare: {w.name} requires {missing}, which the GPU image lacks: add them to WHEELS",
                  file=sys.stderr)
            return 2
        items.append(Item("wheel", w, f"wheels/{w.name}"))
    found = classify_imports(third_party_imports())
    if found["missing"]:
        print(f"prepare: the stages import {found['missing']}, which the GPU image lacks and the kit does not "
              "carry: add them to WHEELS (or to NOT_CARRIED, with the reason)", file=sys.stderr)
        return 2
    absent = [f"benchmarks/{b.script}" for b in PERF_TABLE if not (REPO / "benchmarks" / b.script).is_file()]
    if absent:  # the calls go on without them (their steps fail and say why), but better to know now
        print(f"prepare: warning: the perf stage's {', '.join(absent)} missing: those steps will fail on the GPU "
              "(gpukit/stages/perf.py, PERF_TABLE)", file=sys.stderr)
    tree = tree_bytes()
    manifest = prepare(gpu_dir, items, tree=tree, part_bytes=args.part_mib * MiB if args.part_mib else None,
                       source=git_source())
    print(f"prepared {gpu_dir}/ (manifest {manifest['id']}): "
          + "; ".join(f"{f['role']} {f['name']} {human(f['size'])} sha256 {f['sha256'][:12]}… in "
                      f"{len(f['parts'])} part(s)" for f in manifest["files"]))
    print(f"third-party imports of the stages: {len(found['image'])} in the GPU image; carried as wheels: "
          + ", ".join(f"{d}=={v}" + (f" ({EXTRA_NEEDS[d]})" if d in EXTRA_NEEDS else "") for d, v in WHEELS.items())
          + f"; not carried (only inside functions no stage calls): {', '.join(found['not_carried'])}")
    print(format_plan(manifest))
    if args.json:
        emit_json(manifest)
    return 0
