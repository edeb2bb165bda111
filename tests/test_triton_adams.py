"""The multi-tensor Triton AdamS kernels (method.md §2, Eq. 6-8) and every CUDA path of AdamS against the
float64 reference.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), in a
process per test (forked from a warm server: conftest's ``triton_interpreter``) because Triton picks the
interpreter when it decorates the kernels (at import): the
update kernel against the float64 single-tensor reference, the mask kernel against ``nm_mask`` bit for bit,
the AdamS class on its kernel path over many steps with mask refreshes, and a resume from a state dict in
mid-run. Small tiles (:func:`small_tiles`) make tiny tensors span several programs and end in ragged tails,
so each check takes seconds. On a CUDA machine the same checks run on the compiled kernels (marked cuda).
"""

from __future__ import annotations

import importlib.util
import io
import textwrap

import pytest
import torch

from cast_llm.optim import functional
from cast_llm.optim.adams import AdamS
from cast_llm.sparsity.mask import magnitude_mask, nm_mask, pack_mask

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
# several tensors of different lengths in ONE launch: a partial packed byte (5x12 = 60 entries), lengths
# that are not a multiple of a tile, several chunks per tensor (24x40 = 960 = 3.75 chunks of small_tiles'
# 256), tiny ones
SHAPES = [(5, 12), (24, 40), (12, 8), (4, 4), (3, 36)]
# every length a multiple of 16 (and fresh, aligned allocations): the vectorised UNIT = 16 variant
ALIGNED_SHAPES = [(16, 64), (32, 32), (8, 16)]


def small_tiles() -> None:
    """Tiles of 64 entries and chunks of 256, so that the tiny test tensors exercise the chunk loop. The checks
    before first use (cast_llm.kernels) still run at the shipped sizes, the ones their inputs are made for (two
    16K chunks; at the small sizes they are 320 tiles a launch, most of these tests' time in the interpreter)."""
    from cast_llm.kernels import registry
    from cast_llm.optim import triton_adams

    shipped = triton_adams._BLOCK, triton_adams._CHUNK
    triton_adams._BLOCK, triton_adams._CHUNK = 64, 256
    probe = registry._probe

    def probe_at_shipped_sizes(*args, **kwargs):
        small = triton_adams._BLOCK, triton_adams._CHUNK
        triton_adams._BLOCK, triton_adams._CHUNK = shipped
        try:
            return probe(*args, **kwargs)
        finally:
            triton_adams._BLOCK, triton_adams._CHUNK = small

    registry._probe = probe_at_shipped_sizes


def _steps(n: int, device) -> list[torch.Tensor]:
    return [torch.zeros((), dtype=torch.float32, device=device) for _ in range(n)]


# ------------------------------------------------------------------------------------- check functions
def check_update(device: str, dtype: torch.dtype, state_dtype: torch.dtype | None = None, packed: bool = False,
                 decay_mode: str = "proportional", weight_decay: float = 0.0, maximize: bool = False,
                 aligned: bool = False, steps: int = 8) -> dict[str, float]:
    """``fused_adams_`` on ``device`` against the single-tensor reference in float64 on the CPU, from the same
    start, with the same gradients and (fixed) masks; returns the relative errors per state."""
    from cast_llm.optim.triton_adams import fused_adams_

    state_dtype = state_dtype or dtype
    shapes = ALIGNED_SHAPES if aligned else SHAPES
    g = torch.Generator().manual_seed(0)
    theta0 = [0.05 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]  # weights cross 0
    masks = [nm_mask(w) for w in theta0]
    # start from non-zero moments so that the first steps already exercise every term
    mu0 = [1e-3 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    v0 = [1e-6 * torch.rand(s, generator=g, dtype=torch.float64) for s in shapes]
    hp = dict(beta1=0.9, beta2=0.99, lr=0.01, eps=1e-8, l1_decay=0.2, total_steps=5, weight_decay=weight_decay,
              maximize=maximize, decay_mode=decay_mode)

    def copies(xs, dt, dev):
        return [x.to(device=dev, dtype=dt).clone() for x in xs]

    # the kernel sees the low-precision start values; the reference starts from exactly the same numbers
    P, MU, V = copies(theta0, dtype, device), copies(mu0, state_dtype, device), copies(v0, state_dtype, device)
    RP, RMU, RV = (copies([x.cpu() for x in xs], torch.float64, "cpu") for xs in (P, MU, V))
    K = [(pack_mask(m) if packed else m).to(device) for m in masks]
    steps_k, steps_r = _steps(len(shapes), device), _steps(len(shapes), "cpu")
    for _ in range(steps):  # beyond total_steps: α saturates at 1
        grads = [1e-3 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        G = copies(grads, dtype, device)
        RG = copies([x.cpu() for x in G], torch.float64, "cpu")
        fused_adams_(P, G, MU, V, K, steps_k, **hp)
        functional._single_tensor_adams(RP, RG, RMU, RV, masks, steps_r, **hp)
    assert [float(s) for s in steps_k] == [float(steps)] * len(shapes)  # t incremented on the device

    # fp32: the worst entry. bf16: the mean — a pruned weight that the decay drives to 0 oscillates around it
    # with amplitude lr, and where rounding puts the two runs on opposite sides of 0 they then differ by
    # ~2 lr; with thousands of such entries a few always do, in any low-precision implementation.
    def rel(xs, refs, dt):
        reduce = torch.amax if dt == torch.float32 else torch.mean
        return max(float(reduce((x.cpu().double() - r).abs()) / reduce(r.abs()).clamp_min(1e-30))
                   for x, r in zip(xs, refs))

    return {"theta": rel(P, RP, dtype), "exp_avg": rel(MU, RMU, state_dtype),
            "exp_avg_sq": rel(V, RV, state_dtype)}


def tolerance(dtype: torch.dtype, state_dtype: torch.dtype | None, case: dict) -> float:
    """fp32 everywhere, worst entry: a few ulps per step — 1e-5 (torch's own fp32 reference path: 2-3e-7),
    1e-4 in the worse-conditioned additive mode (torch's fp32 path: 1e-5 there). A bf16 parameter or state,
    on average: torch's bf16 reference path is off by 0.2-1.8 % after 12 steps (μ stored in bf16
    accumulates its rounding); the kernel rounds once per store, so 3 % (after 8 steps here)."""
    if dtype == torch.float32 and (state_dtype or dtype) == torch.float32:
        return 1e-4 if case.get("decay_mode") == "additive" else 1e-5
    return 3e-2


UPDATE_CASES = [
    dict(packed=False), dict(packed=True), dict(packed=True, weight_decay=0.1), dict(packed=False, maximize=True),
    dict(packed=True, decay_mode="additive"), dict(packed=False, aligned=True), dict(packed=True, aligned=True),
]
FP32 = (torch.float32, torch.float32)
# (parameter dtype, state dtype, case): fp32 states with bf16 parameters, and bf16 states like the parameter
LOW_PRECISION = [
    (torch.bfloat16, torch.float32, dict(packed=False)),
    (torch.bfloat16, torch.float32, dict(packed=True, decay_mode="additive")),
    (torch.bfloat16, torch.float32, dict(packed=True, aligned=True)),
    (torch.bfloat16, torch.bfloat16, dict(packed=True, weight_decay=0.1)),
]
# every case: fp32 first, then the low-precision ones
ALL_CASES = [(*FP32, case) for case in UPDATE_CASES] + LOW_PRECISION


def check_update_cases(device: str, cases=ALL_CASES) -> None:
    for dtype, state_dtype, case in cases:
        err = check_update(device, dtype, state_dtype, **case)
        assert max(err.values()) < tolerance(dtype, state_dtype, case), (case, dtype, state_dtype, err)


def check_masks(device: str) -> None:
    """``fused_nm_masks`` equals ``magnitude_mask`` (nm_mask's ties-to-the-lower-index rule) bit for bit, for
    both layouts and storages, several N:M patterns, fp32/bf16/fp16, ties and ±0 everywhere."""
    from cast_llm.optim.triton_adams import fused_nm_masks

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for transposed in (False, True):
            # every pattern in fp32; the low-precision dtypes only change how |w| is loaded
            for n, m in ((2, 4), (1, 4), (1, 3), (3, 8)) if dtype == torch.float32 else ((2, 4),):
                # m divides the grouped dim; partial packed bytes (e.g. 3 x 12, 6 x 3); 10m x 20 spans chunks
                shapes = [(2 * m, 3), (3 * m, 4 * m), (10 * m, 20)] if transposed else \
                    [(3, 4 * m), (5, 2 * m), (20, 10 * m)]
                # a few distinct magnitudes, with signs and zeros of both signs: ties in most groups
                ws = [(torch.randint(-3, 4, s, generator=g) * 0.25).to(device=device, dtype=dtype) for s in shapes]
                ws[0][0, :] = -0.0
                for packed in (False, True):
                    got = fused_nm_masks(ws, transposed=transposed, n=n, m=m, packed=packed)
                    for w, mask in zip(ws, got):
                        want = magnitude_mask(w, transposed, n, m)
                        want = pack_mask(want) if packed else want
                        assert torch.equal(mask, want), (dtype, transposed, n, m, packed, tuple(w.shape))


def train(device, dtype, *, fused=None, foreach=None, storage="bool", decay_mode="proportional", steps=15,
          interval=3, seed=1):
    """A sparse (Linear-style), a transposed (Conv1D-style) and a dense group, masks recomputed every
    ``interval`` steps; returns the parameters (float64, CPU) and the optimizer."""
    g = torch.Generator().manual_seed(seed)
    init = [0.05 * torch.randn(s, generator=g, dtype=torch.float64) for s in ((16, 64), (32, 8), (10,), (24, 12))]
    params = [torch.nn.Parameter(x.to(device=device, dtype=dtype)) for x in init]
    groups = [{"params": [params[0], params[3]], "sparse": True},
              {"params": [params[1]], "sparse": True, "transposed": True}, {"params": [params[2]]}]
    opt = AdamS(groups, lr=0.01, l1_decay=0.2, total_steps=10, mask_interval=interval, foreach=foreach,
                fused=fused, mask_storage=storage, decay_mode=decay_mode)
    for _ in range(steps):
        for p in params:
            p.grad = (1e-3 * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
        opt.step()
    return [p.detach().cpu().double() for p in params], opt


def check_class(device: str, dtype=torch.float32, storage="bool", decay_mode="proportional") -> None:
    """AdamS on the kernel path (one update launch per sparse group and step, one mask launch per sparse
    group at every refresh) against the float64 reference path, 15 steps with refreshes every 3."""
    from cast_llm.kernels import registry as kernels
    from cast_llm.optim import triton_adams

    calls = {"update": 0, "mask": 0}
    real_update, real_masks = triton_adams.fused_adams_, triton_adams.fused_nm_masks

    def update(*a, **k):
        calls["update"] += not kernels.probing()  # the checks before first use (cast_llm.kernels) do not count
        return real_update(*a, **k)

    def masks(*a, **k):
        calls["mask"] += not kernels.probing()
        return real_masks(*a, **k)

    triton_adams.fused_adams_, triton_adams.fused_nm_masks = update, masks
    try:
        got, opt = train(device, dtype, storage=storage, decay_mode=decay_mode)
    finally:
        triton_adams.fused_adams_, triton_adams.fused_nm_masks = real_update, real_masks
    # 2 sparse groups x 15 steps; masks at t = 1 (first) and t = 3, 6, 9, 12, 15
    assert calls == {"update": 30, "mask": 12}, calls
    ref, ref_opt = train("cpu", torch.float64, foreach=False, storage=storage, decay_mode=decay_mode)
    for a, b in zip(got, ref):
        if dtype == torch.float32:  # the additive mode is worse conditioned (see tolerance())
            tol = 10 if decay_mode == "additive" else 1
            torch.testing.assert_close(a, b, rtol=1e-5 * tol, atol=1e-7 * tol)
        else:
            assert float((a - b).abs().mean()) < 0.03 * float(b.abs().mean())
    if dtype == torch.float32:  # the same weights, so the same masks
        for a, b in zip(opt.masks().values(), ref_opt.masks().values()):
            assert torch.equal(a.cpu(), b)
    for p, state in opt.state.items():  # counts where the path that updates p reads them
        assert state["step"].device == p.device and float(state["step"]) == 15


def check_resume(device: str, storage_saved="packed", storage_loaded="bool", dtype=torch.float32,
                 via_cpu=False) -> None:
    """Save the state dicts at t = 7 (between mask refreshes: next at t = 9), continue; a fresh model and
    optimizer loaded from them continue bitwise identically (weights, masks, moments, counts).
    ``via_cpu``: the checkpoint is loaded onto the CPU first (step counts and all), as a sharded or
    CPU-mapped checkpoint is."""
    def make(storage):
        torch.manual_seed(4)
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        model.to(device=device, dtype=dtype)
        groups = [{"params": [model[0].weight, model[2].weight], "sparse": True},
                  {"params": [model[0].bias, model[2].bias]}]
        return model, AdamS(groups, lr=0.01, l1_decay=0.05, total_steps=30, mask_interval=3, mask_storage=storage)

    data = torch.randn(20, 32, 16, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=dtype)

    def run(model, opt, batches):
        for x in batches:
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()

    model, opt = make(storage_saved)
    run(model, opt, data[:7])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, opt, data[7:])

    resumed_model, resumed_opt = make(storage_loaded)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True, map_location="cpu" if via_cpu else None)
    resumed_model.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    run(resumed_model, resumed_opt, data[7:])

    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.masks().values(), resumed_opt.masks().values()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], resumed_opt.state[q][key]), key
        assert resumed_opt.state[q]["step"].device == q.device and float(resumed_opt.state[q]["step"]) == 20


# ------------------------------------------------------------------------- under Triton's interpreter
def _in_interpreter(triton_interpreter, code: str) -> None:
    prog = "import torch\nimport test_triton_adams as t\nt.small_tiles()\n" + textwrap.dedent(code) + "\nprint('ok')\n"
    out = triton_interpreter.run(prog)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
    # every kernel a path chose passed its check: none failed (float64 goes to the reference unprobed)
    assert "failed its check" not in out.stderr, out.stderr[-4000:]


interpreter = pytest.mark.skipif(not HAS_TRITON or HAS_CUDA,
                                 reason="needs Triton (its interpreter runs the kernels on CPU tensors); a GPU "
                                        "runs the compiled kernels in the cuda tests instead")


@interpreter
@pytest.mark.parametrize("part", [0, 1])
def test_update_kernel_matches_float64_reference_in_interpreter(triton_interpreter, part):
    # 11 cases, split in two processes of a few seconds each
    _in_interpreter(triton_interpreter, f"t.check_update_cases('cpu', t.ALL_CASES[{part}::2])")


@interpreter
def test_update_kernel_default_tiles_in_interpreter(triton_interpreter):
    # the shipped tile and chunk sizes: a 40 x 1100 tensor spans 3 chunks of 16 tiles
    _in_interpreter(triton_interpreter, """
        from cast_llm.optim import triton_adams
        triton_adams._BLOCK, triton_adams._CHUNK = 1024, 16 * 1024
        t.SHAPES = [(40, 1100), (6, 20)]
        err = t.check_update('cpu', torch.float32, packed=True, steps=4)
        assert max(err.values()) < 1e-5, err
    """)


@interpreter
def test_mask_kernel_equals_nm_mask_in_interpreter(triton_interpreter):
    _in_interpreter(triton_interpreter, "t.check_masks('cpu')")


CLASS_CASES = [("float32", "bool", "proportional"), ("float32", "packed", "additive"),
               ("bfloat16", "packed", "proportional"), ("bfloat16", "bool", "additive")]


@interpreter
@pytest.mark.parametrize("dtype,storage,mode", CLASS_CASES)
def test_adams_kernel_path_matches_reference_in_interpreter(triton_interpreter, dtype, storage, mode):
    _in_interpreter(triton_interpreter, f"t.check_class('cpu', torch.{dtype}, storage='{storage}', decay_mode='{mode}')")


@interpreter
def test_adams_kernel_path_resumes_bitwise_in_interpreter(triton_interpreter):
    _in_interpreter(triton_interpreter, """
        t.check_resume('cpu', 'packed', 'bool')
        t.check_resume('cpu', 'bool', 'bool', dtype=torch.bfloat16)
        t.test_refresh_masks_recomputes_every_mask_from_the_current_weights()  # through the mask kernel
    """)


# ----------------------------------------------------------------------------------------- CPU only
def test_step_counts_move_between_devices_without_reading_them():
    """A count moves to where its path reads it, rebuilt from the host copy of t: a meta tensor (which
    cannot be read at all) stands for a CUDA one here."""
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = AdamS([{"params": [w], "sparse": True}], total_steps=10)
    for _ in range(3):
        w.grad = torch.randn(4, 8)
        opt.step()
    state = opt.state[w]
    opt._place_step(w, state, torch.device("meta"))
    assert state["step"].device.type == "meta"
    opt._place_step(w, state, torch.device("cpu"))
    assert state["step"].device.type == "cpu" and float(state["step"]) == 3.0
    w.grad = torch.randn(4, 8)
    opt.step()
    assert float(state["step"]) == 4.0


def test_host_counts_are_rebuilt_after_a_load():
    ws = [torch.nn.Parameter(torch.randn(4, 8)) for _ in range(2)]
    opt = AdamS([{"params": ws, "sparse": True}], total_steps=10, mask_interval=3)
    for _ in range(2):
        for w in ws:
            w.grad = torch.randn(4, 8)
        opt.step()
    sd = opt.state_dict()
    fresh = AdamS([{"params": ws, "sparse": True}], total_steps=10, mask_interval=3)
    fresh.load_state_dict(sd)
    masks = [fresh.mask(w).clone() for w in ws]
    for w in ws:
        w.data.mul_(-1).add_(torch.randn(4, 8))  # a refresh at t = 3 would now pick other entries
        w.grad = torch.randn(4, 8)
    fresh.step()  # t = 3: the loaded counts (2) say this step refreshes the masks
    assert any(not torch.equal(m, fresh.mask(w)) for m, w in zip(masks, ws))
    assert fresh._host_steps == {w: 3 for w in ws}


def test_refresh_masks_recomputes_every_mask_from_the_current_weights():
    ws = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(12, 4))]
    opt = AdamS([{"params": ws[:1], "sparse": True}, {"params": ws[1:], "sparse": True, "transposed": True}],
                total_steps=10, mask_interval=0, mask_storage="packed")
    for w in ws:
        w.grad = torch.randn_like(w)
    opt.step()
    with torch.no_grad():
        for w in ws:
            w.mul_(torch.randn_like(w))
    opt.refresh_masks()
    for w, transposed in zip(ws, (False, True)):
        assert torch.equal(opt.mask(w), magnitude_mask(w, transposed, 2, 4))


def test_block_wise_fast_path_is_cpu_only():
    x = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match="CPU fast path"):
        functional._multi_tensor_adams([x], [x], [x], [x], [torch.ones(4, 8, dtype=torch.bool)],
                                       [torch.tensor(0.0)], beta1=0.9, beta2=0.99, lr=0.1, eps=1e-8, l1_decay=0.0,
                                       total_steps=3, weight_decay=0.0, maximize=False)


@pytest.mark.skipif(HAS_TRITON and HAS_CUDA, reason="the kernel is available here")
def test_fused_true_without_the_kernel_says_why():
    with pytest.raises(ValueError, match="fused=True needs the Triton kernel"):
        AdamS([torch.nn.Parameter(torch.zeros(4, 8))], total_steps=3, fused=True)
    with pytest.raises(ValueError, match="exclude each other"):
        AdamS([torch.nn.Parameter(torch.zeros(4, 8))], total_steps=3, fused=True, foreach=False)


# ----------------------------------------------------------------------------------------------- CUDA
cuda_triton = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and Triton")


@pytest.mark.cuda
@cuda_triton
@pytest.mark.parametrize("dtype,state_dtype,case", ALL_CASES,
                         ids=[f"{d}-{s}-" .replace("torch.", "") + "-".join(f"{k}={v}" for k, v in c.items())
                              for d, s, c in ALL_CASES])
def test_update_kernel_matches_float64_reference_on_cuda(dtype, state_dtype, case):
    err = check_update("cuda", dtype, state_dtype, **case)
    assert max(err.values()) < tolerance(dtype, state_dtype, case), err


@pytest.mark.cuda
@cuda_triton
def test_mask_kernel_equals_nm_mask_on_cuda():
    check_masks("cuda")


@pytest.mark.cuda
@cuda_triton
@pytest.mark.parametrize("dtype,storage,mode", CLASS_CASES)
def test_adams_kernel_path_matches_reference_on_cuda(dtype, storage, mode):
    check_class("cuda", getattr(torch, dtype), storage=storage, decay_mode=mode)


@pytest.mark.cuda
@cuda_triton
@pytest.mark.parametrize("via_cpu", [False, True])
def test_adams_kernel_path_resumes_bitwise_on_cuda(via_cpu):
    check_resume("cuda", "packed", "bool", via_cpu=via_cpu)
    check_resume("cuda", "bool", "packed", via_cpu=via_cpu)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("storage", ["bool", "packed"])
def test_reference_path_on_cuda_matches_float64_reference(storage):
    """fused=False (and what a CUDA user without Triton gets): the single-tensor reference on CUDA, counts
    on the CPU; dense groups through torch's foreach Adam."""
    ref, _ = train("cpu", torch.float64, foreach=False, storage=storage)
    got, opt = train("cuda", torch.float32, fused=False, storage=storage)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(s["step"].device.type == "cpu" for s in opt.state.values())


@pytest.mark.cuda
@cuda_triton
def test_kernel_path_does_not_synchronise_on_cuda():
    """After warm-up, a step with nonfinite='ignore' never waits for the device (torch's sync debug mode
    raises on any synchronising call); counts stay on the device, masks refresh on it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in ((64, 128), (32, 64), (16,))]
    opt = AdamS([{"params": ws[:2], "sparse": True}, {"params": ws[2:]}], total_steps=50, mask_interval=2,
                nonfinite="ignore")
    for p in ws:
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(4):  # two of them refresh the masks
            opt.param_groups[0]["lr"] = 1e-3 * (i + 1)  # a schedule: new hyperparameters every step
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(s["step"].is_cuda and float(s["step"]) == 7 for s in opt.state.values())


@pytest.mark.cuda
@cuda_triton
def test_fused_true_uses_the_kernel_and_refuses_float64(monkeypatch):
    from cast_llm.optim import triton_adams

    calls = []
    real = triton_adams.fused_adams_
    monkeypatch.setattr(triton_adams, "fused_adams_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    train("cuda", torch.float32, fused=True, steps=2)
    assert calls
    with pytest.raises(RuntimeError, match="cannot use the fused Triton kernel"):
        train("cuda", torch.float64, fused=True, steps=1)
    calls.clear()
    train("cuda", torch.float32, fused=False, steps=2)
    assert not calls


# -------------------------------------------------------------------------------- compiled for sm_90
def _compile(kernel, sig: dict, consts: dict):  # ~1-5 s: Triton -> PTX -> cubin, as the JIT would on a GPU
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cast_llm.optim.triton_adams import _NUM_WARPS

    sig = dict(sig) | {name: "constexpr" for name in consts}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": _NUM_WARPS})


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its bundled ptxas compiles without a GPU)")
@pytest.mark.parametrize("param,state,packed,unit", [("fp32", "fp32", False, 16), ("bf16", "fp32", True, 16),
                                                     ("bf16", "bf16", False, 16), ("fp16", "fp16", False, 1)])
def test_update_kernel_compiles_for_h100_with_vector_loads(param, state, packed, unit):
    """Compile the update kernel for sm_90 (H100) ahead of time, as the JIT would on a GPU: every variant the
    host can pick must compile, with IEEE sqrt/division, and the aligned ones with 16-byte vector accesses."""
    from cast_llm.optim.triton_adams import _BLOCK, _CHUNK, _update_kernel

    sig = {"work_ptr": "*i32", "table_ptr": "*i64", "scal_ptr": "*fp32", "skip_ptr": "*fp32", "theta0": f"*{param}",
           "grad0": f"*{param}", "mu0": f"*{state}", "v0": f"*{state}", "mask0": "*u8"}
    consts = dict(PACKED=packed, ADDITIVE=False, MAXIMIZE=False, WEIGHT_DECAY=True, LERP_FROM_END=False,
                  UNIT=unit, BLOCK=_BLOCK, CHUNK=_CHUNK, EXACT_BF16=False, HAS_SKIP=True)
    ptx = _compile(_update_kernel, sig, consts).asm["ptx"]
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
    assert ("ld.global.v4" in ptx) == (unit == 16)  # UNIT = 1: scalar accesses, any alignment


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its bundled ptxas compiles without a GPU)")
def test_scalar_and_mask_kernels_compile_for_h100():
    from cast_llm.optim.triton_adams import _BLOCK, _CHUNK, _LANES, _mask_kernel, _scalars_kernel

    sig = {"table_ptr": "*i64", "hp_ptr": "*fp64", "scal_ptr": "*fp32", "skip_ptr": "*fp32", "n_tensors": "i32",
           "step0": "*fp32"}
    ptx = _compile(_scalars_kernel, sig, dict(LANES=_LANES, HAS_SKIP=True)).asm["ptx"]
    assert "div.rn.f64" in ptx  # the bias corrections in float64, IEEE-rounded
    for dtype, transposed, packed in (("bf16", True, True), ("fp32", False, False)):
        sig = {"work_ptr": "*i32", "mtab_ptr": "*i64", "theta0": f"*{dtype}", "out0": "*u8"}
        consts = dict(N=2, M=4, TRANSPOSED=transposed, PACKED=packed, BLOCK=_BLOCK, CHUNK=_CHUNK)
        assert _compile(_mask_kernel, sig, consts).asm["cubin"]
