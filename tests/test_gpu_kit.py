"""The GPU kit (benchmarks/gpu/kit.py, issue 16) on CPU: the preparation's split reassembles to the same
sha256, every call's payload stays under the device's 64 MiB, the carried wheels cover every import the stages
make that the GPU image lacks, the step runner resumes across calls, and every stage runs end to end as a
``--device cpu`` dry run on a tiny model (synthetic model parts, a tiny wheel, the stub packages)."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import sys
import zipfile
from pathlib import Path

import pytest
import tiny

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import kit  # noqa: E402

MiB = 1 << 20


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_split_reassembles_to_the_same_sha256(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * 397 + b"tail")  # 101,636 bytes: parts of unequal remainder
    items = [kit.Item("model", src, "pkgs/pkg/model.gguf", split=True, stub_package="pkg")]
    manifest = kit.prepare(tmp_path / ".gpu", items, tree=0, part_bytes=30_000)
    (f,) = manifest["files"]
    assert len(f["parts"]) == 4 and sum(p["size"] for p in f["parts"]) == src.stat().st_size
    assert max(p["size"] for p in f["parts"]) <= 30_000
    parts = [tmp_path / ".gpu" / f"call{p['call']}" / p["file"] for p in f["parts"]]
    out = tmp_path / "kit" / f["dest"]
    kit.assemble(parts, out, f["sha256"], [p["sha256"] for p in f["parts"]])
    assert _sha(out) == _sha(src) == f["sha256"]
    parts[1].write_bytes(parts[1].read_bytes()[:-1] + b"X")  # one damaged byte is found, nothing is written
    out.unlink()
    with pytest.raises(ValueError, match="sha256"):
        kit.assemble(parts, out, f["sha256"], [p["sha256"] for p in f["parts"]])
    assert not out.exists()


@pytest.mark.parametrize("tree", [int(1.9 * MiB), 20 * MiB, 50 * MiB])
def test_every_planned_call_stays_under_the_payload_limit(tree):
    sizes = {"model": 98_358_000, "corpus": 6_541_774, "wikitext": 1_296_370, "wheel": 118_475}
    items = [kit.Item(role, Path(role), role, split=role == "model", size=s) for role, s in sizes.items()]
    calls = kit.plan_calls(items, tree)
    for c in calls:
        assert c["payload_bytes"] + kit.TREE_MARGIN <= kit.PAYLOAD_LIMIT
        assert c["payload_bytes"] == tree + c["carried_bytes"] + kit.MANIFEST_RESERVE
    for i, it in enumerate(items):  # every byte of every file is carried exactly once
        pieces = sorted((p["offset"], p["size"]) for c in calls for p in c["parts"] if p["item"] == i)
        assert pieces[0][0] == 0 and sum(s for _, s in pieces) == it.size
        assert all(a + s == b for (a, s), (b, _) in zip(pieces, pieces[1:]))
    assert len(calls) == (2 if tree < 10 * MiB else len(calls))
    with pytest.raises(ValueError, match="no room"):
        kit.plan_calls(items, 62 * MiB)


def test_carried_wheels_cover_every_import_the_stages_make_that_the_image_lacks():
    assert kit.IMAGE_DATE and {"torch", "transformers", "triton", "accelerate", "peft"} <= kit.IMAGE_PACKAGES
    found = kit.third_party_imports()
    classes = kit.classify_imports(found)
    assert classes["missing"] == [], f"imported by the stages, absent from the GPU image, not carried: {classes}"
    assert {"torch", "transformers"} <= set(classes["image"])
    for name in classes["not_carried"]:  # only ever imported inside functions no stage calls
        assert not found[name]["module_level"], name
    for need in kit.EXTRA_NEEDS:  # needed without an import in our code (transformers' GGUF loader)
        assert need in kit.WHEELS or kit.dist_name(need) in kit.IMAGE_PACKAGES
    for dist, version in kit.WHEELS.items():  # the wheels' own needs are in the image or carried too
        if importlib.metadata.version(dist) == version:
            reqs = [r for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r]
            for r in reqs:
                name = r.split(";")[0].split("(")[0].split(">")[0].split("=")[0].split("<")[0].strip()
                assert kit.dist_name(name) in kit.IMAGE_PACKAGES | set(kit.WHEELS), (dist, name)
    # the kit itself runs before anything is installed: only the standard library at module level
    tree = ast.parse((REPO / "benchmarks" / "gpu" / "kit.py").read_text())
    tops = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    tops |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert tops - {"__future__"} <= set(sys.stdlib_module_names), tops


def test_budget_fits_the_time_left():
    b = kit.choose_budget(tok_s_kd=100_000, overhead_s=60, seconds=1000, train_rows=4, tokens_per_step=8192,
                          cap=40_000_000)
    per_row = 0.75 * b / 100_000 + 60  # a KD row (3/4 of the tokens at the KD rate) plus its fixed cost
    assert 4 * per_row <= 1000 and 4 * per_row > 0.9 * 1000  # fills the time, rounded down
    assert str(b).rstrip("0") in ("2", "25", "26") or len(str(b).rstrip("0")) <= 2  # two significant digits
    assert kit.choose_budget(1e9, 10, 10_000, 4, 8192, 40_000_000) == 40_000_000  # capped by the tier
    assert kit.choose_budget(10, 600, 100, 4, 8192, 40_000_000) == 10 * 8192  # at least 10 steps


def test_runner_defers_what_does_not_fit_and_resumes_it_next_call(tmp_path, monkeypatch):
    quick = kit.Step("quick", argv=["-c", "print('hello')"], min_s=0,
                     parse=lambda text, ctx: {"said": text.strip()})
    slow = kit.Step("slow", argv=["-c", "print('late')"], min_s=50)
    waits = kit.Step("waits", argv=["-c", "pass"], needs=("model",))
    monkeypatch.setitem(kit.STEP_BUILDERS, "speed", lambda ctx: [quick, slow, waits])
    monkeypatch.setitem(kit.STEP_BUILDERS, "setup", lambda ctx: [])
    args = ["run", "speed", "--device", "cpu", "--model", str(tmp_path), "--kit-dir", str(tmp_path / "kit"),
            "--calls-root", str(tmp_path / "none")]
    assert kit.main([*args, "--out", str(tmp_path / "o1"), "--budget-s", "20"]) == 0
    steps = json.loads((tmp_path / "o1" / "results.json").read_text())["steps"]
    assert steps["speed/quick"]["status"] == "ok" and steps["speed/quick"]["result"]["said"] == "hello"
    assert steps["speed/slow"]["status"] == "deferred" and steps["speed/waits"]["status"] == "waiting"
    assert kit.main([*args, "--out", str(tmp_path / "o2"), "--budget-s", "100"]) == 0
    steps = json.loads((tmp_path / "o2" / "results.json").read_text())["steps"]
    assert steps["speed/quick"]["call"] == 1 and steps["speed/slow"]["call"] == 2  # not run again; resumed
    assert steps["speed/slow"]["status"] == "ok"
    assert "late" in next((tmp_path / "o2").glob("log-02-*.txt")).read_text()


def _tiny_wheel(folder: Path) -> Path:
    whl = folder / "kitprobe-0.1-py3-none-any.whl"
    files = {"kitprobe/__init__.py": "VALUE = 42\n",
             "kitprobe-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: kitprobe\nVersion: 0.1\n",
             "kitprobe-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n"}
    files["kitprobe-0.1.dist-info/RECORD"] = "".join(f"{n},,\n" for n in [*files, "kitprobe-0.1.dist-info/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


def test_every_stage_dry_run_on_cpu(tmp_path):
    """prepare (synthetic GGUF, the embedded-corpus format, WikiText-2, a wheel) -> two calls' folders; then
    one call of every stage on --device cpu: setup reassembles, verifies and installs, the project finds the
    model file and the corpus through the stub packages; correctness trains and checks the exact 2:4 export;
    speed parses the benchmarks; quality probes, chooses the budget and fills the table."""
    src = tmp_path / "src"
    src.mkdir()
    gguf = src / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 200)
    words = tiny.CORPUS.split()
    corpus = src / "summaries_en-us.json"
    corpus.write_text(json.dumps({f"title {i}": {"extract": f"Document {i}. " + " ".join(words[i % 7:] * 3)}
                                  for i in range(40)}))
    wiki = src / "test.txt"
    wiki.write_text(" ".join([tiny.CORPUS] * 10))
    model = tiny.save_model(tmp_path / "tiny-llama", "llama")
    from cast_llm.data import EMBEDDED_CORPORA
    from cast_llm.models import ALIASES

    m, (cpkg, crel, _) = ALIASES["smollm2-135m"], EMBEDDED_CORPORA["wiki-summaries"]
    items = [kit.Item("model", gguf, f"pkgs/{m.package}/{m.filename}", split=True, stub_package=m.package),
             kit.Item("corpus", corpus, f"pkgs/{cpkg}/{crel}", stub_package=cpkg),
             kit.Item("wikitext", wiki, "data/wikitext-2-raw/test.txt"),
             kit.Item("wheel", _tiny_wheel(src), "wheels/kitprobe-0.1-py3-none-any.whl")]
    gpu = tmp_path / ".gpu"
    manifest = kit.prepare(gpu, items, tree=0, part_bytes=40_000)
    assert len(manifest["calls"]) >= 2 and all(c["carry"] == [f".gpu/call{c['call']}"] for c in manifest["calls"])
    out = tmp_path / "out"
    rc = kit.main(["run", "all", "--device", "cpu", "--inprocess", "--model", str(model), "--kit-dir",
                   str(tmp_path / "kit"), "--out", str(out), "--calls-root", str(gpu), "--rows", "dense,naive,cast"])
    res = json.loads((out / "results.json").read_text())
    steps = res["steps"]
    bad = {k: (v["status"], v.get("result", {}).get("error") or v.get("note")) for k, v in steps.items()
           if v["status"] != "ok"}
    assert rc == 0 and not bad, bad
    kitdir = tmp_path / "kit"
    assert _sha(kitdir / items[0].dest) == _sha(gguf) and (kitdir / "site" / "kitprobe" / "__init__.py").is_file()
    emb = steps["setup/software"]["result"]["embedded"]  # the project's own resolution finds the stubs' files
    assert emb["model"] == str(kitdir / items[0].dest) and emb["corpus"] == str(kitdir / items[1].dest)
    assert emb["wikitext2"] == str(kitdir / items[2].dest)
    assert steps["correctness/train-bf16"]["result"]["finite"]
    assert steps["correctness/export-check"]["result"]["exact_2to4"]
    assert steps["correctness/cuda-tests"]["result"]["counts"].get("collected", 0) >= 1
    assert steps["speed/optimizer-step"]["result"]["adams_over_fused"] > 0
    assert steps["speed/train-step-bf16"]["result"]["cast_kd_over_plain"] > 0
    assert steps["speed/inference-llama7b"]["result"]["sparse_skipped"]  # no semi-structured kernels on CPU
    assert steps["speed/linear-2to4"]["result"]["skipped"]
    rows = {r["key"]: r for r in steps["quality/rows"]["result"]["rows"]}
    assert set(rows) == {"dense", "naive", "cast"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["cast"]["sparse_weight_ratio"] is not None and rows["naive"]["tokens_per_s"] > 0
    assert "--paper-exact" in rows["cast"]["command"] and "--save-every" in rows["cast"]["command"]
    assert res["quality"]["budget"] > 0 and {t["key"] for t in res["targets"]} == set(kit.TARGETS)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= kit.MAX_OUT_FILES and {"versions.json", "summary.md", "compare.md"} <= set(files)
    versions = json.loads((out / "versions.json").read_text())
    assert versions["packages"]["torch"] and versions["command"] and versions["machine"]["cpus"]
    # a training row cut at a call's end resumes from its checkpoint (compare_methods passes --resume auto)
    ctx = kit.Ctx(kit=kitdir, out=tmp_path / "o3", device="cpu", calls_root=gpu, budget_s=60,
                  state={"quality": {"cast_best": []}})
    _, comp, _ = kit.make_comparison(ctx, res["quality"]["budget"], 20)
    run = tmp_path / "cut"
    (run / "checkpoints" / "step-00000020").mkdir(parents=True)
    (run / "checkpoints" / "step-00000020" / "meta.json").write_text("{}")
    argv = comp.train_argv(256, ["--method", "naive"], run)
    i = argv.index("--resume")
    assert argv[i + 1] == "auto" and "--overwrite" not in argv
    j = argv.index("--save-every")
    assert argv[j + 1] == "20"
    # a second call finds everything done and reruns only the cheap bookkeeping
    rc = kit.main(["run", "all", "--device", "cpu", "--inprocess", "--model", str(model), "--kit-dir",
                   str(kitdir), "--out", str(tmp_path / "out2"), "--calls-root", str(gpu)])
    again = json.loads((tmp_path / "out2" / "results.json").read_text())["steps"]
    assert again["correctness/train-bf16"]["call"] == 1 and again["setup/software"]["call"] == 2
