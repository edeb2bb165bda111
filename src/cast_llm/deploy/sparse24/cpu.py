"""The CPU 2:4 kernels: a C++ extension that multiplies straight from the compressed weight (csrc/sparse24_cpu.cpp).

Decode at batch 1 on a CPU reads every weight once per token, so its speed is the weight bytes over the memory
bandwidth. A 2:4 layer in bf16 stored as kept values + 2-bit positions reads 0.5625 of the dense bytes (int8
values + per-row scales: 0.3125 of dense bf16), and these kernels read exactly that: they never rebuild a
dense weight. The compressed form (``values (out, in/2)``, ``meta (out, ceil(in/8))`` uint8, 2 bits per kept
value) is bit for bit the ``positions`` stream of ``--format compressed`` checkpoints for rows of a multiple of
8 inputs, so :func:`cast_llm.deploy.compressed.load_compressed` hands the file's tensors to the kernel as they are.

Eight instruction paths, chosen per CPU at run time from one build (``PATHS``):

* ``avx512-bf16`` — bf16 activations and values, vpermt2w gathers the kept activations, vdpbf16ps accumulates
  in fp32 (AVX512-BW/VBMI/BF16: AMD Zen 4+, Intel Cooper Lake / Sapphire Rapids+); each row's values
  prefetched 8 KB ahead in software at one token;
* ``avx512-bf16-hwpf`` — the same loop without any software prefetch (the hardware prefetchers alone): the
  distance tuned on one core costs 25-45 % on another (docs/results/cpu24-notes.md §23), so the dispatcher
  times both and keeps the faster per shape and token bucket;
* ``amx-bf16`` — bf16 activations and values on CPUs with AMX (Intel Sapphire Rapids+): 16 rows at a time
  expanded into a dense panel in L1 (vpexpandw), multiplied on AMX tiles; reads each weight byte once per call
  whatever the token count, so it is the multi-token path there (one token: ``avx512-bf16`` is faster). Linux
  grants AMX's tile state on request (``arch_prctl``); where it refuses, the path is reported missing;
* ``avx512-bf16-rows`` — bf16 activations, bf16 or int8 values (2:4 + W8), for many tokens (prefill): lanes over 16 output rows, as
  a dense GEMM's are; each call packs 48 rows at a time (16×16 transposes) into one vector of the 16 rows' kept
  pairs and one of their positions as vpermw indices per group, then per group and token one broadcast of the
  token's four activations, and per 16 rows one vpermw and one vdpbf16ps — half a dense GEMM's multiply-adds
  (AVX512-BF16). Measured on a Zen 4: 1.35-1.41× torch's bf16 GEMM at 512 tokens (docs/results/cpu24-notes.md
  §13);
* ``avx512`` — fp32 activations (a bf16 input is widened once per call), fp32 / bf16 / int8 values;
* ``avx2`` — the same on 256-bit registers, for CPUs without AVX-512;
* ``avx2-hwpf`` — that loop without software prefetch: on a Zen 3 core the hardware prefetchers alone were faster
  in most cells and slower in some (docs/results/cpu24-notes.md §30), so the dispatcher times both there too;
* ``avx2-tokens`` — fp32 activations, several tokens (prefill) on CPUs without AVX-512: lanes over 16 tokens, or
  8 for calls of at most 8 (the activations transposed once per call), per kept value one broadcast and one FMA
  per 8 tokens on their activations at its position, K in chunks whose activations fit L1 — one multiply-add per
  kept value and token, half a dense GEMM's, no permute (docs/results/cpu24-notes.md §33-34).

The extension is built by :mod:`torch.utils.cpp_extension` (ninja, the compiler torch was built for) the first
time a process needs it — ``make install`` does it once (``python -m cast_llm.deploy.sparse24.build``) — into a cache folder keyed by a hash of the source,
the flags and the torch version (``CAST_LLM_EXTENSIONS_DIR``, default ``~/.cache/cast-llm/extensions``). One
line says when it compiles; where it cannot be built or loaded, :func:`unavailable_reason` says why in one
line and the layers run dense. ``CAST_LLM_KERNELS=reference`` (``--kernels reference``) never loads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import mmap
import os
import sys
import time
from pathlib import Path

import torch

from cast_llm import kernels
from cast_llm.errors import CastError
from cast_llm.sparsity.mask import nm_mask

__all__ = ["PATHS", "BadPositionsError", "available_paths", "bad_position_rows", "check_positions", "compress", "decompress", "dense_mm", "dense_path", "dense_unavailable_reason",
           "extension_reason", "load_extension", "on_huge_pages", "quantize_values", "scratch_bytes", "sparse24_mm", "state_on_huge_pages", "unavailable_reason",
           "unpack_mm"]

BF16_PATHS = ("avx512-bf16", "avx512-bf16-hwpf", "amx-bf16", "avx512-bf16-rows")  # bf16 activations only
NO_W8_PATHS = ("amx-bf16",)  # no int8-values variant
PATHS = {"avx512-bf16": 0, "avx512-bf16-hwpf": 6, "amx-bf16": 3, "avx512-bf16-rows": 5, "avx512": 1,
         "avx2": 2, "avx2-hwpf": 7, "avx2-tokens": 8}  # name -> isa id
SOURCE = Path(__file__).parent / "csrc" / "sparse24_cpu.cpp"
CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]  # no -march: the ISA-specific code carries target attributes
NAME = "cast_llm_cpu24"

_STATE: dict[str, object] = {}  # "ops" -> torch.ops namespace, "error" -> why it is not there


def cache_dir() -> Path:
    root = os.environ.get("CAST_LLM_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "cast-llm" / "extensions"


def build_key() -> str:
    """The build folder's name: a new source, flag set, torch or Python rebuilds."""
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes() if SOURCE.is_file() else b"(no source)")  # (the dispatch keys on it too)
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.split()[0].encode())
    return f"{NAME}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _locked(folder: Path):
    """One builder at a time (pytest workers, two commands at once); the others wait, then load its result."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load_extension(*, verbose: bool = False, quiet: bool = False):
    """``torch.ops.cast_llm_cpu24``, building the extension first if this machine has no build of this source.
    Raises RuntimeError (one line) where it cannot be built or loaded."""
    if "ops" in _STATE:
        return _STATE["ops"]
    if "error" in _STATE:
        raise RuntimeError(_STATE["error"])
    try:
        ops = _load(verbose=verbose, quiet=quiet)
    except Exception as e:  # noqa: BLE001 - any failure means: no extension, the layers run dense
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else type(e).__name__)
        _STATE["error"] = f"the CPU 2:4 extension could not be built or loaded ({type(e).__name__}: {first[:240]})"
        raise RuntimeError(_STATE["error"]) from None
    _STATE["ops"] = ops
    return ops


def _load(verbose: bool, quiet: bool):
    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} is missing from this installation")
    folder = cache_dir() / build_key()
    library, complete = folder / f"{NAME}.so", folder / ".complete"
    with _locked(folder):
        if not complete.is_file():  # (a build killed half-way leaves no stamp: it is built again)
            from torch.utils import cpp_extension

            if not quiet:
                print(f"cast-llm: compiling the CPU 2:4 kernels once (C++, ~20 s) into {folder}", file=sys.stderr,
                      flush=True)
            t0 = time.perf_counter()
            cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(folder),
                               is_python_module=False, verbose=verbose)
            complete.write_text(f"{library.name}\n")
            if not quiet:
                print(f"cast-llm: CPU 2:4 kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                      flush=True)
        elif not hasattr(torch.ops, NAME) or not hasattr(getattr(torch.ops, NAME), "sparse24_mm"):
            torch.ops.load_library(str(library))
    return getattr(torch.ops, NAME)


def extension_reason() -> str | None:
    """None where the extension is loaded (building it if needed), else why not."""
    if kernels.mode() == kernels.REFERENCE:
        return "the checked kernels are switched off (--kernels reference / CAST_LLM_KERNELS=reference)"
    try:
        load_extension()
    except RuntimeError as e:
        return str(e)
    return None


def available_paths() -> list[str]:
    """The instruction paths this CPU runs (empty where the extension is not there)."""
    if extension_reason() is not None:
        return []
    ops = load_extension()
    return [name for name, isa in PATHS.items() if ops.cpu_supports(isa)]


def unavailable_reason(path: str, device: torch.device, dtype: torch.dtype, values: str = "same") -> str | None:
    """Why ``path`` cannot run a ``dtype`` layer on ``device`` (None: it can)."""
    if torch.device(device).type != "cpu":
        return f"the CPU 2:4 kernels run on the CPU, not {torch.device(device).type}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"the CPU 2:4 kernels take bfloat16 or float32 layers, not {dtype}"
    if path in BF16_PATHS and dtype != torch.bfloat16:
        return f"the {path} path takes bf16 activations"
    if path in NO_W8_PATHS and values == "int8":
        return f"the {path} path takes bf16 kept values, not int8 (2:4 + W8)"
    why = extension_reason()
    if why:
        return why
    if path not in available_paths():
        return f"this CPU lacks the instructions of the {path} path"
    return None


# ------------------------------------------------------------------------------------- the compressed form
HUGE_PAGE = 2 << 20  # the x86-64 transparent huge page
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_reason() -> str | None:
    """Why the compressed weights are not placed on huge pages here (None: they are, :func:`on_huge_pages`)."""
    if os.environ.get("CAST_LLM_HUGE_PAGES", "1") == "0":
        return "CAST_LLM_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no madvise(MADV_HUGEPAGE)"
    mode = _thp_mode(THP_ENABLED)
    if mode is None:
        return f"{THP_ENABLED} cannot be read (no transparent huge pages)"
    return "transparent huge pages are off here ([never])" if "[never]" in mode else None


@functools.lru_cache(maxsize=4)
def _thp_mode(path: Path) -> str | None:
    """The kernel's THP mode line, read once per process (a model's ~300 large tensors each ask)."""
    try:
        return path.read_text()
    except OSError:
        return None


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor ``t`` (2 MB or more) in memory advised ``MADV_HUGEPAGE`` over its whole 2 MB-aligned
    chunks (a tail stays on 4 KB pages: no resident memory added), or ``t`` itself where that does not apply
    (another device, smaller, :func:`huge_pages_reason`). The kernels stream these bytes once per token: on 4 KB
    pages each 4 KB row starts a new page (a TLB miss, and the hardware prefetchers stop at the page's end);
    huge pages made the one-token 2:4 GEMM 20-27 % faster on 4096-input layers (cpu24-notes.md §26)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE or huge_pages_reason():
        return t
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds the mapping for as long as the tensor lives
    off = (-raw.data_ptr()) % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, off, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:
        return t
    return raw[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)


def state_on_huge_pages(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compressed state with each tensor through :func:`on_huge_pages` (how a CPU 2:4 layer holds it)."""
    return {k: on_huge_pages(t) for k, t in state.items()}


def compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``(out, in)`` exactly-2:4 weight → ``{"values": (out, in/2), "meta": (out, ceil(in/8)) uint8}``."""
    out_f, in_f = weight.shape
    keep = nm_mask(weight, 2, 4).reshape(out_f, in_f // 4, 4)  # the non-zeros, ties to the lower index
    groups = weight.reshape(out_f, in_f // 4, 4)
    values = groups[keep].reshape(out_f, in_f // 2)  # boolean indexing keeps row-major order
    pos = torch.arange(4, dtype=torch.uint8, device=weight.device).expand_as(groups)[keep].reshape(out_f, in_f // 2)
    return {"values": values.contiguous(), "meta": pack_positions(pos)}


def pack_positions(pos: torch.Tensor) -> torch.Tensor:
    """``(out, in/2)`` positions 0..3 → ``(out, ceil(in/8))`` uint8, value ``j`` at bits ``2j`` of its row."""
    out_f, kept = pos.shape
    pad = (-kept) % 4
    if pad:
        pos = torch.cat([pos, pos.new_zeros(out_f, pad)], dim=1)
    p = pos.reshape(out_f, -1, 4).to(torch.uint8)
    return (p[..., 0] | (p[..., 1] << 2) | (p[..., 2] << 4) | (p[..., 3] << 6)).contiguous()


# the six nibbles (p0 | p1 << 2, p0 < p1) a group of a 2:4 row can have
_PAIR_NIBBLES = (0b0100, 0b1000, 0b1100, 0b1001, 0b1101, 0b1110)


def bad_position_rows(meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """Indices of the rows of ``meta`` (``(out, ceil(in/8))``) whose groups do not each hold two distinct
    positions in ascending order (what :func:`compress` writes): such bytes are not a 2:4 weight."""
    ok = torch.zeros(16, dtype=torch.bool)
    ok[list(_PAIR_NIBBLES)] = True
    m = meta.to(torch.long)
    good = ok[m & 15]
    hi = ok[m >> 4]
    if in_features % 8:  # the last byte's high nibble is padding
        hi[:, -1] = True
    return torch.nonzero(~(good & hi).all(dim=1)).flatten()


class BadPositionsError(CastError, ValueError):
    """A compressed weight's positions are not a 2:4 row's (a damaged or planted file)."""


def check_positions(meta: torch.Tensor, in_features: int, name: str) -> None:
    """Raise a one-line :class:`BadPositionsError` naming ``name`` where a row's positions are not a 2:4 row's
    (the CLI prints it as one line, like every :class:`~cast_llm.errors.CastError`)."""
    bad = bad_position_rows(meta, in_features)
    if bad.numel():
        raise BadPositionsError(f"{name}: {bad.numel()} row(s) (first {int(bad[0])}) of the positions do not keep "
                                f"two distinct positions of each group of four in order: not a 2:4 compressed "
                                f"weight (export the model again: cast-llm export --format compressed)")


def unpack_positions(meta: torch.Tensor, kept: int) -> torch.Tensor:
    """Inverse of :func:`pack_positions`: ``(out, kept)`` uint8 positions."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=meta.device)
    return ((meta.unsqueeze(-1) >> shifts) & 3).reshape(meta.shape[0], -1)[:, :kept]


def decompress(state: dict[str, torch.Tensor], out_features: int, in_features: int) -> torch.Tensor:
    """The dense ``(out, in)`` weight (int8 values come back dequantized, in fp32)."""
    values = state["values"]
    if "scale" in state:
        values = values.float() * state["scale"].unsqueeze(1)
    pos = unpack_positions(state["meta"], in_features // 2).reshape(out_features, in_features // 4, 2).long()
    dense = torch.zeros(out_features, in_features // 4, 4, dtype=values.dtype, device=values.device)
    return dense.scatter_(2, pos, values.reshape(out_features, in_features // 4, 2)).reshape(out_features, in_features)


def quantize_values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """2:4 + W8: the kept values as int8 with one fp32 scale per output row (symmetric, round to nearest)."""
    v = state["values"].float()
    scale = v.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(v / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return {"values": q.contiguous(), "meta": state["meta"], "scale": scale.contiguous()}


# ------------------------------------------------------------------------------------------------ the ops
def sparse24_mm(path: str, x2d: torch.Tensor, state: dict[str, torch.Tensor], bias: torch.Tensor | None):
    """``(n, in)`` → ``(n, out)`` in ``x2d``'s dtype, by instruction path ``path``."""
    return load_extension().sparse24_mm(x2d, state["values"], state["meta"], state.get("scale"), bias, PATHS[path])


_SCRATCH: dict[tuple, torch.Tensor] = {}  # (out, in, dtype) -> the one dense buffer layers of that shape share


def unpack_mm(x2d: torch.Tensor, state: dict[str, torch.Tensor], bias: torch.Tensor | None, out_features: int):
    """The dense weight rebuilt into a scratch buffer shared by every layer of this shape, then torch's dense
    GEMM: what large token counts (prefill) run when a layer holds only its compressed form. (Not for two
    threads running forwards of one model at once: they would share the buffer.)"""
    values = state["values"]
    key = (out_features, x2d.shape[1], values.dtype)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty(out_features, x2d.shape[1], dtype=values.dtype)
    load_extension().unpack24_out(buf, values, state["meta"])
    return torch.nn.functional.linear(x2d, buf, bias)


def scratch_bytes() -> int:
    """Bytes held by the shared unpack buffers (counted in a model's resident memory)."""
    return sum(b.numel() * b.element_size() for b in _SCRATCH.values())


def dense_path() -> str | None:
    """The instruction path the careful dense GEMM runs here (``avx512-bf16``: vdpbf16ps; ``avx2``: bf16 weights
    widened in registers, fp32 FMA), None where it cannot run."""
    paths = available_paths()
    return next((p for p in ("avx512-bf16", "avx2") if p in paths), None)


def dense_unavailable_reason() -> str | None:
    """Why the careful dense GEMM cannot run here (None: it can)."""
    why = extension_reason()
    if why:
        return why
    return None if dense_path() else "this CPU has neither AVX512-BF16 nor AVX2+FMA"


def dense_mm(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dense bf16 GEMM of the same build, written with the same care as the 2:4 one (same threading and
    blocks; vdpbf16ps where the CPU has AVX512-BF16, else AVX2 FMA on weights widened in registers): the careful
    dense baseline, and the LM head's GEMV where it measures faster (:mod:`.dense_cpu`)."""
    return load_extension().dense_mm(x2d, weight, bias)
