"""What the GPU image holds (KINDS.md), the wheels the kit carries for what it lacks, and the static scan that
checks the two cover every third-party import the stages make (``make test`` runs it)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from gpukit.common import REPO, STAGES, emit_json
from gpukit.stages.perf import PERF_TABLE

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


# ============================================================================ imports the stages make (static)
STAGE_ENTRIES = {
    "setup": ["benchmarks/gpu/kit.py", "src/cast_llm/models/loading.py", "src/cast_llm/data/*.py", "src/cast_llm/eval/ppl.py"],
    # the benchmark scripts of the perf table (absent ones are skipped: they arrive with their own branches)
    "perf": [f"benchmarks/{b.script}" for b in PERF_TABLE],
    "correctness": ["tests/*.py", "src/cast_llm/cli/__init__.py", "src/cast_llm/cli/train.py", "src/cast_llm/deploy/export.py"],
    "speed": ["src/cast_llm/cli/bench.py", "src/cast_llm/deploy/semi_structured.py"],
    "quality": ["benchmarks/compare_methods.py", "src/cast_llm/cli/train.py", "src/cast_llm/cli/prune.py"],
}
_MODULE_STRING = re.compile(r"^cast_llm(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def _module_file(name: str, base: Path) -> Path | None:
    """The file of the dotted module ``name`` under the folder ``base`` (a package's ``__init__.py``), else None."""
    stem = base / Path(*name.split("."))
    for cand in (stem.with_suffix(".py"), stem / "__init__.py"):
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
                f = _module_file(name, root / "src")
                if f is not None:
                    todo.append(f)
                continue
            # our own scripts and packages beside the file, in benchmarks/ (and gpu/: the kit's gpukit) or tests/
            local = (path.parent, root / "benchmarks", root / "benchmarks" / "gpu", root / "tests")
            hits = [f for d in local for f in (_module_file(name, d), _module_file(top, d)) if f is not None]
            if hits:
                todo.extend(hits)
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


def cmd_imports(args) -> int:
    found = third_party_imports()
    cls = classify_imports(found)
    for k, names in cls.items():
        print(f"{k}: {', '.join(names) or '—'}")
    emit_json({"imports": found, "classes": cls})
    return 1 if cls["missing"] else 0
