"""Stage setup (every call): copy what the call carried into the kit folder (each part's sha256 verified),
reassemble the files, make the stub packages through which the project finds the embedded model and corpus,
install the carried wheels, check the software and CUDA, run ``cast-llm doctor`` (once per machine: every
custom kernel checked against its reference before anything relies on it; its report is kept in the results),
and convert the embedded model once into the cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpukit.common import GPU_DIR, read_json_mark, sha256_file
from gpukit.executor import Ctx, Step
from gpukit.payload import assemble


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


def parse_doctor(text: str, ctx: Ctx) -> dict:
    res = read_json_mark(text) or {"ok": False, "error": "no report"}
    ctx.state["doctor"] = res.get("report")
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


def steps(ctx: Ctx) -> list[Step]:
    steps = [Step("collect", fn=setup_collect, always=True, min_s=5),
             Step("assemble", fn=setup_assemble, always=True, min_s=10),
             Step("wheels", fn=setup_wheels, needs=(), min_s=20, always=True),
             Step("software", argv=["benchmarks/gpu/kit.py", "software", "--device", ctx.device], timeout_s=120,
                  min_s=20, parse=parse_software, always=True),
             Step("doctor", argv=["benchmarks/gpu/kit.py", "doctor"], timeout_s=300, min_s=30, parse=parse_doctor)]
    if ctx.dry:
        steps.append(Step("convert", fn=setup_model_dry, needs=("gguf_file", "corpus"), min_s=5))
    else:
        steps.append(Step("convert", argv=["benchmarks/gpu/kit.py", "convert"], timeout_s=240, min_s=60,
                          needs=("gguf_file", "gguf"), parse=parse_convert))
    return steps
