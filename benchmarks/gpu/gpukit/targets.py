"""Issue 21's targets (and issue 16's two remaining checks), judged from what the steps measured.

Every entry says what was measured (a number, or None: not measured), the bound and its direction, whether it
passes (None while unmeasured), which step and exact command produced it, on which GPU and with which versions
(torch, CUDA, cuSPARSELt, Triton, the driver) — the form ``results.json`` keeps under ``targets``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpukit.stages.perf import PERF_TABLE


@dataclass(frozen=True)
class Target:
    label: str
    op: str  # "<=" or ">="
    bound: float

    @property
    def goal(self) -> str:
        return f"{self.op} {self.bound:g}"

    def judge(self, v: float | None) -> bool | None:
        if v is None:
            return None
        return v <= self.bound if self.op == "<=" else v >= self.bound


# issue 21, "What must be true at the end"; every key is produced by one row of PERF_TABLE
TARGETS: dict[str, Target] = {
    "model24_prefill_speedup": Target("whole 2:4 model / dense, prefill: LLaMA-7B-shaped, 2,048 tokens, batch 1",
                                      ">=", 1.2),
    "linear24_prefill_speedup": Target("2:4 linear / dense, prefill: LLaMA-7B shapes, the slowest of them", ">=", 1.3),
    "model24_decode_speedup": Target("whole 2:4 model / dense, decode: LLaMA-7B-shaped, batch 1, KV cache", ">=", 1.0),
    "model24_min_speedup": Target("smallest whole-model 2:4 / dense ratio: every model, batch and phase "
                                  "(SmolLM2 included)", ">=", 1.0),
    "model24_logits_rel_err": Target("2:4 vs dense logits, max |Δlogit| / max |logit|: SmolLM2 and 7B shapes, "
                                     "prefill and decode", "<=", 0.01),
    "adams_over_fused": Target("fused AdamS step / AdamW(fused=True): LLaMA-7B-shaped parameters", "<=", 1.10),
    "adams_over_fused_smollm2": Target("fused AdamS step / AdamW(fused=True): SmolLM2-135M's parameters", "<=", 1.30),
    "adams_copy_fraction": Target("fused AdamS bytes moved / measured copy bandwidth (7B shapes)", ">=", 0.70),
    "cast_nokd_over_plain": Target("CAST step w/o KD / plain AdamW step: SmolLM2-135M, bf16", "<=", 1.05),
    "cast_kd_over_plain": Target("CAST step with KD / plain AdamW step: SmolLM2-135M, bf16", "<=", 1.40),
    "cast_nokd_over_plain_1b": Target("CAST step w/o KD / plain AdamW step: 1B-class LLaMA, bf16", "<=", 1.05),
    "cast_kd_over_plain_1b": Target("CAST step with KD / plain AdamW step: 1B-class LLaMA, bf16", "<=", 1.40),
}
# issue 16's checks that no perf step measures: (stage/step, how to read the figure off its result)
CHECKS: dict[str, Target] = {
    "linear24_max_rel_err": Target("2:4 F.linear outputs vs dense, max |Δ| / max |y| (bf16; speed/linear-2to4)",
                                   "<=", 0.01),
    "cast_sparse_weight_ratio": Target("S_t at the end of the GPU-tier CAST rows (quality/rows)", ">=", 0.99),
}
PRODUCER = {key: b for b in PERF_TABLE for key in b.keys}  # target -> the perf benchmark that measures it


def gpu_and_versions(state: dict) -> tuple[str | None, dict]:
    """The GPU's name and the versions that matter for a speed figure, as the call's setup read them."""
    sw = state.get("software") or {}
    cuda, pk = sw.get("cuda") or {}, sw.get("packages") or {}
    gpus = (state.get("machine") or {}).get("gpu") or [{}]
    return cuda.get("name"), {"torch": cuda.get("torch_version") or pk.get("torch"), "cuda": cuda.get("torch_cuda"),
                              "cusparselt": cuda.get("cusparselt_version"), "triton": pk.get("triton"),
                              "driver": gpus[0].get("driver")}


def _entry(t: Target, measured, st: dict, step: str, gpu, versions: dict) -> dict:
    res = st.get("result") or {}
    status = st.get("status", "not run")
    note = st.get("note") or res.get("error")
    if measured is None and status == "ok":
        note = note or "the step wrote no number for it"
    return {"label": t.label, "measured": measured, "target": t.goal, "direction": t.op, "bound": t.bound,
            "pass": t.judge(measured), "status": status, "note": note, "step": step,
            "gpu": gpu if st else None, "versions": versions if st else {}, "command": st.get("command"),
            "call_command": st.get("call_command"), "when": st.get("when")}


def evaluate(state: dict) -> dict[str, dict]:
    """``{"targets": {key: entry}, "checks": {key: entry}}`` from a kit state (its steps' results)."""
    steps = state.get("steps", {})
    gpu, versions = gpu_and_versions(state)
    targets = {}
    for key, t in TARGETS.items():
        step = f"perf/{PRODUCER[key].name}"
        st = steps.get(step, {})
        v = ((st.get("result") or {}).get("measured") or {}).get(key)
        e = _entry(t, v, st, step, gpu, versions)
        res = st.get("result") or {}
        if key in res.get("absent_keys", []):
            e["note"] = f"absent from {PRODUCER[key].name}'s JSON"
        elif key in res.get("invalid", {}):
            e["note"] = f"{PRODUCER[key].name}'s JSON holds {res['invalid'][key]}, not a number"
        if res.get("device") is not None:
            e["bench_device"] = res["device"]
        if res.get("versions") is not None:
            e["bench_versions"] = res["versions"]
        targets[key] = e
    lin, rows = steps.get("speed/linear-2to4", {}), steps.get("quality/rows", {})
    cast_st = [r.get("sparse_weight_ratio") for r in (rows.get("result") or {}).get("rows", [])
               if r.get("key", "").startswith("cast") and r.get("status") == "ok"]
    checks = {
        "linear24_max_rel_err": _entry(CHECKS["linear24_max_rel_err"],
                                       (lin.get("result") or {}).get("max_rel_err"), lin, "speed/linear-2to4", gpu,
                                       versions),
        "cast_sparse_weight_ratio": _entry(CHECKS["cast_sparse_weight_ratio"],
                                           min(cast_st) if cast_st and None not in cast_st else None, rows,
                                           "quality/rows", gpu, versions),
    }
    return {"targets": targets, "checks": checks}
