"""The GPU kit (issue 16): prepare here, then validate and measure everything GPU-only inside one lent session.

A lent GPU machine reaches no package registry, receives at most 64 MiB per call (working tree + carried
paths), runs each command for at most 10 minutes and keeps its disk only while it stays warm between calls.
This module does both halves (``docs/gpu.md`` is the user guide):

* ``prepare`` (this machine, ``benchmarks/gpu/prepare.sh``): fills the ignored folder ``.gpu/`` with what the
  GPU image lacks — the wheels of the missing pure-Python dependencies (for its Python 3.12), the embedded
  SmolLM2-135M GGUF split into parts, the embedded corpus and the WikiText-2 test file — one folder per device
  call (``.gpu/call1``, ``.gpu/call2``, …, each with ``manifest.json``), and prints the exact device calls
  (``command`` and ``carry`` of each) with each call's payload against the 64 MiB limit.
* ``run STAGE …`` (the GPU machine, ``benchmarks/gpu/run.sh``): stages in order of value — ``setup`` (0),
  ``correctness`` (1), ``speed`` (2), ``quality`` (3). Every stage is a list of steps; a step that finished is
  not run again (state in the kit folder on that machine's disk, ``$HOME/cast-kit``), a step that needs what
  has not arrived yet waits, and a step that would not end inside this call's budget is deferred, so the next
  call carries on. Each call writes at most 8 files under ``$OUT``: ``versions.json``, ``results.json`` and
  ``summary.md`` (everything measured so far, each target against its goal), this call's log, and the
  comparison's table and chart.

``--device cpu`` runs every stage's logic on a tiny model (the dry run of ``tests/test_gpu_kit.py``).
Only the standard library is imported at module level: the kit runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import hashlib
import importlib
import io
import json
import os
import platform
import re
import runpy
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIT_VERSION = 1
MiB = 1 << 20

# ---------------------------------------------------------------------------------------- the device's limits
PAYLOAD_LIMIT = 64 * MiB  # working tree (tracked + untracked-not-ignored) + carried paths, per call
TREE_MARGIN = 4 * MiB  # the working tree may grow between `prepare` and the calls
MANIFEST_RESERVE = 256 * 1024  # manifest.json in every call folder
CALL_LIMIT_S = 600  # one command's limit
CALL_BUDGET_S = 540  # the kit starts no work after this many seconds of a call (run.sh kills at 585 s)
SESSION_DEVICE_S = 1800  # device time of a developer's session (30 min)
START_COST_S = 150  # device time spent before the kit's first call starts (the machine's start, transfers)
MAX_OUT_FILES = 8  # files that come back from $OUT
GPU_DIR = ".gpu"  # ignored (.gitignore); what the calls carry

# ------------------------------------------------------------------- what the GPU image holds (KINDS.md)
# The Python packages of the device image 'cuda' (nvidia-h100-x1, nvidia-h200) as KINDS.md lists them, read on a
# machine running it on IMAGE_DATE. Update both together when KINDS.md changes.
IMAGE_DATE = "2026-11-17"
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# versions KINDS.md reports (pip list seen in sessions, 2026-11): checked and recorded by `setup`, never required
IMAGE_VERSIONS = {"python": "3.12.3", "torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0",
                  "triton": "3.6.0", "safetensors": "0.8.0", "tokenizers": "0.23.2", "numpy": "2.5.2"}
# What the stages need and the image lacks, carried as wheels (distribution -> pinned version; the version the
# project's tests run with here). Pure Python: one py3-none-any wheel each.
WHEELS = {"gguf": "0.19.0"}
# needed at run time without an import in our code: transformers reads GGUF files through `gguf`
EXTRA_NEEDS = {"gguf": "transformers' GGUF loader: setup converts the embedded SmolLM2-135M GGUF once"}
# third-party imports in reachable code that no stage executes (all inside functions): not carried
NOT_CARRIED = {
    "datasets": "only for --data hf:… and finetune datasets; the stages use the embedded corpus (wiki-summaries) "
                "and a WikiText-2 file",
    "lm_eval": "only `cast-llm eval zeroshot`, which no stage runs",
    "compressed_tensors": "only the compressed-tensors export and its tests (pytest.importorskip: skipped there)",
}
# import name -> distribution name, where they differ beyond '_' vs '-'
IMPORT_TO_DIST = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "cv2": "opencv-python-headless",
                  "google": "protobuf", "_pytest": "pytest", "pkg_resources": "setuptools", "attr": "attrs",
                  "dateutil": "python-dateutil", "lm_eval": "lm-eval"}
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                   "manylinux1_x86_64")

# ------------------------------------------------------------------------------------- issue 16's targets
TARGETS = {
    "adams_over_fused": ("fused AdamS step / AdamW(fused=True)", "<=", 1.10),
    "adams_copy_fraction": ("fused AdamS bytes moved / copy bandwidth", ">=", 0.80),
    "cast_nokd_over_plain": ("CAST w/o KD whole step / plain AdamW (bf16, SmolLM2-135M)", "<=", 1.05),
    "cast_kd_over_plain": ("CAST with KD whole step / plain AdamW (bf16, SmolLM2-135M)", "<=", 1.40),
    "linear24_prefill_speedup": ("2:4 linear / dense, LLaMA-7B shapes, prefill (slowest shape)", ">=", 1.30),
    "linear24_max_rel_err": ("2:4 linear outputs vs dense: max |Δ| / max |y| (bf16)", "<=", 0.01),
    "cast_sparse_weight_ratio": ("S_t at the end of the GPU-tier CAST rows (decay finished)", ">=", 0.99),
}
# The GPU tier's "cast-best" row takes compare_methods.CAST_BEST (the configuration the CPU-tier comparison chose;
# docs/results/compare-smollm2-135m-cpu-notes.md); `run quality --cast-best "FLAGS"` overrides it (kept in the
# state once chosen). Read lazily: compare_methods imports cast_llm, which the kit's first stage installs.
CAST_BEST_FLAGS: list[str] | None = None
# the GPU tier's rows, in the order they run (the training rows first: they are the answer; the cheap
# references after them). The table keeps compare_methods' order.
QUALITY_ROWS = ["dense", "naive", "naive-sgpt", "srste", "cast", "cast-best", "sparsegpt", "magnitude"]
STAGES = ("setup", "correctness", "speed", "quality")
STAGE_ALIASES = {"0": "setup", "1": "correctness", "2": "speed", "3": "quality"}
JSON_MARK = "KIT-JSON: "


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def sha256_file(path: Path, chunk: int = 4 * MiB) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def human(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def emit_json(obj) -> None:
    """The one line a step's parser reads (the kit's own subcommands end with it)."""
    print(JSON_MARK + json.dumps(obj, default=str), flush=True)


def read_json_mark(text: str):
    for line in reversed(text.splitlines()):
        if line.startswith(JSON_MARK):
            return json.loads(line[len(JSON_MARK):])
    return None


# ============================================================================ imports the stages make (static)
STAGE_ENTRIES = {
    "setup": ["benchmarks/gpu/kit.py", "src/cast_llm/models.py", "src/cast_llm/data.py", "src/cast_llm/eval/ppl.py"],
    "correctness": ["tests/*.py", "src/cast_llm/cli/__init__.py", "src/cast_llm/cli/train.py", "src/cast_llm/export.py"],
    "speed": ["benchmarks/optimizer_step.py", "benchmarks/train_step.py", "src/cast_llm/cli/bench.py",
              "src/cast_llm/deploy/semi_structured.py"],
    "quality": ["benchmarks/compare_methods.py", "src/cast_llm/cli/train.py", "src/cast_llm/cli/prune.py"],
}
_MODULE_STRING = re.compile(r"^cast_llm(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _module_file(name: str, root: Path) -> Path | None:
    """The file of a dotted module under ``root/src`` (a package's ``__init__.py``), else None."""
    base = root / "src" / Path(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports_of(path: Path, root: Path) -> list[tuple[str, bool]]:
    """``(dotted name, lazy)`` of every import in a file (lazy: inside a function), relative ones resolved,
    ``from M import a`` also as ``M.a``, and string constants naming ``cast_llm.*`` modules (dynamic imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = None  # the package relative imports start from (a package's own for its __init__.py)
    src = root / "src"
    if src in path.parents:
        package = ".".join(path.relative_to(src).with_suffix("").parts[:-1])
    out: list[tuple[str, bool]] = []

    def visit(node, lazy: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            inner = lazy or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, ast.Import):
                out.extend((a.name, inner) for a in ch.names)
            elif isinstance(ch, ast.ImportFrom):
                mod = ch.module or ""
                if ch.level and package is not None:
                    base = package.split(".")[: len(package.split(".")) - (ch.level - 1)]
                    mod = ".".join([*base, mod] if mod else base)
                if mod:
                    out.append((mod, inner))
                    out.extend((f"{mod}.{a.name}", inner) for a in ch.names if a.name != "*")
            elif isinstance(ch, ast.Constant) and isinstance(ch.value, str) and _MODULE_STRING.match(ch.value):
                out.append((ch.value, True))
            visit(ch, inner)

    visit(tree, False)
    return out


def third_party_imports(stages=STAGES, root: Path = REPO) -> dict[str, dict]:
    """Every third-party top-level import reachable from the stages' entry files (following our own modules
    through module-level and lazy imports alike): ``{name: {"files": [...], "module_level": bool}}``."""
    std = set(sys.stdlib_module_names) | {"__future__"}
    todo: list[Path] = []
    for stage in stages:
        for pattern in STAGE_ENTRIES[stage]:
            todo += sorted(root.glob(pattern)) if "*" in pattern else [root / pattern]
    seen: set[Path] = set()
    found: dict[str, dict] = {}
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for name, lazy in _imports_of(path, root):
            top = name.split(".")[0]
            if top in std:
                continue
            if top == "cast_llm":
                f = _module_file(name, root)
                if f is not None:
                    todo.append(f)
                continue
            local = [d / f"{top}.py" for d in (path.parent, root / "benchmarks", root / "benchmarks" / "gpu",
                                               root / "tests")]
            hit = next((p for p in local if p.is_file()), None)
            if hit is not None:
                todo.append(hit)
                continue
            entry = found.setdefault(top, {"files": set(), "module_level": False})
            entry["files"].add(str(path.relative_to(root)))
            entry["module_level"] |= not lazy
    return {k: {"files": sorted(v["files"]), "module_level": v["module_level"]} for k, v in sorted(found.items())}


def dist_name(import_name: str) -> str:
    return IMPORT_TO_DIST.get(import_name, import_name).lower().replace("_", "-")


def classify_imports(found: dict[str, dict]) -> dict[str, list[str]]:
    """Each import as ``image`` / ``wheel`` / ``not_carried`` / ``missing`` (the last must stay empty)."""
    wheels = {dist_name(w) for w in WHEELS}
    out: dict[str, list[str]] = {"image": [], "wheel": [], "not_carried": [], "missing": []}
    for name, info in found.items():
        d = dist_name(name)
        if d in IMAGE_PACKAGES:
            out["image"].append(name)
        elif d in wheels:
            out["wheel"].append(name)
        elif name in NOT_CARRIED and not info["module_level"]:
            out["not_carried"].append(name)
        else:
            out["missing"].append(name)
    return out


# ======================================================================================= preparation (here)
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
    from cast_llm.data import EMBEDDED_CORPORA, _embedded_file
    from cast_llm.eval import ppl
    from cast_llm.models import ALIASES, embedded_gguf

    model = ALIASES["smollm2-135m"]
    corpus_pkg, corpus_rel, _ = EMBEDDED_CORPORA["wiki-summaries"]
    items = [Item("model", embedded_gguf("smollm2-135m"), f"pkgs/{model.package}/{model.filename}", split=True,
                  stub_package=model.package),
             Item("corpus", _embedded_file("wiki-summaries"), f"pkgs/{corpus_pkg}/{corpus_rel}",
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
    """The command of each carrying call and of the calls after them. While parts are still arriving, the
    steps that need no model run (CUDA tests, optimizer and 2:4 kernels); the last carrying call completes the
    setup and goes on as far as its time allows, the comparison included."""
    base = "bash benchmarks/gpu/run.sh setup correctness speed"
    return [base] * (n_calls - 1) + [base + " quality"], "bash benchmarks/gpu/run.sh quality"


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
             "after a call; its disk, where the kit keeps everything, goes with it):", ""]
    for c in manifest["calls"]:
        lines.append(f"  call {c['call']}: run(command={c['command']!r}, carry={c['carry']!r}, timeout_s=600)")
        lines.append(f"          payload ~{human(c['payload_bytes'])} = working tree {human(manifest['tree_bytes'])}"
                     f" + carried {human(c['carried_bytes'])} + manifest (limit {human(manifest['limit_bytes'])}; "
                     f"{human(manifest['margin_bytes'])} kept for the tree's growth); holds "
                     + ", ".join(c["files"]))
    a = manifest["after"]
    lines += [f"  then:   run(command={a['command']!r}, carry={a['carry']!r}, timeout_s=600)",
              "          repeated while its summary says 'pending' (add --session-left-s N, N = budget_left_s of the "
              "device's status, for the comparison's budget; without it the kit assumes a 30-minute session that "
              "began with call 1)", "",
              "  Each call prints what it measured and the next call to make. If a call answers that parts are "
              "missing (a fresh machine), carry them again as listed. Results: copy $OUT's files of each call to "
              "docs/results/gpu/ (docs/gpu.md)."]
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


# ================================================================================ the GPU side: a call's run
@dataclass
class Step:
    """One unit of a stage: a command run with the kit's interpreter (``argv`` after it), or ``fn(ctx)``."""

    name: str
    argv: list[str] | None = None
    fn: object = None
    timeout_s: int = 300
    min_s: int = 30  # not started with less time left in the call than this
    needs: tuple[str, ...] = ()  # "model", "corpus", "gguf", "train" (another step's output)
    parse: object = None  # (text, ctx) -> dict; "ok": False in it fails the step
    always: bool = False  # run at every call (cheap bookkeeping), never "done"


@dataclass
class Ctx:
    kit: Path
    out: Path
    device: str
    calls_root: Path
    budget_s: float
    inprocess: bool = False
    model: str = "smollm2-135m"
    data: str = "wiki-summaries"
    session_left_s: float | None = None
    tokens: int | None = None
    rows: list[str] | None = None
    cast_best: list[str] | None = None  # None: compare_methods.CAST_BEST
    redo: bool = False
    retry_failed: bool = False
    only: set[str] | None = None
    argv: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    state: dict = field(default_factory=dict)
    log_path: Path | None = None
    stages: list[str] = field(default_factory=list)

    @property
    def dry(self) -> bool:
        return self.device == "cpu"

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.0f} s] {msg}"
        print(line, flush=True)
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(line + "\n")

    # where things live on the kit's disk
    @property
    def site(self) -> Path:
        return self.kit / "site"

    @property
    def pkgs(self) -> Path:
        return self.kit / "pkgs"

    def wikitext(self) -> Path | None:
        for f in self.manifest().get("files", []):
            if f["role"] == "wikitext" and (self.kit / f["dest"]).is_file():
                return self.kit / f["dest"]
        return None

    def manifest(self) -> dict:
        p = self.kit / "manifest.json"
        return json.loads(p.read_text()) if p.is_file() else {}

    def env(self) -> dict[str, str]:
        """The variables every step runs with (added to the inherited environment)."""
        paths = [str(REPO / "src"), str(self.site), str(self.pkgs)]
        env = {"PYTHONPATH": os.pathsep.join(paths), "CAST_LLM_CACHE": str(self.kit / "cache"),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
        wiki = self.wikitext()
        if wiki is not None:
            env["CAST_WIKITEXT2"] = str(wiki)
        return env

    def ready(self, need: str) -> bool:
        return bool(self.state.get("ready", {}).get(need))

    def set_ready(self, need: str, value) -> None:
        self.state.setdefault("ready", {})[need] = value

    def step_state(self, stage: str, name: str) -> dict:
        return self.state.setdefault("steps", {}).setdefault(f"{stage}/{name}", {})

    def result(self, stage: str, name: str) -> dict:
        return self.state.get("steps", {}).get(f"{stage}/{name}", {}).get("result", {}) or {}

    def save_state(self) -> None:
        self.kit.mkdir(parents=True, exist_ok=True)
        tmp = self.kit / "state.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=2, default=str))
        os.replace(tmp, self.kit / "state.json")


# ------------------------------------------------------------------------------------------ executing steps
def _restore_env(saved: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(saved)


def run_inprocess(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """A step's command in this interpreter (the dry run: no interpreter start per step)."""
    saved_env, saved_argv, saved_path = dict(os.environ), sys.argv[:], sys.path[:]
    os.environ.update(env)
    sys.path[0:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    importlib.invalidate_caches()
    buf = io.StringIO()
    rc = 0
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                if argv[0] == "-m":
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                elif argv[0] == "-c":
                    sys.argv = ["-c", *argv[2:]]
                    exec(compile(argv[1], "<kit -c>", "exec"), {"__name__": "__main__"})
                else:
                    script = (REPO / argv[0]).resolve()
                    sys.path.insert(0, str(script.parent))
                    sys.argv = [str(script), *argv[1:]]
                    runpy.run_path(str(script), run_name="__main__")
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                rc = 1
    finally:
        _restore_env(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        importlib.invalidate_caches()
    return rc, buf.getvalue()


_CHILDREN: set[int] = set()  # process groups of the running steps (ended with the kit, see cmd_run)


def _end_children(signum=None, frame=None) -> None:
    """Kill every running step's process group; as a signal handler (run.sh's hard stop), exit too."""
    for pgid in list(_CHILDREN):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    if signum is not None:
        raise SystemExit(128 + signum)


def run_subprocess(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int, str, bool]:
    """``(returncode, output, timed_out)``. The step runs in a process group of its own (not a new session:
    the device ends whatever a call leaves behind); on timeout the group gets SIGTERM, then SIGKILL."""
    full = dict(os.environ)
    full.update(env)
    if os.environ.get("PYTHONPATH") and "PYTHONPATH" in env:
        full["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + os.environ["PYTHONPATH"]
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=full, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=os.setpgrp)
        _CHILDREN.add(proc.pid)
        timed_out = False
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = 124
        finally:
            _CHILDREN.discard(proc.pid)
    return rc, log.read_text(errors="replace"), timed_out


class _Tee(io.StringIO):
    """What a kit function prints, kept for the log and written through to a file as it comes (a hard stop
    of the call still leaves it on the kit's disk)."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = path.open("w")

    def write(self, s: str) -> int:
        self.file.write(s)
        self.file.flush()
        return super().write(s)


def run_step(ctx: Ctx, stage: str, step: Step) -> None:
    if ctx.only is not None and step.name not in ctx.only and not step.always:
        return
    st = ctx.step_state(stage, step.name)
    final = ("ok",) if ctx.retry_failed else ("ok", "failed")
    if st.get("status") in final and not step.always and not ctx.redo:
        return
    missing = [n for n in step.needs if not ctx.ready(n)]
    if missing:
        st.update(status="waiting", note=f"waits for {', '.join(missing)}")
        ctx.say(f"{stage}/{step.name}: waits for {', '.join(missing)}")
        return
    left = ctx.left()
    if left < step.min_s:
        st.update(status="deferred", note=f"{left:.0f} s left in this call, needs ≥ {step.min_s} s")
        ctx.say(f"{stage}/{step.name}: deferred to the next call ({left:.0f} s left)")
        return
    timeout = min(step.timeout_s, left - 5)
    importlib.invalidate_caches()  # earlier steps may have installed or unpacked packages
    ctx.say(f"{stage}/{step.name}: start" + (f" ({shlex.join(step.argv)})" if step.argv else ""))
    t = time.monotonic()
    timed_out = False
    logs = ctx.kit / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        if step.fn is not None:
            buf = _Tee(ctx.kit / "logs" / f"{stage}-{step.name}.txt")
            try:
                with contextlib.redirect_stdout(buf):
                    res = step.fn(ctx) or {}
            finally:
                buf.file.close()
            rc, text = (0 if res.get("ok", True) is not False else 1), buf.getvalue()
        else:
            if ctx.inprocess:
                rc, text = run_inprocess(step.argv, ctx.env())
            else:
                rc, text, timed_out = run_subprocess(step.argv, ctx.env(), timeout,
                                                     logs / f"{stage}-{step.name}.txt")
            res = step.parse(text, ctx) if step.parse is not None else {}
    except Exception as e:  # a parser or a kit function failed: the step failed, the call goes on
        rc, text, res = 1, traceback.format_exc(), {"ok": False, "error": f"{type(e).__name__}: {e}"}
    seconds = round(time.monotonic() - t, 1)
    if ctx.log_path is not None:
        with ctx.log_path.open("a") as f:
            f.write(f"\n===== {stage}/{step.name} (rc {rc}, {seconds} s)"
                    + (f": {shlex.join(step.argv)}" if step.argv else "") + "\n" + text.rstrip() + "\n=====\n")
    ok = rc == 0 and res.get("ok", True) is not False
    pending = bool(res.get("pending"))
    if timed_out and timeout < step.timeout_s:
        status = "deferred"  # cut by this call's end, not by its own limit: the next call runs it again
    elif pending:
        status = "pending"
    else:
        status = "ok" if ok else ("timeout" if timed_out else "failed")
    st.update(status=status, rc=rc, seconds=seconds, when=now(), result=res, call=ctx.state.get("call"))
    if status == "timeout":
        st["status"] = "failed"
        st["note"] = f"ran past its own limit of {step.timeout_s} s"
    tail = "" if ok else " — " + (res.get("error") or (text.strip().splitlines() or ["(no output)"])[-1])[-300:]
    ctx.say(f"{stage}/{step.name}: {st['status']} in {seconds} s{tail}")
    ctx.save_state()
    write_outputs(ctx)


# ------------------------------------------------------------------------------------------------ setup
def _stub_init(folder: Path) -> None:
    init = folder / "__init__.py"
    if not init.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        init.write_text('"""Made by the cast-llm GPU kit: holds this package\'s data files only (found through '
                        'importlib.util.find_spec, never imported)."""\n')


def setup_collect(ctx: Ctx) -> dict:
    """Copy what this call carried (``.gpu/call*/``) into the kit folder, verifying each part's sha256."""
    found = sorted(ctx.calls_root.glob("call*/manifest.json"))
    manifests = {json.loads(p.read_text())["id"]: json.loads(p.read_text()) for p in found}
    if len(manifests) > 1:
        return {"ok": False, "error": f"the carried call folders come from different preparations: {sorted(manifests)}"}
    held = ctx.manifest()
    if manifests:
        (m,) = manifests.values()
        if held and held.get("id") != m["id"]:
            print(f"a new preparation ({m['id']}; the kit held {held.get('id')}): starting the kit afresh")
            for sub in ("incoming", "pkgs", "site", "wheels", "data"):
                shutil.rmtree(ctx.kit / sub, ignore_errors=True)
            ctx.state["ready"] = {}
            for key in [k for k in ctx.state.get("steps", {}) if k.startswith("setup/")]:
                del ctx.state["steps"][key]
        ctx.kit.mkdir(parents=True, exist_ok=True)
        (ctx.kit / "manifest.json").write_text(json.dumps(m, indent=2))
        held = m
    if not held:
        return {"ok": False, "error": f"nothing carried and nothing held: carry {GPU_DIR}/call1 (see prepare's plan)"}
    parts = {p["file"]: p for f in held["files"] for p in f["parts"]}
    incoming = ctx.kit / "incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    copied = []
    for folder in sorted(ctx.calls_root.glob("call*")):
        for src in sorted(folder.iterdir()):
            p = parts.get(src.name)
            if p is None:
                continue
            dest = incoming / src.name
            if dest.is_file() and dest.stat().st_size == p["size"]:
                continue
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.copyfile(src, tmp)
            if sha256_file(tmp) != p["sha256"]:
                tmp.unlink()
                return {"ok": False, "error": f"{src}: sha256 does not match the manifest (damaged in transfer?)"}
            os.replace(tmp, dest)
            copied.append(src.name)
    have = {name for name in parts if (incoming / name).is_file()}
    missing_calls = sorted({p["call"] for name, p in parts.items() if name not in have})
    print(f"copied {copied or 'nothing new'}; the kit holds {len(have)}/{len(parts)} parts")
    return {"manifest": held["id"], "copied": copied, "parts_held": len(have), "parts": len(parts),
            "missing_calls": missing_calls}


def setup_assemble(ctx: Ctx) -> dict:
    """Reassemble every file whose parts are all here, verify its sha256, and make the stub packages."""
    m = ctx.manifest()
    incoming = ctx.kit / "incoming"
    done, waiting = [], []
    verified = ctx.state.setdefault("verified", {})
    for f in m.get("files", []):
        dest = ctx.kit / f["dest"]
        if dest.is_file() and verified.get(f["dest"]) == f["sha256"]:
            done.append(f["role"])
        elif all((incoming / p["file"]).is_file() for p in f["parts"]):
            assemble([incoming / p["file"] for p in f["parts"]], dest, f["sha256"],
                     [p["sha256"] for p in f["parts"]])
            verified[f["dest"]] = f["sha256"]
            done.append(f["role"])
            print(f"{f['dest']}: {len(f['parts'])} part(s) reassembled, sha256 {f['sha256'][:16]}… verified")
        else:
            waiting.append(f["role"])
            continue
        if f.get("stub_package"):
            _stub_init(ctx.pkgs / f["stub_package"])
    roles = {f["role"] for f in m.get("files", [])}
    ctx.set_ready("corpus", "corpus" in done)
    ctx.set_ready("gguf_file", "model" in done)
    if "wheel" not in roles:
        ctx.set_ready("gguf", True)
    return {"assembled": sorted(set(done)), "waiting": sorted(set(waiting))}


def setup_wheels(ctx: Ctx) -> dict:
    """``pip install --no-index --no-deps --target`` the carried wheels (once)."""
    m = ctx.manifest()
    wheels = [f for f in m.get("files", []) if f["role"] == "wheel"]
    if not wheels:
        ctx.set_ready("gguf", True)
        return {"installed": []}
    paths = [ctx.kit / f["dest"] for f in wheels]
    if not all(ctx.state.get("verified", {}).get(f["dest"]) == f["sha256"] for f in wheels):
        return {"pending": True, "note": "wheels not all here yet"}
    marker = ctx.site / ".kit-wheels"
    key = ",".join(sorted(f["sha256"] for f in wheels))
    if not (marker.is_file() and marker.read_text() == key):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(ctx.site), *map(str, paths)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(r.stdout + r.stderr)
        if r.returncode != 0:
            return {"ok": False, "error": f"pip install failed (rc {r.returncode}): {r.stderr.strip()[-300:]}"}
        marker.write_text(key)
    ctx.set_ready("gguf", True)
    return {"installed": [p.name for p in paths]}


def parse_software(text: str, ctx: Ctx) -> dict:
    res = read_json_mark(text) or {"ok": False, "error": "no report"}
    ctx.state["software"] = res
    return res


def parse_convert(text: str, ctx: Ctx) -> dict:
    res = read_json_mark(text) or {"ok": False, "error": "no report"}
    if res.get("ok", True):
        ctx.set_ready("model", True)
    return res


def setup_model_dry(ctx: Ctx) -> dict:
    """Dry run: the model is a local folder (the GGUF parts were synthetic); what setup checks is the GGUF's
    reassembly and that the project finds it through the stub package."""
    ok = (Path(ctx.model) / "config.json").is_file()
    ctx.set_ready("model", ok)
    return {"ok": ok, "model": ctx.model, "note": "dry run: no conversion (the tiny model is a HF folder)"}


def setup_steps(ctx: Ctx) -> list[Step]:
    steps = [Step("collect", fn=setup_collect, always=True, min_s=5),
             Step("assemble", fn=setup_assemble, always=True, min_s=10),
             Step("wheels", fn=setup_wheels, needs=(), min_s=20, always=True),
             Step("software", argv=["benchmarks/gpu/kit.py", "software", "--device", ctx.device], timeout_s=120,
                  min_s=20, parse=parse_software, always=True)]
    if ctx.dry:
        steps.append(Step("convert", fn=setup_model_dry, needs=("gguf_file", "corpus"), min_s=5))
    else:
        steps.append(Step("convert", argv=["benchmarks/gpu/kit.py", "convert"], timeout_s=240, min_s=60,
                          needs=("gguf_file", "gguf"), parse=parse_convert))
    return steps


# ------------------------------------------------------------------------------------------ correctness
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def parse_pytest(text: str, ctx: Ctx) -> dict:
    tail = "\n".join(text.strip().splitlines()[-3:])
    counts: dict[str, int] = {}
    for n, what in _PYTEST_COUNT.findall(tail):
        counts["error" if what.startswith("error") else what] = int(n)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
    if m:
        counts["collected"] = int(m.group(1))
    skipped = re.findall(r"^SKIPPED \[\d+\] (.+)$", text, flags=re.M)
    ok = counts.get("failed", 0) == 0 and counts.get("error", 0) == 0 and bool(counts)
    return {"ok": ok, "counts": counts, "skipped_reasons": skipped[:20], "summary": tail.splitlines()[-1] if tail else ""}


def _run_dir_report(run: Path) -> dict:
    """What a `cast-llm train` run folder says: steps, tokens, tok/s, final loss, S_t, perplexities."""
    out: dict = {}
    res_f, met_f = run / "results.json", run / "metrics.jsonl"
    recs = [json.loads(x) for x in met_f.read_text().splitlines() if x.strip()] if met_f.is_file() else []
    if recs:
        tps = [r["tokens_per_s"] for r in recs[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
        tps = tps or [r["tokens_per_s"] for r in recs if isinstance(r.get("tokens_per_s"), (int, float))]
        out.update(last_step=recs[-1].get("step"), loss=recs[-1].get("loss"),
                   tokens_per_s=round(statistics.median(tps), 1) if tps else None,
                   sparse_weight_ratio=recs[-1].get("sparse_weight_ratio"),
                   finite=all(isinstance(r.get("loss"), (int, float)) and r["loss"] == r["loss"] for r in recs))
    if res_f.is_file():
        res = json.loads(res_f.read_text())
        fp = (res.get("decay") or {}).get("final_prune") or {}
        if isinstance(fp, dict) and fp.get("sparse_weight_ratio") is not None:
            out["sparse_weight_ratio"] = fp["sparse_weight_ratio"]
        out.update(steps=res.get("steps"), tokens=res.get("tokens_trained"), wall_s=res.get("wall_time_s"),
                   perplexity={k: v for k, v in (res.get("perplexity") or {}).items()})
    return out


def train_argv(ctx: Ctx, out: Path) -> list[str]:
    base = ["-m", "cast_llm.cli", "train", "--model", ctx.model, "--data", ctx.data, "--output-dir", str(out),
            "--overwrite", "--no-progress", "--method", "cast"]
    if ctx.dry:
        return base + ["--device", "cpu", "--precision", "fp32", "--max-steps", "4", "--batch-size", "2",
                       "--seq-len", "32", "--log-every", "2", "--mask-interval", "2", "--save-every", "2",
                       "--val-sequences", "1", "--wikitext-windows", "1", "--eval-seq-len", "32", "--lr", "1e-3",
                       "--no-baseline-eval", "--calib-samples", "2"]
    return base + ["--device", "cuda", "--precision", "bf16", "--max-steps", "30", "--batch-size", "4",
                   "--seq-len", "1024", "--log-every", "5", "--mask-interval", "5", "--save-every", "10",
                   "--val-sequences", "8", "--wikitext-windows", "4", "--eval-seq-len", "1024", "--lr", "1e-4",
                   "--l1-decay", "2e-5"]


def parse_train(text: str, ctx: Ctx) -> dict:
    run = ctx.kit / "runs" / "correctness-train"
    rep = _run_dir_report(run)
    ok = bool(rep.get("finite")) and (run / "config.json").is_file()
    if ok:
        ctx.set_ready("train", str(run))
    return {"ok": ok, **rep, "checkpoints_written": any((run / "checkpoints").glob("step-*"))}


def parse_kit_json(text: str, ctx: Ctx) -> dict:
    return read_json_mark(text) or {"ok": False, "error": "no report"}


def correctness_steps(ctx: Ctx) -> list[Step]:
    run = ctx.kit / "runs" / "correctness-train"
    pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    if ctx.dry:  # collection only: the marker selection and the imports of the CUDA tests
        cuda = pytest + ["--co", "-m", "cuda", "tests/test_triton_adams.py"]
        triton = pytest + ["--co", "tests/test_triton_adams.py"]
    else:
        cuda = pytest + ["-m", "cuda", "tests"]
        triton = pytest + ["tests/test_triton_adams.py"]
    return [
        Step("cuda-tests", argv=cuda, timeout_s=300, min_s=90, parse=parse_pytest),
        Step("triton-tests", argv=triton, timeout_s=240, min_s=60, parse=parse_pytest),
        Step("train-bf16", argv=train_argv(ctx, run), timeout_s=300, min_s=120, needs=("model", "corpus"),
             parse=parse_train),
        Step("export-check", argv=["benchmarks/gpu/kit.py", "check-export", str(run), "--device", ctx.device],
             timeout_s=120, min_s=30, needs=("train",), parse=parse_kit_json),
    ]


# ------------------------------------------------------------------------------------------------- speed
_OPT_ROW = re.compile(r"^(AdamW\(foreach=True\)|AdamS bool masks|AdamS packed masks|AdamW\(fused=True\)|"
                      r"AdamS bool, fused=False)\s+([\d.]+) ms\s+([\d.]+)x", re.M)
_OPT_BW = re.compile(r"^(.+?)\s+moves ([\d.]+) GB/step:\s+([\d.]+) GB/s = (\d+)% of copy", re.M)


def parse_optimizer(text: str, ctx: Ctx) -> dict:
    rows = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in _OPT_ROW.finditer(text)}
    need = ("AdamS bool masks", "AdamW(fused=True)")
    if not all(k in rows for k in need):
        return {"ok": False, "error": "optimizer_step.py printed no table"}
    res = {"median_ms": {k: v[0] for k, v in rows.items()}, "ratio_to_adamw_foreach": {k: v[1] for k, v in rows.items()},
           "adams_over_fused": round(rows["AdamS bool masks"][1] / rows["AdamW(fused=True)"][1], 4)}
    if "AdamS packed masks" in rows:
        res["adams_packed_over_fused"] = round(rows["AdamS packed masks"][1] / rows["AdamW(fused=True)"][1], 4)
    bw = {m.group(1).strip(): {"gb_per_step": float(m.group(2)), "gb_s": float(m.group(3)),
                               "copy_fraction": int(m.group(4)) / 100} for m in _OPT_BW.finditer(text)}
    copy = re.search(r"copy bandwidth: (\d+) GB/s", text)
    if bw:
        res["bandwidth"] = bw
        res["copy_gb_s"] = float(copy.group(1)) if copy else None
        if "AdamS bool masks" in bw:
            res["adams_copy_fraction"] = bw["AdamS bool masks"]["copy_fraction"]
    res["machine"] = next((line[9:] for line in text.splitlines() if line.startswith("machine: ")), None)
    return res


_RATIO = re.compile(r"ratios: CAST w/o KD / plain ([\d.]+)x.*?CAST / plain ([\d.]+)x")


def parse_train_step(text: str, ctx: Ctx) -> dict:
    found = _RATIO.findall(text)
    if not found:
        return {"ok": False, "error": "train_step.py printed no ratios"}
    nokd, kd = found[-1]  # the last table is the wall-time one
    head = next((line for line in text.splitlines() if line.startswith("model ")), "")
    return {"cast_nokd_over_plain": float(nokd), "cast_kd_over_plain": float(kd), "setting": head}


def _inference_parser(json_file: Path):
    def parse(text: str, ctx: Ctx) -> dict:
        if not json_file.is_file():
            return {"ok": False, "error": "bench-inference wrote no JSON"}
        r = json.loads(json_file.read_text())
        d, s = r["dense"], r.get("sparse")
        out = {"model": r["model"], "device": r["device"], "dtype": r["dtype"], "config": r["config"],
               "dense_prefill_tok_s": d["prefill_tokens_per_s"], "dense_decode_tok_s": d["decode_tokens_per_s"],
               "sparse_skipped": r.get("sparse_skipped"), "max_abs_logit_diff": r.get("max_abs_logit_diff"),
               "per_linear": r.get("per_linear", []), "notes": r.get("notes", [])}
        if s:
            out.update(sparse_prefill_tok_s=s["prefill_tokens_per_s"], sparse_decode_tok_s=s["decode_tokens_per_s"],
                       prefill_speedup=s["prefill_tokens_per_s"] / d["prefill_tokens_per_s"],
                       decode_speedup=s["decode_tokens_per_s"] / d["decode_tokens_per_s"] if d["decode_tokens_per_s"] else None,
                       weight_bytes_ratio=s["all_weight_bytes"] / d["all_weight_bytes"])
        return out

    return parse


def speed_steps(ctx: Ctx) -> list[Step]:
    sp = ctx.kit / "speed"
    sp.mkdir(parents=True, exist_ok=True)
    if ctx.dry:
        opt = ["benchmarks/optimizer_step.py", "--quick"]
        tstep = ["benchmarks/train_step.py", "--quick"]
        small = ["--device", "cpu", "--dtype", "fp32", "--batch-size", "1", "--prompt-len", "8", "--gen-len", "2",
                 "--warmup", "0", "--repeats", "1", "--linear-repeats", "1"]
        inf7b = ["-m", "cast_llm.cli", "bench-inference", ctx.model, *small]
        infs = ["-m", "cast_llm.cli", "bench-inference", ctx.model, *small]
        lin = ["benchmarks/gpu/kit.py", "linear-check", "--device", "cpu", "--dtype", "fp32", "--tokens", "16",
               "--shapes", "tiny"]
    else:
        opt = ["benchmarks/optimizer_step.py", "--device", "cuda", "--steps", "30", "--warmup", "3",
               "--mask-steps", "5"]
        tstep = ["benchmarks/train_step.py", "--device", "cuda", "--dtype", "bf16", "--batch", "8", "--seq", "1024",
                 "--rounds", "10", "--warmup", "2"]
        inf7b = ["-m", "cast_llm.cli", "bench-inference", "random:llama-2-7b", "--dtype", "bf16", "--batch-size", "4",
                 "--prompt-len", "1024", "--gen-len", "16", "--repeats", "3"]
        infs = ["-m", "cast_llm.cli", "bench-inference", "smollm2-135m", "--dtype", "bf16", "--batch-size", "16",
                "--prompt-len", "512", "--gen-len", "64", "--repeats", "3"]
        lin = ["benchmarks/gpu/kit.py", "linear-check", "--device", "cuda", "--dtype", "bf16", "--tokens", "4096",
               "--shapes", "llama-7b,smollm2"]
    j7, js = sp / "inference-llama7b.json", sp / "inference-smollm2.json"
    return [
        Step("optimizer-step", argv=opt, timeout_s=180, min_s=60, parse=parse_optimizer),
        Step("linear-2to4", argv=lin, timeout_s=120, min_s=30, parse=parse_kit_json),
        Step("inference-llama7b", argv=[*inf7b, "--json-out", str(j7)], timeout_s=300, min_s=120,
             parse=_inference_parser(j7)),
        Step("train-step-bf16", argv=tstep, timeout_s=240, min_s=90, needs=("model",), parse=parse_train_step),
        Step("inference-smollm2", argv=[*infs, "--json-out", str(js)], timeout_s=180, min_s=60, needs=("model",),
             parse=_inference_parser(js)),
    ]


# ----------------------------------------------------------------------------------------------- quality
def _compare_module():
    bench = str(REPO / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import compare_methods

    return compare_methods


def choose_budget(tok_s_kd: float, overhead_s: float, seconds: float, train_rows: int, tokens_per_step: int,
                  cap: int) -> int:
    """The largest training-token budget (of runs without KD; KD runs get 3/4, equal compute) such that
    ``train_rows`` runs fit ``seconds``: each run costs ``overhead_s`` plus its tokens at the KD rate
    (equal compute makes every training row take about as long as a KD row with 3/4 of the tokens).
    Rounded down to two significant digits (a readable name: 12M), at least 10 steps, at most ``cap``."""
    per_row = seconds / max(1, train_rows) - overhead_s
    budget = max(0.0, per_row) * tok_s_kd / 0.75
    if budget >= cap:
        return int(cap)
    budget = int(budget)
    if budget >= 100:
        unit = 10 ** (len(str(budget)) - 2)
        budget = budget // unit * unit
    return int(min(cap, max(budget, 10 * tokens_per_step)))


def _tier(ctx: Ctx) -> str:
    return "quick" if ctx.dry else "gpu"


def make_comparison(ctx: Ctx, budget: int, save_every: int):
    """compare_methods' Comparison for the kit: its rows (CAST paper-exact and best configuration included),
    each training run checkpointed every ``save_every`` steps and resumed from there by the next call
    (compare_methods passes ``--resume auto``), and stopped at the call's deadline."""
    import dataclasses

    cm = _compare_module()
    opts = cm.parse_args(["--tier", _tier(ctx), "--tokens", str(budget), "--runs-dir", str(ctx.kit / "quality" / "runs"),
                          "--docs-dir", str(ctx.kit / "quality" / "docs"), "--save-every", str(save_every)])
    entries = {e.key: e for e in cm.ALL_ENTRIES}
    best = ctx.state.get("quality", {}).get("cast_best")
    if best:  # an override of the configuration compare_methods calls best
        entries["cast-best"] = dataclasses.replace(entries["cast-best"], args=["--method", "cast", *best])

    class KitComparison(cm.Comparison):
        last_rc = 0

        def _run_cli(self, argv, log):
            if self.inprocess:
                self.last_rc = super()._run_cli(argv, log)
                return self.last_rc
            rc, _, timed_out = run_subprocess(["-m", "cast_llm.cli", *argv], ctx.env(), ctx.left() - 10, log)
            self.last_rc = 124 if timed_out else rc
            return self.last_rc

    comp = KitComparison(opts)
    comp.inprocess = ctx.inprocess  # the quick tier too runs each row as its own process unless in-process
    comp.entries = [entries[k] for k in QUALITY_ROWS if k in entries]
    return cm, comp, entries


def quality_probe(ctx: Ctx) -> dict:
    """Measure training tokens/s (CAST with KD, the slowest row) and the fixed cost of a run, then choose the
    budget for the time that is left; kept in the state so every later call uses the same budget."""
    q = ctx.state.setdefault("quality", {})
    if ctx.cast_best:
        q.setdefault("cast_best", list(ctx.cast_best))
    if q.get("budget") and not ctx.redo:
        ctx.set_ready("budget", True)
        return {"budget": q["budget"], "note": "chosen by an earlier call"}
    cm = _compare_module()
    tier = dict(cm.TIERS[_tier(ctx)])
    tokens_per_step = tier["batch_size"] * tier["grad_accum"] * tier["seq_len"]
    if ctx.tokens:
        q.update(budget=int(ctx.tokens), chosen="--tokens", tokens_per_step=tokens_per_step)
        q["save_every"] = q.get("save_every") or 50
        ctx.set_ready("budget", True)
        return {"budget": q["budget"], "chosen": "--tokens"}
    _, comp, entries = make_comparison(ctx, tier["tokens"], 0)
    probe = ctx.kit / "quality" / "probe"
    steps = 4 if ctx.dry else 30
    argv = comp.train_argv(tier["tokens"], entries["cast"].args, probe)
    i = argv.index("--tokens")
    argv = argv[:i] + argv[i + 2:] + ["--max-steps", str(steps), "--log-every", str(max(1, steps // 6)),
                                      "--val-sequences", "1", "--wikitext-windows", "1", "--overwrite"]
    if "--resume" in argv:  # the probe always starts afresh
        j = argv.index("--resume")
        argv = argv[:j] + argv[j + 2:]
    t = time.monotonic()
    rc = comp._run_cli(argv, ctx.kit / "quality" / "probe.log")
    wall = time.monotonic() - t
    rep = _run_dir_report(probe)
    if rc != 0 or not rep.get("tokens_per_s"):
        log = ctx.kit / "quality" / "probe.log"
        tail = log.read_text().strip().splitlines()[-1:] if log.is_file() else []
        return {"ok": False, "error": f"probe run failed (rc {rc}): {tail}"}
    tok_s = rep["tokens_per_s"]
    overhead = max(0.0, wall - steps * tokens_per_step / tok_s) + 30.0  # + the full end-of-run evaluation
    # what is left of the session, less this call's tail and the next calls' starts, the dense and one-shot rows
    seconds = max(60.0, ctx.session_left_s - 120 - 3 * overhead)
    train_rows = sum(1 for k in (ctx.rows or QUALITY_ROWS) if k in entries and entries[k].kind == "train")
    budget = choose_budget(tok_s, overhead, seconds, train_rows, tokens_per_step, int(tier["tokens"]))
    save_every = max(10, int(60 * tok_s / tokens_per_step))  # a checkpoint every ~minute of training
    q.update(budget=budget, tok_s_kd=tok_s, overhead_s=round(overhead, 1), seconds_for_rows=round(seconds),
             train_rows=train_rows, tokens_per_step=tokens_per_step, save_every=save_every, chosen="probe")
    ctx.set_ready("budget", True)
    print(f"probe: CAST (KD) trains {tok_s:,.0f} tokens/s, fixed cost ~{overhead:.0f} s per run; "
          f"{train_rows} training rows in ~{seconds:.0f} s -> budget {budget:,} tokens (KD rows 3/4 of it)")
    return {"budget": budget, "tok_s_kd": tok_s, "overhead_s": round(overhead, 1), "save_every": save_every}


def quality_rows(ctx: Ctx) -> dict:
    """The rows, resumable: finished ones are reused, a cut one resumes from its checkpoint next call."""
    q = ctx.state["quality"]
    cm, comp, entries = make_comparison(ctx, q["budget"], q.get("save_every", 0))
    order = [k for k in (ctx.rows or QUALITY_ROWS) if k in entries]
    t0 = time.perf_counter()
    results: dict[str, dict] = {}
    overhead = q.get("overhead_s", 30.0)
    for key in order:
        e = entries[key]
        row_dir = comp.runs / key / (f"seed-{comp.seeds[0]}" if e.seeded else "")
        done = row_dir / "compare_row.json"
        if done.is_file():
            results[key] = json.loads(done.read_text())
            continue
        if key in q.get("failed_rows", {}) and not ctx.redo:  # failed in an earlier call: not again
            results[key] = q["failed_rows"][key]
            continue
        need = overhead + 60 if e.kind == "train" else overhead
        if not comp.inprocess and ctx.left() < need:
            results[key] = {"key": key, "label": e.label, "status": "pending", "note": "not started: call ending"}
            continue
        print(f"row {key} ...", flush=True)
        row = comp.run_entry(e)
        if row.get("status") != "ok" and comp.last_rc == 124:
            row.update(status="pending", note="cut at the call's end: resumes from its checkpoint")
        if row.get("status") == "ok" and e.kind == "train":  # (compare_methods recorded S_T and tokens/s)
            shutil.rmtree(row_dir / "model" / "checkpoints", ignore_errors=True)
        if row.get("status") == "failed":
            q.setdefault("failed_rows", {})[key] = row
        results[key] = row
        print(f"  {key}: {row.get('status')} held-out {row.get('heldout')} WikiText-2 {row.get('wikitext2')} "
              f"S_t {row.get('sparse_weight_ratio')} tok/s {row.get('tokens_per_s')}", flush=True)
    table = [results[e.key] for e in comp.entries if e.key in results]
    finished = [r for r in table if r.get("status") == "ok"]
    md = png = None
    if finished:
        meta = {"tier": _tier(ctx), "model": comp.tier["model"], "data": comp.tier["data"], "budget": comp.budget,
                "settings": comp.tier, "total_wall_s": round(time.perf_counter() - t0, 1),
                "command": "python benchmarks/gpu/kit.py run quality (compare_methods.py --tier "
                           f"{_tier(ctx)} --tokens {comp.budget}, rows {','.join(order)})",
                "runs_dir": str(comp.runs)}
        docs = ctx.kit / "quality" / "docs"
        docs.mkdir(parents=True, exist_ok=True)
        stem = f"compare-{comp.model_name}-{cm.budget_name(comp.budget)}"
        png = cm.write_chart(finished, meta, docs / f"{stem}.png")
        md = cm.write_report(finished, meta, docs / f"{stem}.md", png)
        (comp.runs / "rows.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    pending = [r["key"] for r in table if r.get("status") == "pending"]
    q["report"] = {"md": str(md) if md else None, "png": str(png) if png else None}
    failed = [r["key"] for r in table if r.get("status") == "failed"]
    return {"budget": comp.budget, "rows": table, "pending": bool(pending), "pending_rows": pending,
            "failed_rows": failed, "ok": not failed}


def quality_steps(ctx: Ctx) -> list[Step]:
    return [Step("probe", fn=quality_probe, needs=("model", "corpus"), min_s=120 if not ctx.dry else 1),
            Step("rows", fn=quality_rows, needs=("model", "corpus", "budget"), min_s=90 if not ctx.dry else 1)]


STEP_BUILDERS = {"setup": setup_steps, "correctness": correctness_steps, "speed": speed_steps,
                 "quality": quality_steps}


# ------------------------------------------------------------------------------------- the kit's reports
def machine_info() -> dict:
    info = {"hostname": platform.node(), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            info["memory_gib"] = round(kb / 2**20, 1)
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            info["gpus"] = [line.strip() for line in r.stdout.strip().splitlines()]
    return info


def evaluate_targets(ctx: Ctx) -> list[dict]:
    """Every target of issue 16 against what was measured (None: not measured yet)."""
    opt = ctx.result("speed", "optimizer-step")
    ts = ctx.result("speed", "train-step-bf16")
    lin = ctx.result("speed", "linear-2to4")
    qual = ctx.result("quality", "rows")
    cast_st = [r.get("sparse_weight_ratio") for r in qual.get("rows", [])
               if r.get("key", "").startswith("cast") and r.get("status") == "ok"]
    measured = {
        "adams_over_fused": opt.get("adams_over_fused"),
        "adams_copy_fraction": opt.get("adams_copy_fraction"),
        "cast_nokd_over_plain": ts.get("cast_nokd_over_plain"),
        "cast_kd_over_plain": ts.get("cast_kd_over_plain"),
        "linear24_prefill_speedup": lin.get("min_speedup"),
        "linear24_max_rel_err": lin.get("max_rel_err"),
        "cast_sparse_weight_ratio": min(cast_st) if cast_st and None not in cast_st else None,
    }
    out = []
    for key, (label, op, goal) in TARGETS.items():
        v = measured[key]
        verdict = None if v is None else (v <= goal if op == "<=" else v >= goal)
        out.append({"key": key, "target": label, "measured": v, "goal": f"{op} {goal}",
                    "verdict": "n/a" if verdict is None else ("PASS" if verdict else "FAIL")})
    return out


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def next_call(ctx: Ctx) -> str:
    steps = ctx.state.get("steps", {})
    m = ctx.manifest()
    collect = steps.get("setup/collect", {}).get("result", {})
    if collect.get("missing_calls"):
        calls = {c["call"]: c for c in m.get("calls", [])}
        k = collect["missing_calls"][0]
        c = calls.get(k, {"command": "bash benchmarks/gpu/run.sh setup correctness speed", "carry": [f"{GPU_DIR}/call{k}"]})
        return f"run(command={c['command']!r}, carry={c['carry']!r}) — carries the parts still missing"
    open_ = [k for k, v in steps.items() if v.get("status") not in ("ok", "failed")]
    if any(k.startswith(("correctness/", "speed/")) for k in open_):
        return "run(command='bash benchmarks/gpu/run.sh correctness speed', carry=[])"
    if "quality/rows" not in steps or any(k.startswith("quality/") for k in open_):
        return "run(command='bash benchmarks/gpu/run.sh quality --session-left-s SECONDS_LEFT', carry=[])"
    return "nothing: every stage is done (copy $OUT's files to docs/results/gpu/)"


def summary_md(ctx: Ctx) -> str:
    sw = ctx.state.get("software", {})
    mach = ctx.state.get("machine", {})
    lines = [f"# GPU kit results{' (dry run, --device cpu)' if ctx.dry else ''}", "",
             f"Updated {now()} by call {ctx.state.get('call')} (`{ctx.state.get('command')}`); machine: "
             f"{', '.join(mach.get('gpus', [])) or 'no GPU'}; {mach.get('cpu', '?')}, {mach.get('cpus')} CPUs; "
             f"torch {sw.get('packages', {}).get('torch', '?')}, triton {sw.get('packages', {}).get('triton', '?')}, "
             f"transformers {sw.get('packages', {}).get('transformers', '?')}; source "
             f"{ctx.manifest().get('source', {}).get('commit', '?')}.", "",
             "## Targets (issue 16)", "", "| target | measured | goal | verdict |", "|---|---:|---:|---|"]
    for t in evaluate_targets(ctx):
        lines.append(f"| {t['target']} | {_fmt(t['measured'])} | {t['goal']} | {t['verdict']} |")
    lines += ["", "## Steps", "", "| stage/step | status | seconds | result |", "|---|---|---:|---|"]
    for key, st in ctx.state.get("steps", {}).items():
        res = st.get("result") or {}
        brief = {k: v for k, v in res.items() if not isinstance(v, (dict, list)) and k != "ok"}
        text = ", ".join(f"{k} {_fmt(v)}" for k, v in list(brief.items())[:6]) or st.get("note", "")
        lines.append(f"| {key} | {st.get('status')} | {_fmt(st.get('seconds'))} | {text.replace('|', '/')} |")
    lin = ctx.result("speed", "linear-2to4")
    if lin.get("shapes"):
        lines += ["", "## 2:4 semi-structured linear vs dense (prefill; the target: LLaMA-7B shapes)", "",
                  "| set | shape (out × in) | tokens | dense µs | 2:4 F.linear µs | speedup | 2:4 W·Xᵀ µs | speedup "
                  "| max rel err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in lin["shapes"]:
            err = max((r.get(k) for k in ("max_rel_err", "mm_rel_err") if r.get(k) is not None), default=None)
            lines.append(f"| {r.get('set', '—')} | {r['out']} × {r['in']} | {r['tokens']} | {_fmt(r.get('dense_us'))} | "
                         f"{_fmt(r.get('sparse_us'))} | {_fmt(r.get('speedup'))} | {_fmt(r.get('sparse_mm_us'))} | "
                         f"{_fmt(r.get('mm_speedup'))} | {_fmt(err)} |")
    rows = ctx.result("quality", "rows").get("rows", [])
    if rows:
        q = ctx.state.get("quality", {})
        lines += ["", f"## GPU comparison tier (budget {q.get('budget', 0):,} tokens; KD rows 3/4 of it)", "",
                  "| row | status | tokens | held-out ppl | WikiText-2 ppl | S_t | wall s | tokens/s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r.get('label', r.get('key'))} | {r.get('status')} | {_fmt(r.get('tokens'))} | "
                         f"{_fmt(r.get('heldout'))} | {_fmt(r.get('wikitext2'))} | {_fmt(r.get('sparse_weight_ratio'))} | "
                         f"{_fmt(r.get('wall_s'))} | {_fmt(r.get('tokens_per_s'))} |")
    lines += ["", f"Next call: {next_call(ctx)}", ""]
    return "\n".join(lines)


def write_outputs(ctx: Ctx) -> list[Path]:
    """versions.json, results.json, summary.md (+ this call's log and the comparison's table and chart)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    sw = ctx.state.get("software", {})
    versions = {"command": ctx.state.get("command"), "kit_argv": ctx.argv, "call": ctx.state.get("call"),
                "time": now(), "machine": ctx.state.get("machine", {}), "python": platform.python_version(),
                "packages": sw.get("packages", {}), "cuda": sw.get("cuda", {}), "image_expected": IMAGE_VERSIONS,
                "image_date": IMAGE_DATE, "source": ctx.manifest().get("source", {}),
                "manifest": ctx.manifest().get("id"), "dry_run": ctx.dry}
    files = {"versions.json": json.dumps(versions, indent=2, default=str),
             "results.json": json.dumps({"targets": evaluate_targets(ctx), "steps": ctx.state.get("steps", {}),
                                         "quality": ctx.state.get("quality", {}), "ready": ctx.state.get("ready", {})},
                                        indent=2, default=str),
             "summary.md": summary_md(ctx)}
    for name, text in files.items():
        (ctx.out / name).write_text(text)
    rep = ctx.state.get("quality", {}).get("report", {})
    for key, name in (("md", "compare.md"), ("png", "compare.png")):
        if rep.get(key) and Path(rep[key]).is_file():
            shutil.copyfile(rep[key], ctx.out / name)
    written = sorted(p for p in ctx.out.iterdir() if p.is_file())
    if len(written) > MAX_OUT_FILES:
        raise RuntimeError(f"{len(written)} files under {ctx.out}: at most {MAX_OUT_FILES} come back")
    return written


def cmd_run(args) -> int:
    stages: list[str] = []
    for s in args.stages:
        for part in s.split(","):
            part = STAGE_ALIASES.get(part, part)
            names = list(STAGES) if part == "all" else [part]
            for n in names:
                if n not in STAGES:
                    print(f"run: unknown stage {part!r} (use {', '.join(STAGES)}, 0-3 or all)", file=sys.stderr)
                    return 2
                if n not in stages:
                    stages.append(n)
    if "setup" not in stages:  # every call collects what it carried and checks the software: cheap
        stages.insert(0, "setup")
    kit = Path(args.kit_dir).expanduser().resolve()
    out = Path(args.out).expanduser().resolve() if args.out else kit / "out"
    ctx = Ctx(kit=kit, out=out, device=args.device, calls_root=Path(args.calls_root).resolve(),
              budget_s=args.budget_s, inprocess=args.inprocess, session_left_s=args.session_left_s,
              tokens=args.tokens, rows=args.rows.split(",") if args.rows else None, redo=args.redo,
              retry_failed=args.retry_failed, only=set(args.steps.split(",")) if args.steps else None,
              argv=list(args.raw_argv), stages=stages)
    if args.cast_best is not None:
        ctx.cast_best = shlex.split(args.cast_best)
    if ctx.dry:
        if not args.model:
            print("run --device cpu (the dry run) needs --model DIR (a tiny HF model folder)", file=sys.stderr)
            return 2
        ctx.model = str(Path(args.model).resolve())
    kit.mkdir(parents=True, exist_ok=True)
    state_f = kit / "state.json"
    ctx.state = json.loads(state_f.read_text()) if state_f.is_file() else {}
    ctx.state["call"] = int(ctx.state.get("call", 0)) + 1
    ctx.state.setdefault("first_call_time", time.time())
    if ctx.session_left_s is None:  # a 30-minute session that began shortly before this kit's first call
        ctx.session_left_s = SESSION_DEVICE_S - START_COST_S - (time.time() - ctx.state["first_call_time"])
    ctx.state["command"] = args.command or "python benchmarks/gpu/kit.py " + shlex.join(args.raw_argv)
    ctx.state["machine"] = machine_info()
    if args.cast_best is not None:
        ctx.state.setdefault("quality", {})["cast_best"] = ctx.cast_best
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.log_path = ctx.out / f"log-{ctx.state['call']:02d}-{'-'.join(stages)}.txt"
    # run.sh's hard stop (SIGTERM from `timeout`) ends the running step's processes too
    saved = {sig: signal.signal(sig, _end_children) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # the kit's own work (the comparison's evaluations) runs with the steps' environment
    for d in (ctx.site, ctx.pkgs):
        d.mkdir(parents=True, exist_ok=True)
    saved_env, saved_path = dict(os.environ), sys.path[:]
    env = ctx.env()
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    os.environ.update(env)
    sys.path[0:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p not in sys.path]
    importlib.invalidate_caches()
    ctx.say(f"GPU kit call {ctx.state['call']}: stages {', '.join(stages)} on {args.device}; kit {kit}; "
            f"{ctx.budget_s:.0f} s budget")
    try:
        for stage in stages:
            for step in STEP_BUILDERS[stage](ctx):
                run_step(ctx, stage, step)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        _restore_env(saved_env)
        sys.path[:] = saved_path
    ctx.save_state()
    write_outputs(ctx)
    text = summary_md(ctx)
    print("\n" + text)
    failed = [k for k, v in ctx.state.get("steps", {}).items() if v.get("status") == "failed"]
    return 1 if failed else 0


# ------------------------------------------------------------------------------- subcommands run as steps
def cmd_software(args) -> int:
    """Imports and versions, CUDA, and the project's view of the embedded model, corpus and WikiText-2."""
    import importlib.metadata as md

    res: dict = {"python": platform.python_version(), "executable": sys.executable, "packages": {}, "missing": []}
    mods = [("torch", "torch"), ("transformers", "transformers"), ("accelerate", "accelerate"), ("peft", "peft"),
            ("safetensors", "safetensors"), ("tokenizers", "tokenizers"), ("triton", "triton"), ("numpy", "numpy"),
            ("yaml", "pyyaml"), ("tqdm", "tqdm"), ("matplotlib", "matplotlib"), ("pytest", "pytest"),
            ("hypothesis", "hypothesis"), ("tensorboard", "tensorboard"), ("pyarrow", "pyarrow")]
    mods += [(w.replace("-", "_"), w) for w in WHEELS]
    for mod, dist in mods:
        try:
            importlib.import_module(mod)
            res["packages"][dist] = md.version(dist)
        except Exception as e:
            res["missing"].append(f"{dist}: {type(e).__name__}: {e}"[:200])
    notes = [f"{k} {res['packages'].get(k)} (KINDS.md: {v})" for k, v in IMAGE_VERSIONS.items()
             if k in res["packages"] and not res["packages"][k].startswith(v)]
    if notes and args.device != "cpu":
        res["version_notes"] = notes
    import torch

    cuda = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if cuda["available"]:
        p = torch.cuda.get_device_properties(0)
        cuda.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, bf16=torch.cuda.is_bf16_supported(),
                    cusparselt=torch.backends.cusparselt.is_available(),
                    cusparselt_version=torch.backends.cusparselt.version() if torch.backends.cusparselt.is_available() else None,
                    cudnn=torch.backends.cudnn.version())
    res["cuda"] = cuda
    from cast_llm.deploy.semi_structured import semi_structured_unavailable_reason
    from cast_llm.optim.triton_adams import unavailable_reason

    res["triton_adams"] = unavailable_reason() or "available"
    res["semi_structured"] = semi_structured_unavailable_reason() or "available"
    emb: dict = {}
    for key, fn in (("model", lambda: __import__("cast_llm.models", fromlist=["x"]).embedded_gguf("smollm2-135m")),
                    ("corpus", lambda: __import__("cast_llm.data", fromlist=["x"])._embedded_file("wiki-summaries")),
                    ("wikitext2", lambda: __import__("cast_llm.eval.ppl", fromlist=["x"]).wikitext2_file())):
        try:
            emb[key] = str(fn())
        except Exception as e:
            emb[key] = f"unavailable: {type(e).__name__}: {e}"[:300]
    res["embedded"] = emb
    required = [m for m in res["missing"] if not (args.device == "cpu" and m.startswith("triton"))]
    res["ok"] = not required and (args.device == "cpu" or cuda["available"])
    if args.device != "cpu" and not cuda["available"]:
        res["error"] = "no CUDA device visible"
    emit_json(res)
    return 0


def cmd_convert(args) -> int:
    """Convert the embedded GGUF once into the project's cache (``$CAST_LLM_CACHE``) and load it back."""
    from cast_llm.models import cache_dir, load_model, load_tokenizer

    t = time.perf_counter()
    tok = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m")
    res = {"ok": True, "seconds": round(time.perf_counter() - t, 1), "cache": str(cache_dir()),
           "cached": sorted(p.name for p in cache_dir().iterdir()) if cache_dir().is_dir() else [],
           "parameters": sum(p.numel() for p in model.parameters()), "vocab": len(tok)}
    emit_json(res)
    return 0


def cmd_check_export(args) -> int:
    """The exported run loads in plain transformers, every target is exactly 2:4, and a forward is finite."""
    import torch
    from transformers import AutoModelForCausalLM

    from cast_llm.export import sparsity_report

    run = Path(args.run_dir)
    meta = json.loads((run / "config.json").read_text()).get("sparsity", {})
    model = AutoModelForCausalLM.from_pretrained(run, dtype=torch.float32)
    rows = sparsity_report(model, n=2, m=4)
    bad = [r.name for r in rows if not r.is_nm]
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    model.to(device).eval()
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (2, 32), device=device)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        finite = bool(torch.isfinite(model(input_ids=ids).logits).all())
    listed = set(meta.get("targets", []))
    res = {"targets": len(rows), "exact_2to4": not bad, "not_2to4": bad[:10], "finite_forward": finite,
           "metadata_targets": len(listed), "metadata_matches": listed == {r.name for r in rows} if listed else None,
           "sparsity": round(sum(r.zeros for r in rows) / max(1, sum(r.numel for r in rows)), 4)}
    res["ok"] = res["exact_2to4"] and finite and bool(rows)
    emit_json(res)
    return 0


LINEAR_SHAPES = {"llama-7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
                 "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536)], "tiny": [(64, 64), (128, 64)]}


def cmd_linear_check(args) -> int:
    """2:4 semi-structured F.linear vs dense on the same pruned weights: outputs (max |Δ| / max |y|) and the
    median time of each (CUDA events), per shape; also ``W_s @ Xᵀ`` with a pre-transposed input (the product
    the sparse kernels compute natively: what F.linear's transposes cost). The targets (``min_speedup``,
    ``max_rel_err``) are taken over the first shape set named; every set's rows are reported."""
    import torch
    import torch.nn.functional as F

    from cast_llm.deploy.semi_structured import semi_structured_unavailable_reason
    from cast_llm.sparsity.mask import nm_mask

    device = torch.device(args.device)
    reason = semi_structured_unavailable_reason(device)  # a sentence on CPU, None on an sm80+ GPU
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    shapes = []
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in LINEAR_SHAPES]
    if unknown or not names:
        raise SystemExit(f"linear-check: unknown shape set(s) {unknown or args.shapes!r}; known: "
                         f"{', '.join(sorted(LINEAR_SHAPES))}")
    for set_name, (out_f, in_f) in ((n, sh) for n in names for sh in LINEAR_SHAPES[n]):
        w = torch.randn(out_f, in_f, generator=g).to(device=device, dtype=dtype)
        w.masked_fill_(~nm_mask(w, 2, 4), 0)
        x = torch.randn(args.tokens, in_f, generator=g).to(device=device, dtype=dtype)
        row = {"set": set_name, "out": out_f, "in": in_f, "tokens": args.tokens}
        if reason is None:
            from torch.sparse import to_sparse_semi_structured

            ws = to_sparse_semi_structured(w)
            yd, ys = F.linear(x, w).float(), F.linear(x, ws).float()
            row["max_rel_err"] = float((ys - yd).abs().max() / yd.abs().max())

            def timed(fn, reps=args.repeats):
                for _ in range(3):
                    fn()
                times = []
                for _ in range(reps):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) * 1e3)
                return statistics.median(times)

            row["dense_us"] = timed(lambda: F.linear(x, w))  # noqa: B023
            row["sparse_us"] = timed(lambda: F.linear(x, ws))  # noqa: B023
            row["speedup"] = row["dense_us"] / row["sparse_us"]
            try:  # a diagnostic: its failure must not cost the F.linear measurement above
                xt = x.t().contiguous()
                row["mm_rel_err"] = float((ws @ xt).float().t().sub(yd).abs().max() / yd.abs().max())
                row["sparse_mm_us"] = timed(lambda: ws @ xt)  # noqa: B023
                row["mm_speedup"] = row["dense_us"] / row["sparse_mm_us"]
            except Exception as e:  # noqa: BLE001
                row["mm_error"] = f"{type(e).__name__}: {e}"[:300]
        shapes.append(row)
    res = {"device": str(device), "dtype": args.dtype, "shapes": shapes, "skipped": reason}
    if reason is None:
        first = [r for r in shapes if r["set"] == names[0]]
        res["min_speedup"] = min(r["speedup"] for r in first)
        res["max_rel_err"] = max(r["max_rel_err"] for r in first)
        res["max_rel_err_all"] = max(max(r["max_rel_err"], r["mm_rel_err"]) for r in shapes)
        res["backend"] = "cusparselt" if torch.backends.cusparselt.is_available() else "cutlass"
    emit_json(res)
    return 0


def cmd_imports(args) -> int:
    found = third_party_imports()
    cls = classify_imports(found)
    for k, names in cls.items():
        print(f"{k}: {', '.join(names) or '—'}")
    emit_json({"imports": found, "classes": cls})
    return 1 if cls["missing"] else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kit.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fill .gpu/ and print the device calls (this machine)")
    p.add_argument("--part-mib", type=int, help="largest part (default: what fits a call with the working tree)")
    p.add_argument("--no-download", action="store_true", help="use the wheels already in .gpu/wheels")
    p.add_argument("--json", action="store_true", help="also print the manifest as one JSON line")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("run", help="run stages (the GPU machine; --device cpu: the dry run)")
    p.add_argument("stages", nargs="+", help="setup|0 correctness|1 speed|2 quality|3, or all")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--kit-dir", default=os.environ.get("CAST_KIT_DIR", str(Path.home() / "cast-kit")))
    p.add_argument("--out", default=os.environ.get("OUT"), help="where the ≤ 8 result files go (default: $OUT)")
    p.add_argument("--calls-root", default=str(REPO / GPU_DIR), help="where the carried call folders are")
    p.add_argument("--budget-s", type=float, default=CALL_BUDGET_S, help="start no work after this many seconds")
    p.add_argument("--session-left-s", type=float, help="device seconds left to the session (sizes the comparison)")
    p.add_argument("--tokens", type=int, help="the comparison's budget instead of the probe's choice")
    p.add_argument("--rows", help=f"comparison rows, comma-separated (default {','.join(QUALITY_ROWS)})")
    p.add_argument("--cast-best", help="flags of the cast-best row (default: compare_methods.CAST_BEST, the "
                                       "configuration the CPU-tier comparison chose)")
    p.add_argument("--redo", action="store_true", help="run finished steps again")
    p.add_argument("--retry-failed", action="store_true", help="run failed steps again")
    p.add_argument("--steps", help="only these steps (names as in summary.md, comma-separated)")
    p.add_argument("--inprocess", action="store_true", help="dry run: run steps in this interpreter")
    p.add_argument("--model", help="dry run: a tiny HF model folder (the GPU machine uses smollm2-135m)")
    p.add_argument("--command", help="the command line to record (run.sh passes its own)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("software", help="imports, versions, CUDA (JSON)")
    p.add_argument("--device", default="cuda")
    p.set_defaults(func=cmd_software)
    p = sub.add_parser("convert", help="convert the embedded GGUF into the cache")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("check-export", help="exact 2:4 export check of a run folder")
    p.add_argument("run_dir")
    p.add_argument("--device", default="cuda")
    p.set_defaults(func=cmd_check_export)
    p = sub.add_parser("linear-check", help="2:4 F.linear vs dense: outputs and time")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--shapes", default="llama-7b",
                   help=f"comma-separated shape sets ({', '.join(sorted(LINEAR_SHAPES))}); targets use the first")
    p.add_argument("--repeats", type=int, default=20)
    p.set_defaults(func=cmd_linear_check)
    p = sub.add_parser("imports", help="third-party imports of the stages against the image")
    p.set_defaults(func=cmd_imports)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.raw_argv = argv
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
