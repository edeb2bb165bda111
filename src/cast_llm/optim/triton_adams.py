"""AdamS (method.md §2, Eq. 6-8) on CUDA as multi-tensor Triton kernels: a whole parameter group per launch.

Three kernels, each launched ONCE for all the tensors of a group:

* ``_scalars_kernel`` (one lane per tensor): ``t ← t + 1`` on the device step count, then α_t = min(t/T, 1),
  the bias corrections and the other per-step scalars, computed in float64 from a small hyperparameter
  vector and stored as float32 in a per-tensor scalar table. No host reads ``t``: no synchronisation.
* ``_update_kernel``: Eq. 7-8 in one pass over memory. Per element it reads θ, g, μ, v and the mask (1 byte
  as bool, or 1 bit packed) and writes θ, μ, v — what ``AdamW(fused=True)`` moves plus the mask::

      θ ← θ (1 - lr·wd)                                         (decoupled weight decay, if any)
      μ ← lerp(μ, ±g, 1-β1)                                      (μ_t: the loss gradient only)
      s = (1-α) μ + α λ sign(θ)     [additive mode: μ + α λ θ]   (Eq. 7, for every entry)
      μ~ = μ where kept else s
      v ← β2 v + (1-β2) μ~²                                      (from μ~, every entry)
      θ ← θ - lr/(1-β1^t) · μ~ / (sqrt(v) / sqrt(1-β2^t) + ε)    (Eq. 8)

  Arithmetic is float32 whatever the storage (fp32/bf16/fp16 parameters, states fp32 or like the
  parameter), rounded once per store, with IEEE-rounded sqrt and division like torch's CUDA kernels.
* ``_mask_kernel`` (at the mask-refresh steps): Eq. 6, the N:M magnitude mask of every tensor, groups of M
  along the last dim or, for transposed (Conv1D) targets, along dim 0; ties go to the lower index exactly
  as :func:`cast_llm.sparsity.mask.nm_mask`. It writes NEW mask tensors (bool or packed).

Layout of the work, after torch's ``multi_tensor_apply`` (``MultiTensorApply.cuh``: every CUDA block takes
one 64K-element chunk of one tensor, found through ``block_to_tensor`` / ``block_to_chunk``). torch passes
that table in the kernel's 4 KB argument block, so it needs one launch per ≤ 320 chunks (and per 36
tensors); here the tables live in device memory, so one launch covers any number of tensors:

* a work table, int32 ``(programs, 2)``: the (tensor, chunk) of every program — a pure function of the
  tensors' lengths, built once and cached. Each program walks its chunk of ``_CHUNK`` elements in tiles of
  ``_BLOCK``, so short tensors cost no idle programs and long ones no per-tile bookkeeping;
* a tensor table, int64 ``(tensors, 8)``: the addresses of θ, g, μ, v, mask and the step count, and the
  length. Re-uploaded (pinned memory, asynchronous) only when an address changes — gradients freed by
  ``zero_grad`` usually come back at the same addresses from the caching allocator, so most steps reuse
  it. Its content is a pure function of its cache key, so a cached table is never stale.

The kernels turn each int64 address into a typed pointer (cast to the pointer type of an "anchor" tensor
argument). When every address and length is a multiple of 16, they are stored divided by 16 and
multiplied back in the kernel, which tells the compiler their alignment: 16-byte vector loads and stores
(checked in the PTX by ``tests/test_triton_adams.py``).

Importing this module imports Triton; :func:`unavailable_reason` is the cheap guard that says why the
kernels cannot be used. With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (slowly, in numpy):
that is how they are tested on machines without a GPU — and then CPU tensors count as kernel tensors.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from cast_llm.kernels.switch import interpreting
from cast_llm.optim.adams_probes import fast_path_unsupported as unsupported_reason
from cast_llm.sparsity.mask import packed_numel
from cast_llm.triton_support import FP_FUSION, LRU, tl, to_device, triton
from cast_llm.triton_support import IMPORT_ERROR as _IMPORT_ERROR

__all__ = ["fused_adams_", "fused_nm_masks", "unavailable_reason", "unsupported_reason"]  # unsupported_reason: adams_probes'

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements per tile: 8 per thread at 4 warps — two 16-byte vectors of fp32 (one of bf16) per tensor.
_BLOCK = 1024
_NUM_WARPS = 4
# Elements per program (16 tiles). Small enough that SmolLM2's 110K-entry k/v projections still spread
# over 7 programs, large enough that the per-program lookups and scalars are noise (~0.5 MB moved each).
_CHUNK = 16 * _BLOCK
_LANES = 128  # tensors per program of the scalar kernel
# Row strides the kernels are written for: the tensor table has 8 int64 columns (θ, g, μ, v, mask, numel,
# step address, unused), the scalar table 16 float32 slots (10 used: 64-byte rows).
_SCALARS = 16

# Under Triton's interpreter the kernels run on CPU tensors; Triton reads the variable once, when it
# decorates them at import, and so does this module.
_INTERPRET = interpreting()


@functools.cache
def unavailable_reason() -> str | None:
    """None if the kernels can run here, else why not (Triton missing, or no CUDA device). Cached: it is
    asked for every parameter at every step."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not _INTERPRET and not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


if triton is not None:

    @triton.jit
    def _to_bf16_rtne(x):
        # fp32 -> bf16 rounded to nearest even, in integer arithmetic. Used under the interpreter only, whose
        # own conversion truncates (a GPU's cvt.rn is the same rounding as this).
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)  # NaN stays NaN (the rounding carry could make it Inf)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _store(ptrs, x, mask, EXACT_BF16: tl.constexpr):
        if EXACT_BF16 and ptrs.dtype.element_ty == tl.bfloat16:
            tl.store(ptrs, _to_bf16_rtne(x), mask=mask)
        else:
            tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["n_tensors"])
    def _scalars_kernel(table_ptr, hp_ptr, scal_ptr, skip_ptr, n_tensors, step0, LANES: tl.constexpr,
                        HAS_SKIP: tl.constexpr):
        # hp (float64): lr, β1, β2, ε, λ, T, weight_decay. One lane per tensor. skip (float32): a skipped step
        # (found_inf != 0) leaves the count as it was
        i = tl.program_id(0) * LANES + tl.arange(0, LANES)
        ok = i < n_tensors
        step_ptrs = tl.load(table_ptr + i.to(tl.int64) * 8 + 6, mask=ok, other=0).to(step0.dtype)
        t = tl.load(step_ptrs, mask=ok, other=0.0) + 1.0  # float32 as torch's: it counts up to 2^24 steps
        if HAS_SKIP:
            tl.store(step_ptrs, tl.where(tl.load(skip_ptr) != 0, t - 1.0, t), mask=ok)
        else:
            tl.store(step_ptrs, t, mask=ok)
        lr = tl.load(hp_ptr)
        beta1 = tl.load(hp_ptr + 1)
        beta2 = tl.load(hp_ptr + 2)
        eps = tl.load(hp_ptr + 3)
        l1 = tl.load(hp_ptr + 4)
        total = tl.load(hp_ptr + 5)
        wd = tl.load(hp_ptr + 6)
        td = t.to(tl.float64)
        alpha = tl.minimum(td / total, 1.0)
        # β^t by binary powering in float64 (a few ulps, so float32(1 - β^t) is that of the host's float64 pow)
        ti = t.to(tl.int32)
        p1 = tl.full([LANES], 1.0, tl.float64)
        p2 = tl.full([LANES], 1.0, tl.float64)
        b1 = beta1
        b2 = beta2
        for k in tl.static_range(25):  # the bits of t < 2^25
            bit = ((ti >> k) & 1) != 0
            p1 = tl.where(bit, p1 * b1, p1)
            p2 = tl.where(bit, p2 * b2, p2)
            b1 = b1 * b1
            b2 = b2 * b2
        lerp_w = 1.0 - beta1
        row = scal_ptr + i * 16
        tl.store(row + 0, (lr / (1.0 - p1)).to(tl.float32), mask=ok)  # step size lr / (1 - β1^t)
        tl.store(row + 1, tl.sqrt_rn((1.0 - p2).to(tl.float32)), mask=ok)  # sqrt(1 - β2^t)
        tl.store(row + 2, (alpha * l1).to(tl.float32), mask=ok)  # α_t λ
        tl.store(row + 3, (1.0 - alpha).to(tl.float32), mask=ok)
        tl.store(row + 4, lerp_w.to(tl.float32) + tl.zeros([LANES], tl.float32), mask=ok)
        tl.store(row + 5, (1.0 - lerp_w).to(tl.float32) + tl.zeros([LANES], tl.float32), mask=ok)
        tl.store(row + 6, beta2.to(tl.float32) + tl.zeros([LANES], tl.float32), mask=ok)
        tl.store(row + 7, (1.0 - beta2).to(tl.float32) + tl.zeros([LANES], tl.float32), mask=ok)
        tl.store(row + 8, eps.to(tl.float32) + tl.zeros([LANES], tl.float32), mask=ok)
        tl.store(row + 9, (1.0 - lr * wd).to(tl.float32) + tl.zeros([LANES], tl.float32), mask=ok)

    @triton.jit
    def _update_kernel(
        work_ptr,  # int32 (programs, 2): tensor and chunk of every program
        table_ptr,  # int64 (tensors, 8): θ, g, μ, v, mask addresses and numel (all ÷ UNIT), step address
        scal_ptr,  # float32 (tensors, 16): the per-step scalars of _scalars_kernel
        skip_ptr,  # float32 scalar (read only with HAS_SKIP): non-zero = a skipped step, nothing written
        theta0, grad0, mu0, v0, mask0,  # anchors: only their pointer TYPES are used
        PACKED: tl.constexpr, ADDITIVE: tl.constexpr, MAXIMIZE: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
        LERP_FROM_END: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
        EXACT_BF16: tl.constexpr, HAS_SKIP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tid = tl.load(work_ptr + 2 * pid).to(tl.int64)
        chunk = tl.load(work_ptr + 2 * pid + 1).to(tl.int64)
        row = table_ptr + tid * 8
        # "* UNIT": UNIT = 16 when the host found every address and length a multiple of 16 (else 1, e.g.
        # gradients that are views into a bucket). The compiler cannot know that of values read from
        # memory; told so, it uses 16-byte vector loads and stores.
        th_base = (tl.load(row) * UNIT).to(theta0.dtype)
        g_base = (tl.load(row + 1) * UNIT).to(grad0.dtype)
        mu_base = (tl.load(row + 2) * UNIT).to(mu0.dtype)
        v_base = (tl.load(row + 3) * UNIT).to(v0.dtype)
        k_base = (tl.load(row + 4) * UNIT).to(mask0.dtype)
        numel = tl.load(row + 5) * UNIT
        srow = scal_ptr + tid * 16
        step_size = tl.load(srow)
        bc2_sqrt = tl.load(srow + 1)
        decay = tl.load(srow + 2)
        one_minus_alpha = tl.load(srow + 3)
        lerp_w = tl.load(srow + 4)
        lerp_w_rest = tl.load(srow + 5)
        beta2 = tl.load(srow + 6)
        one_minus_beta2 = tl.load(srow + 7)
        eps = tl.load(srow + 8)
        wd_keep = tl.load(srow + 9)

        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, numel)
        if HAS_SKIP:
            end = tl.where(tl.load(skip_ptr) != 0, start, end)  # a skipped step: no tile, nothing written
        for off in range(start, end, BLOCK):
            off = tl.multiple_of(off, BLOCK)  # the loop counter hides that every tile starts on a BLOCK boundary
            offs = off + tl.arange(0, BLOCK)  # int64: tensors may exceed 2^31 entries
            inb = offs < numel
            th_ptrs = th_base + offs
            g_ptrs = g_base + offs
            mu_ptrs = mu_base + offs
            v_ptrs = v_base + offs
            if UNIT == 16:
                th_ptrs = tl.multiple_of(th_ptrs, 16)
                g_ptrs = tl.multiple_of(g_ptrs, 16)
                mu_ptrs = tl.multiple_of(mu_ptrs, 16)
                v_ptrs = tl.multiple_of(v_ptrs, 16)
            theta = tl.load(th_ptrs, mask=inb, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=inb, other=0.0).to(tl.float32)
            mu = tl.load(mu_ptrs, mask=inb, other=0.0).to(tl.float32)
            v = tl.load(v_ptrs, mask=inb, other=0.0).to(tl.float32)
            if PACKED:  # element i is bit (i % 8) of byte i // 8 (pack_mask's order)
                byte = tl.load(k_base + (offs >> 3), mask=inb, other=0).to(tl.int32)
                kept = ((byte >> (offs & 7).to(tl.int32)) & 1) != 0
            else:
                k_ptrs = k_base + offs
                if UNIT == 16:
                    k_ptrs = tl.multiple_of(k_ptrs, 16)
                kept = tl.load(k_ptrs, mask=inb, other=0) != 0

            if MAXIMIZE:
                g = -g
            if WEIGHT_DECAY:
                theta = theta * wd_keep  # decoupled (AdamW): before the sign of Eq. 7, as in the reference
            # μ_t = lerp(μ, g, 1-β1) with torch's two-sided formula (exact at both ends)
            if LERP_FROM_END:
                mu = g - (g - mu) * lerp_w_rest
            else:
                mu = mu + lerp_w * (g - mu)
            if ADDITIVE:  # AST: the decay added to the momentum signal
                s = theta * decay + mu
            else:  # Eq. 7: mixed with it by α; sign(NaN) stays NaN as in torch.sign
                sgn = tl.where(theta > 0, 1.0, tl.where(theta < 0, -1.0, 0.0))
                sgn = tl.where(theta != theta, theta, sgn)
                s = sgn * decay + mu * one_minus_alpha
            mt = tl.where(kept, mu, s)  # μ~: the decay never enters the stored μ
            v = v * beta2 + one_minus_beta2 * (mt * mt)
            # IEEE-rounded sqrt/div, as torch's CUDA kernels (Triton's defaults are approximate)
            denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
            theta = theta - step_size * tl.div_rn(mt, denom)

            _store(th_ptrs, theta, inb, EXACT_BF16)
            _store(mu_ptrs, mu, inb, EXACT_BF16)
            _store(v_ptrs, v, inb, EXACT_BF16)

    @triton.jit
    def _mask_kernel(
        work_ptr,  # int32 (programs, 2), as for _update_kernel
        mtab_ptr,  # int64 (tensors, 4): θ address, output address, numel, member stride C
        theta0, out0,  # anchors (pointer types)
        N: tl.constexpr, M: tl.constexpr, TRANSPOSED: tl.constexpr, PACKED: tl.constexpr,
        BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tid = tl.load(work_ptr + 2 * pid).to(tl.int64)
        chunk = tl.load(work_ptr + 2 * pid + 1).to(tl.int64)
        row = mtab_ptr + tid * 4
        th = tl.load(row).to(theta0.dtype)
        out = tl.load(row + 1).to(out0.dtype)
        numel = tl.load(row + 2)
        stride = tl.load(row + 3)  # distance between the members of a group: 1, or the row length (transposed)
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, numel)
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            inb = offs < numel
            # this entry's position j in its group and the group's first entry
            if TRANSPOSED:
                pos = (offs // stride) % M
                first = offs - pos * stride
            else:
                pos = offs % M
                first = offs - pos
            a = tl.abs(tl.load(th + offs, mask=inb, other=0.0).to(tl.float32))
            a = tl.where(a != a, float("inf"), a)  # NaN ranks as the largest magnitude (nm_mask refuses it)
            # beaten = how many members beat this one: a lower index with |w| >= a, a higher one with |w| > a
            # (nm_mask's rule: ties go to the lower index); kept iff fewer than N beat it
            beaten = tl.zeros([BLOCK], tl.int32)
            for r in tl.static_range(M):
                if TRANSPOSED:
                    w = tl.load(th + first + r * stride, mask=inb, other=0.0).to(tl.float32)
                else:
                    w = tl.load(th + first + r, mask=inb, other=0.0).to(tl.float32)
                w = tl.abs(w)
                w = tl.where(w != w, float("inf"), w)
                beats = tl.where(pos > r, w >= a, w > a)
                beaten += beats.to(tl.int32)
            kept = (beaten < N) & inb
            if PACKED:  # 8 consecutive entries -> one byte, entry 8i + j at bit j (pack_mask's order)
                bits = tl.reshape(kept.to(tl.int32), (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :]
                byte = tl.sum(bits, axis=1)
                boffs = (off >> 3) + tl.arange(0, BLOCK // 8)
                tl.store(out + boffs, byte.to(tl.uint8), mask=boffs < (numel + 7) // 8)
            else:
                tl.store(out + offs, kept.to(tl.uint8), mask=inb)


# ------------------------------------------------------------------------------------------------ host side
_WORK = LRU(16)  # (device, numels, chunk) -> work table
_TABLES = LRU(16)  # (device, addresses, numels, unit) -> tensor table
_HPARAMS = LRU(16)  # (device, hyperparameters) -> float64 vector

def _work_table(numels: tuple[int, ...], device: torch.device) -> Tensor:
    def make() -> Tensor:
        pairs = [(i, c) for i, n in enumerate(numels) for c in range(-(-n // _CHUNK))]
        return to_device(pairs, torch.int32, device).view(-1, 2)

    return _WORK.get_or((device, numels, _CHUNK), make)


def _device_ctx(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def fused_adams_(params, grads, exp_avgs, exp_avg_sqs, masks, state_steps, *, beta1, beta2, lr, eps, l1_decay,
                 total_steps, weight_decay, maximize, decay_mode="proportional", found_inf=None) -> None:
    """AdamS on lists of tensors through the multi-tensor kernels; the contract of
    :func:`cast_llm.optim.functional.adams`, except that ``state_steps`` are float32 scalars on the
    parameters' device (read and incremented there, as torch's fused Adam keeps them). Every tensor set
    must pass :func:`unsupported_reason`. One scalar launch and one update launch per (device, parameter
    dtype, state dtype, mask kind) — one of each for a usual parameter group. ``found_inf`` (a float32
    scalar on the device): non-zero skips the step in the kernels (counts kept), with no host read."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"fused AdamS kernel unavailable: {reason}")
    if not params:
        return
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype, exp_avgs[i].dtype, masks[i].dtype), []).append(i)
    hp = (float(lr), float(beta1), float(beta2), float(eps), float(l1_decay), float(total_steps),
          float(weight_decay), 0.0)
    consts = dict(ADDITIVE=decay_mode == "additive", MAXIMIZE=bool(maximize), WEIGHT_DECAY=weight_decay != 0,
                  LERP_FROM_END=1.0 - beta1 >= 0.5)
    for (device, _, _, mask_dtype), idx in groups.items():
        lists = [[x[i] for i in idx] for x in (params, grads, exp_avgs, exp_avg_sqs, masks, state_steps)]
        skip = None if found_inf is None else found_inf.to(device=device, dtype=torch.float32, non_blocking=True)
        _launch_update(device, *lists, hp=hp, packed=mask_dtype == torch.uint8, skip=skip, **consts)


def _launch_update(device, P, G, MU, V, K, ST, *, hp, packed, skip=None, **consts) -> None:
    addresses = [x.data_ptr() for xs in (P, G, MU, V, K) for x in xs]
    numels = tuple(p.numel() for p in P)
    steps = [s.data_ptr() for s in ST]
    unit = 16 if all(a % 16 == 0 for a in addresses) and all(n % 16 == 0 for n in numels) else 1
    key = (device, tuple(addresses), tuple(steps), numels, unit)

    def make() -> Tensor:
        n = len(P)
        rows = [[addresses[j * n + i] // unit for j in range(5)] + [numels[i] // unit, steps[i], 0]
                for i in range(n)]
        return to_device(rows, torch.int64, device)

    table = _TABLES.get_or(key, make)
    hparams = _HPARAMS.get_or((device, hp), lambda: to_device(list(hp), torch.float64, device))
    # a fresh scalar table per launch: two groups (or two streams) never share one
    scal = torch.empty((len(P), _SCALARS), dtype=torch.float32, device=device)
    work = _work_table(numels, device)
    has_skip = skip is not None
    skip = skip if has_skip else scal  # a placeholder pointer, never read
    with _device_ctx(device):
        _scalars_kernel[(triton.cdiv(len(P), _LANES),)](table, hparams, scal, skip, len(P), ST[0], LANES=_LANES,
                                                          HAS_SKIP=has_skip, enable_fp_fusion=FP_FUSION)
        _update_kernel[(work.shape[0],)](
            work, table, scal, skip, P[0], G[0], MU[0], V[0], K[0].view(torch.uint8), PACKED=packed, UNIT=unit,
            BLOCK=_BLOCK, CHUNK=_CHUNK, EXACT_BF16=_INTERPRET, HAS_SKIP=has_skip, num_warps=_NUM_WARPS,
            enable_fp_fusion=FP_FUSION, **consts,
        )  # fmt: skip


def fused_nm_masks(params: list[Tensor], *, transposed: bool, n: int, m: int, packed: bool) -> list[Tensor]:
    """Eq. 6 for every tensor of ``params`` in one launch per dtype: NEW masks, bool of each parameter's
    shape or packed (:func:`~cast_llm.sparsity.mask.pack_mask`'s 1-D uint8), equal to
    ``magnitude_mask(p, transposed, n, m)`` bit for bit (ties to the lower index; a NaN ranks as ±inf
    instead of raising). Groups of ``m`` run along the last dim, or along dim 0 when ``transposed``."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"fused N:M mask kernel unavailable: {reason}")
    outs = [torch.empty(packed_numel(p.numel()), dtype=torch.uint8, device=p.device) if packed
            else torch.empty(p.shape, dtype=torch.bool, device=p.device) for p in params]
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.dim() != 2 or not p.is_contiguous() or p.dtype not in _DTYPES:
            raise ValueError(f"fused_nm_masks: need contiguous 2-D float32/bf16/fp16 weights, got {p.dtype} "
                             f"of shape {tuple(p.shape)}")
        if p.shape[0 if transposed else 1] % m:
            raise ValueError(f"fused_nm_masks: shape {tuple(p.shape)} has no whole groups of {m} along "
                             f"dim {0 if transposed else 1}")
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), idx in groups.items():
        P = [params[i] for i in idx]
        out8 = [outs[i].view(torch.uint8) for i in idx]
        numels = tuple(p.numel() for p in P)
        rows = [[p.data_ptr(), o.data_ptr(), p.numel(), p.shape[1] if transposed else 1] for p, o in zip(P, out8)]
        mtab = to_device(rows, torch.int64, device)
        work = _work_table(numels, device)
        with _device_ctx(device):
            _mask_kernel[(work.shape[0],)](work, mtab, P[0], out8[0], N=n, M=m, TRANSPOSED=bool(transposed),
                                           PACKED=bool(packed), BLOCK=_BLOCK, CHUNK=_CHUNK, num_warps=_NUM_WARPS,
                                           enable_fp_fusion=FP_FUSION)
    return outs
