"""The learned mask, isolated: does CAST's mask learning produce a better 2:4 mask than SparseGPT's?

The dense model is retrained under each of several fixed masks with one and the same recipe — SparseGPT + KD's
(naive retraining with distillation, its lr as tuned on the validation split: ``--recipe-from``) — so that the
mask is the only difference between the rows: magnitude's, Wanda's and SparseGPT's one-shot masks, and the mask
a CAST run learned (``--learned NAME=RUN/model``, e.g. paper-exact CAST at 384k). Every row starts from the
dense weights ⊙ its mask (``cast-llm train --mask-file``), so SparseGPT's row here is *not* SparseGPT + KD of
the comparison table (which keeps SparseGPT's reconstructed weights).

    python benchmarks/mask_swap.py --recipe-from runs/compare/smollm2-135m-48k \\
        --learned "paper-exact CAST 384k=runs/compare/smollm2-135m-384k/cast/seed-0/model" --seeds 0,1,2

A mask can also be learned here: ``--learn "paper-exact CAST 48k=cast:0,1"`` runs comparison row ``cast`` at its
tuned setting (``--recipe-from``'s tuning of it) once per seed and takes each run's mask (its figures beside the
comparison's own run of that seed). Every mask's dense ⊙ mask figure before any retraining is in the table too.

The masks are written as files (``RUNS/masks/*.safetensors``, with their digest in the report), so the rows
can be rerun; learned masks committed under ``docs/results/mask-swap-rows/<model>-<budget>/masks`` (the evidence
queue commits them) are put back on a machine that never ran their learners; ``docs/results/mask-swap-<model>-<budget>.{md,json,png}`` hold the table, every seed, and each
mask paired seed by seed against SparseGPT's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the rows and learned masks the evidence queue commits (benchmarks/evidence_queue.py): <model>-<budget>/...
COMMITTED_MASKS = REPO / "docs" / "results" / "mask-swap-rows"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_methods import Comparison, Entry, budget_name, parse_args, without_output_dir  # noqa: E402
from compare_report import compute_cell, format_number, paired, portable, register_runs_folder  # noqa: E402

ONESHOT = {"magnitude": "Magnitude (Eq. 6)", "wanda": "Wanda", "sparsegpt": "SparseGPT"}
BASE = "sparsegpt"  # every mask is paired against SparseGPT's
START = "magnitude"  # and a learned one also against the mask paper-exact CAST starts from (Eq. 6)


def build_masks(cmp: Comparison, learned: dict[str, str], mask_seed: int,
                learn: dict[str, tuple[str, list[int]]] | None = None) -> dict[str, dict]:
    """``{name: {"file", "label", "source", "sha256", "digest", "groups_vs_sparsegpt", "groups_vs_magnitude"}}``
    of every mask, its file written once (``sha256``: the file's; ``digest``: the masks' own, :func:`masks_digest`).
    ``learn``: ``{name: (comparison row, seeds)}``, masks this benchmark learns itself (:func:`run_learners`)."""
    import torch

    from cast_llm.io import sha256_file
    from cast_llm.models import load_model
    from cast_llm.sparsity.mask_io import load_masks, masks_digest, save_masks
    from cast_llm.targets import find_targets
    from cast_llm.train.methods.masks import masks_from

    folder = cmp.runs / "masks"
    folder.mkdir(parents=True, exist_ok=True)
    dense = load_model(cmp.tier["model"], dtype=torch.float32)
    targets = find_targets(dense, n=2, m=4)
    out = {}
    sources = {}
    for name in ONESHOT:
        model_dir = folder / f"{name}-model"
        argv = cmp.prune_argv(["--method", name], model_dir, mask_seed)
        sources[name] = (model_dir, "cast-llm " + shlex.join(argv), ONESHOT[name])
        if not (folder / f"{name}.safetensors").is_file() and not (model_dir / "config.json").is_file():
            print(f"mask {name}: cast-llm {' '.join(argv)}", flush=True)
            if cmp._run_cli(argv, folder / f"{name}.log") != 0:
                raise SystemExit(f"pruning with {name} failed: see {folder / f'{name}.log'}")
    for name, path in learned.items():
        sources[_key(name)] = (Path(path), f"the exported model {portable(str(path))}", name)
    learners = run_learners(cmp, learn or {})
    for key, (model_dir, how, label, _) in learners.items():
        sources[key] = (model_dir, how, label)
    loaded = {}  # each mask file read once: its digest and its distances to SparseGPT's and magnitude's masks
    for key, (model_dir, how, label) in sources.items():
        file = folder / f"{key}.safetensors"
        if not file.is_file():
            save_masks(file, masks_from(model_dir, targets, 2, 4), n=2, m=4, source=how)
        loaded[key] = load_masks(file)[0]
        out[key] = {"file": str(file), "label": label, "source": portable(how), "sha256": sha256_file(file),
                    "digest": masks_digest(loaded[key])}
        if key in learners:  # learned here: the run that learned it, its figures beside its comparison row's
            out[key]["learner"] = learners[key][3]
        elif key not in ONESHOT:  # a learned mask: the exported model it is read from (the report's rerun line)
            out[key]["model"] = portable(str(model_dir))
    for key, info in out.items():  # magnitude's: where paper-exact CAST and SR-STE start, so how far a mask moved
        info["groups_vs_sparsegpt"] = groups_differ(loaded[key], loaded[BASE], targets)
        info["groups_vs_magnitude"] = groups_differ(loaded[key], loaded[START], targets)
    return out


def run_learners(cmp: Comparison, learn: dict[str, tuple[str, list[int]]]) -> dict[str, tuple]:
    """The masks learned by comparison rows this benchmark runs itself (``--learn NAME=ROW:SEEDS``): row ROW of
    the comparison at this budget, at its tuned setting (``--recipe-from``'s tuning of that row, as its own
    table runs it), one run per seed into ``<runs>/learners/<row>/seed-<s>``, its mask read from the model it
    saved. A mask whose file is here already (a restored one) needs no run. ``{key: (model folder, source,
    label, learner record)}``; the record holds the run's figures and, where ``--recipe-from`` has it, the
    comparison row's own seed's, so a reader sees whether the learner is that row."""
    from compare_methods import ALL_ENTRIES, read_row

    out = {}
    for name, (row_key, seeds) in learn.items():
        e = next((x for x in ALL_ENTRIES if x.key == row_key), None)
        if e is None or e.kind != "train":
            raise SystemExit(f"--learn {name}={row_key}: not a training row of the comparison (rows: "
                             f"{', '.join(x.key for x in ALL_ENTRIES if x.kind == 'train')})")
        setting = (cmp.tuned(row_key) or {}).get("chosen_setting") or {}
        for seed in seeds:
            key = _key(f"{name} seed {seed}")
            run = cmp.runs / "learners" / row_key / f"seed-{seed}"
            file = cmp.runs / "masks" / f"{key}.safetensors"
            how = (f"comparison row {row_key} seed {seed} at "
                   + (", ".join(f"{k} {v:g}" for k, v in setting.items()) or "its defaults")
                   + f", learned here ({portable(str(run))})")
            if file.is_file() and not (run / "compare_row.json").is_file():  # a restored mask without its run
                out[key] = (run / "model", how, f"{name}, seed {seed}", {"name": name, "row": row_key,
                                                                          "seed": seed, "setting": setting})
                continue
            if not (run / "compare_row.json").is_file():
                print(f"learner {name} seed {seed}: comparison row {row_key} at {setting or 'its defaults'}",
                      flush=True)
            row = cmp._run_one(e, run, seed)
            if row.get("status") != "ok":
                raise SystemExit(f"learner {name} seed {seed} failed: see {run / 'log.txt'}")
            record = {"name": name, "row": row_key, "seed": seed, "setting": setting, "command": portable(row.get("command", "")),
                      **{k: row.get(k) for k in ("test", "validation", "wikitext2", "code", "wall_s", "threads")},
                      "tuning_from": portable(str(cmp.opts.tuning_from))}
            theirs = Path(cmp.opts.tuning_from) / row_key / f"seed-{seed}" / "compare_row.json"
            if theirs.is_file():  # the comparison's own run of that row and seed
                ref = read_row(theirs)
                record["comparison_row"] = {k: ref.get(k) for k in ("test", "validation", "wikitext2", "code")}
            out[key] = (run / "model", how, f"{name}, seed {seed}", record)
    return out


def score_before_retraining(cmp: Comparison, masks: dict[str, dict]) -> None:
    """Each mask's dense ⊙ mask model scored before any retraining (test, validation, WikiText-2, the
    comparison's evaluation), into its listing as ``before_retraining``: how much of a mask's final figure is the
    mask itself. Scored once per mask (kept while its digest is unchanged); a mask whose file is not here (a row
    recorded elsewhere) keeps what its record says."""
    todo = [k for k, info in masks.items() if Path(info["file"]).is_file()
            and (info.get("before_retraining") or {}).get("digest") != info.get("digest")]
    if not todo:
        return
    import torch

    from cast_llm.models import load_model
    from cast_llm.sparsity.mask_io import load_masks
    from cast_llm.targets import find_targets

    ev = cmp.evaluator()
    model = load_model(cmp.tier["model"], dtype=torch.float32).eval()
    targets = find_targets(model, n=2, m=4)
    dense = {t.fqn: t.weight.detach().clone() for t in targets}
    for key in todo:
        t0 = time.perf_counter()
        loaded = load_masks(masks[key]["file"])[0]
        with torch.no_grad():
            for t in targets:
                t.weight.copy_(dense[t.fqn] * loaded[t.fqn].to(dense[t.fqn].dtype))
            got = ev.both(model, f"dense ⊙ {masks[key]['label']} mask", validation=True)
        masks[key]["before_retraining"] = {"test": got["heldout"], "validation": got.get("validation"),
                                           "wikitext2": got["wikitext2"], "digest": masks[key].get("digest"),
                                           "wall_s": round(time.perf_counter() - t0, 1)}


def groups_differ(a: dict, b: dict, targets) -> float:
    """The share of 2:4 groups (over every target) whose kept pair differs between masks ``a`` and ``b``."""
    changed = total = 0
    for t in targets:
        x, y = (a[t.fqn].t(), b[t.fqn].t()) if t.transposed else (a[t.fqn], b[t.fqn])
        differ = (x.reshape(-1, 4) != y.reshape(-1, 4)).any(dim=1)
        changed += int(differ.sum())
        total += differ.numel()
    return changed / total


def _key(name: str) -> str:
    return "learned-" + "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def mask_entry(key: str, info: dict) -> Entry:
    """The row that retrains under mask ``key``: the one recipe, this mask's file."""
    return Entry(f"mask-{key}", f"{info['label']} mask", "train",
                 ["--method", "naive", "--kd", "--mask-file", info["file"]], kd=True, weight_update="AdamW",
                 mask=f"fixed ({info['label']})", seeded=True)


def reuse_recorded(cmp: Comparison, path: Path, masks: dict, recipe: dict) -> tuple[dict, list[str]]:
    """The masks and runs recorded in ``path`` (the committed ``mask-swap-*.json``) put where this runs folder
    has none, as :meth:`Comparison.reuse_recorded` does for the comparison tables: the runs folder is a cache,
    the JSON the record. A recorded seed is taken only when today's settings would run exactly its command on
    the same split, and, for a mask built here too, only when the mask is the recorded one: the same digest
    (:func:`masks_digest`), or for a record that predates digests, the same shares of groups that differ from
    SparseGPT's and magnitude's masks. A learned mask whose run is not here is listed from the record (its file
    cannot be rebuilt: such a row cannot run a new seed). A mask found not to be the recorded one has the seeds an
    earlier call took from the record set aside (``compare_row.set-aside.json``). Returns the masks and what was
    taken."""
    if not path.is_file():
        return masks, []
    masks = dict(masks)
    taken = []
    where = portable(str(path))
    recorded_rows = json.loads(path.read_text()).get("rows", [])
    for row in recorded_rows:
        key = row["name"]
        recorded = {"file": str(cmp.runs / "masks" / f"{key}.safetensors"), "label": row["label"].removesuffix(" mask"),
                    "source": row["mask"], "sha256": row.get("mask_sha256"), "digest": row.get("mask_digest"),
                    "groups_vs_sparsegpt": row["groups_vs_sparsegpt"],
                    "groups_vs_magnitude": row.get("groups_vs_magnitude"), "recorded_in": where}
        if row.get("model") or row["mask"].startswith("the exported model "):
            recorded["model"] = row.get("model") or row["mask"].removeprefix("the exported model ")
        for k in ("before_retraining", "learner"):
            if row.get(k):
                recorded[k] = row[k]
        here = masks.get(key)
        if here is None:
            masks[key] = here = recorded
        elif not same_mask(here, recorded):
            print(f"mask {key}: the mask built here is not the one {where} records (digest "
                  f"{str(here.get('digest'))[:12]} vs {str(recorded['digest'])[:12]}, groups ≠ SparseGPT's "
                  f"{here.get('groups_vs_sparsegpt')} vs {recorded['groups_vs_sparsegpt']}): its recorded runs are "
                  "not reused", flush=True)
            for done in cmp.runs.glob(f"mask-{key}/seed-*/compare_row.json"):  # placed by an earlier call: set aside
                if json.loads(done.read_text()).get("recorded_in") == where:
                    done.rename(done.with_name("compare_row.set-aside.json"))
            continue
        for k in ("before_retraining", "learner"):  # what the record knows of this same mask
            if recorded.get(k) and not (here.get(k) or {}).get("test"):
                here[k] = recorded[k]
        e = mask_entry(key, here)
        for run in row.get("seeds", []):
            out = cmp.runs / e.key / f"seed-{run['seed']}"
            want = without_output_dir("cast-llm " + shlex.join(cmp.entry_train_argv(e, out, run["seed"],
                                                                                      dict(recipe))[0]))
            if (out / "compare_row.json").is_file() or run.get("status") != "ok" or (
                    without_output_dir(run.get("command", "")) != want):
                continue
            if run.get("split_sha256") is None or run["split_sha256"] != cmp.current_split():
                continue  # scored on other text
            out.mkdir(parents=True, exist_ok=True)
            (out / "compare_row.json").write_text(json.dumps({
                "key": e.key, "label": e.label, "kind": e.kind, "kd": e.kd, "weight_update": e.weight_update,
                "mask": e.mask, "seed": run["seed"], "heldout": run["test_ppl"], "wikitext2": run["wikitext2_ppl"],
                "validation": run.get("validation_ppl"), "lr": recipe.get("lr"),
                **{k: run.get(k) for k in ("split_sha256", "threads", "wall_s", "machine", "code", "status",
                                           "command")},
                "recorded_in": run.get("recorded_in") or where}, indent=2))
            taken.append(f"{key} seed {run['seed']}")
    order = [r["name"] for r in recorded_rows]  # the record's rows first, as they were
    return {k: masks[k] for k in sorted(masks, key=lambda k: order.index(k) if k in order else len(order))}, taken


def restore_committed(cmp: Comparison, path: Path) -> None:
    """The learned masks committed with the results (``docs/results/mask-swap-rows/<model>-<budget>/masks``; their
    runs' models are not kept) put in this runs folder where it has none, so that a machine that never ran their
    learners retrains new seeds under them, and ``--learn`` does not learn them again; only a file that is the
    mask the committed JSON (``path``) records (the same digest)."""
    if not path.is_file():
        return
    from cast_llm.sparsity.mask_io import load_masks, masks_digest

    for row in json.loads(path.read_text()).get("rows", []):
        file = cmp.runs / "masks" / f"{row['name']}.safetensors"
        committed = COMMITTED_MASKS / cmp.runs.name / "masks" / file.name
        if file.is_file() or not committed.is_file() or committed.resolve() == file.resolve():
            continue
        if not row.get("mask_digest") or masks_digest(load_masks(committed)[0]) != row["mask_digest"]:
            print(f"mask {row['name']}: the committed {portable(str(committed))} is not the recorded mask "
                  "(digest): not used", flush=True)
            continue
        file.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(committed, file)
        print(f"mask {row['name']}: the committed {portable(str(committed))} (digest {row['mask_digest'][:12]})",
              flush=True)


def same_mask(a: dict, b: dict) -> bool:
    """Whether two listings name the same masks: by digest where both have one; else (a record from before
    digests) by the shares of 2:4 groups that differ from SparseGPT's and from magnitude's masks, which the
    same masks give exactly."""
    if a.get("digest") and b.get("digest"):
        return a["digest"] == b["digest"]
    return all(a.get(k) is not None and a.get(k) == b.get(k) for k in ("groups_vs_sparsegpt", "groups_vs_magnitude"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", default="cpu")
    ap.add_argument("--tokens", default="48k", help="training tokens of runs without KD (these get 3/4)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--learned", action="append", default=[], metavar="NAME=MODEL_DIR",
                    help="a learned mask: the name in the table = a sparse run's exported model folder")
    ap.add_argument("--learn", action="append", default=[], metavar="NAME=ROW:SEEDS",
                    help="a mask this benchmark learns itself: comparison row ROW (e.g. cast, paper-exact CAST) at "
                         "its tuned setting (--recipe-from's tuning of it), one run per seed (e.g. cast:0,1), each "
                         "seed's mask a row of the table")
    ap.add_argument("--recipe-from", required=True,
                    help="the compare runs folder (or compare-*.json) whose naive-kd-sgpt tuning gives the lr")
    ap.add_argument("--mask-seed", type=int, default=0, help="calibration seed of the one-shot masks")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--runs-dir", default=str(REPO / "runs" / "mask-swap"))
    ap.add_argument("--docs-dir", default=str(REPO / "docs" / "results"))
    ap.add_argument("--masks", help="train under these masks only (comma-separated keys: magnitude, wanda, sparsegpt, "
                    "learned-…); the others are still listed from earlier calls. Default: every mask")
    ap.add_argument("--report-only", action="store_true", help="run nothing: rewrite the report from finished runs")
    ap.add_argument("--fresh", action="store_true",
                    help="reuse nothing the committed JSON records (by default a run it records is not run again)")
    opts = ap.parse_args(argv)
    t0 = time.perf_counter()
    cmp_argv = ["--tier", opts.tier, "--tokens", opts.tokens, "--seeds", opts.seeds, "--runs-dir", opts.runs_dir,
                "--tuning-from", opts.recipe_from, "--report-only"]
    cmp = Comparison(parse_args(cmp_argv + (["--threads", str(opts.threads)] if opts.threads else [])))
    # reports name the runs where a fresh clone's rerun puts them (this benchmark's, and the comparison's)
    register_runs_folder(opts.runs_dir, "runs/mask-swap")
    if not opts.recipe_from.endswith(".json"):
        register_runs_folder(Path(opts.recipe_from).parent, "runs/compare")
    recipe = (cmp.tuning_from.get("naive-kd-sgpt") or {}).get("chosen_setting")
    if not recipe:
        raise SystemExit(f"--recipe-from {opts.recipe_from}: no tuning of naive-kd-sgpt there (run its --tune first)")
    learned = dict(x.split("=", 1) for x in opts.learned)
    learn = {}
    for x in opts.learn:
        name, _, spec = x.rpartition("=")
        row_key, _, seeds = spec.partition(":")
        if not name or not row_key or not all(v.strip().isdigit() for v in seeds.split(",")):
            raise SystemExit(f"--learn {x!r}: give NAME=ROW:SEEDS, e.g. 'paper-exact CAST 48k=cast:0,1'")
        learn[name] = (row_key, [int(v) for v in seeds.split(",")])
    for path in learned.values():  # a comparison run's model is named as under runs/compare
        if (run := comparison_run(path)) is not None:
            register_runs_folder(run[0], "runs/compare")
    from cast_llm.io import atomic_write_text

    listed = cmp.runs / "masks.json"
    known = json.loads(listed.read_text()) if listed.is_file() else {}
    record = Path(opts.docs_dir) / f"mask-swap-{cmp.model_name}-{budget_name(cmp.budget)}.json"
    if opts.report_only:
        masks = known
    else:  # masks built by earlier calls (e.g. a learned one) stay listed
        if not opts.fresh:
            restore_committed(cmp, record)
        built = build_masks(cmp, learned, opts.mask_seed, learn)  # (read the list again: another call may have
        before = json.loads(listed.read_text()) if listed.is_file() else {}  # added one)
        for key, info in built.items():  # what an earlier call scored or recorded of the same mask stays
            old_info = before.get(key) or {}
            if old_info.get("digest") == info.get("digest"):
                info.setdefault("before_retraining", old_info.get("before_retraining"))
                if old_info.get("learner") and not (info.get("learner") or {}).get("test"):
                    info["learner"] = old_info["learner"]
        masks = {**before, **built}
    if not opts.fresh:  # the committed JSON is the record: a fresh checkout's table keeps its rows
        masks, taken = reuse_recorded(cmp, record, masks, recipe)
        if taken:
            print(f"reused {len(taken)} recorded run(s) of {portable(str(record))}: {', '.join(taken)}", flush=True)
    if not masks:
        raise SystemExit(f"--report-only: no {listed} and no {record} (run the benchmark first)")
    if not opts.report_only:
        score_before_retraining(cmp, masks)
    atomic_write_text(listed, json.dumps(masks, indent=2))
    chosen = set(opts.masks.split(",")) if opts.masks else set(masks)
    if chosen - set(masks):
        raise SystemExit(f"--masks: unknown mask(s) {', '.join(sorted(chosen - set(masks)))}; "
                         f"known: {', '.join(masks)}")
    rows = []
    for key, info in masks.items():
        e = mask_entry(key, info)
        runs = []
        for seed in cmp.seeds:
            out = cmp.runs / e.key / f"seed-{seed}"
            if (opts.report_only or key not in chosen) and not (out / "compare_row.json").is_file():
                continue
            if not Path(info["file"]).is_file() and not (out / "compare_row.json").is_file():
                raise SystemExit(f"mask {key}: its file {info['file']} is not on this machine (a row recorded "
                                 f"elsewhere) and seed {seed} is not recorded; give its run again with --learned")
            if not (out / "compare_row.json").is_file():  # (a finished run is reused, not announced)
                print(f"[{time.perf_counter() - t0:7.0f} s] {e.key} seed {seed} ...", flush=True)
            runs.append(cmp._run_one(e, out, seed, dict(recipe)))
        if runs:
            row = cmp.aggregate(runs)
            row.update(key=key, label=e.label, mask=info["source"], mask_sha256=info.get("sha256"),
                       mask_digest=info.get("digest"), model=info.get("model"),
                       before_retraining=info.get("before_retraining"), learner=info.get("learner"),
                       groups_vs_sparsegpt=info["groups_vs_sparsegpt"],
                       groups_vs_magnitude=info.get("groups_vs_magnitude"))
            rows.append(row)
    write(rows, recipe, cmp, opts, Path(opts.docs_dir), time.perf_counter() - t0)
    return 0


def write(rows: list[dict], recipe: dict, cmp: Comparison, opts, docs: Path, wall: float) -> None:
    docs.mkdir(parents=True, exist_ok=True)
    stem = f"mask-swap-{cmp.model_name}-{budget_name(cmp.budget)}"
    base = next((r for r in rows if r["key"] == BASE), None)
    start = next((r for r in rows if r["key"] == START), None)
    out_rows = []
    for r in rows:
        seeds = [{"seed": x["seed"], "test_ppl": x.get("test", x.get("heldout")), "wikitext2_ppl": x.get("wikitext2"),
                  "validation_ppl": x.get("validation"), "split_sha256": x.get("split_sha256"),
                  "threads": x.get("threads"), "wall_s": x.get("wall_s"), "machine": x.get("machine"),
                  "code": x.get("code"), "status": x.get("status"), "command": portable(x.get("command", "")),
                  **({"recorded_in": x["recorded_in"]} if x.get("recorded_in") else {})}
                 for x in r.get("seeds") or [r]]
        row = {"name": r["key"], "label": r["label"], "mask": portable(r["mask"]), "mask_digest": r.get("mask_digest"),
               "mask_sha256": r.get("mask_sha256"), **({"model": r["model"]} if r.get("model") else {}),
               "groups_vs_sparsegpt": r["groups_vs_sparsegpt"], "groups_vs_magnitude": r.get("groups_vs_magnitude"),
               **({"before_retraining": r["before_retraining"]} if r.get("before_retraining") else {}),
               **({"learner": r["learner"]} if r.get("learner") else {}),
               "test_ppl": r.get("heldout"),
               "wikitext2_ppl": r.get("wikitext2"), "seeds": seeds}
        if base is not None and r is not base:
            row["paired"] = {"against": BASE, **{s: paired({**r, "key": r["key"]}, {**base, "key": BASE}, s)
                                                 for s in ("test", "wikitext2")}}
        if start is not None and r["key"].startswith("learned-"):  # did the learning improve the mask it began from?
            row["paired_vs_start"] = {"against": START, **{s: paired({**r, "key": r["key"]}, {**start, "key": START},
                                                                     s) for s in ("test", "wikitext2")}}
        others = [o for o in rows[:rows.index(r)] if o["key"].startswith("learned-")]  # learned masks, each pair once
        if r["key"].startswith("learned-") and others:
            row["paired_vs_learned"] = [{"against": o["key"], **{s: paired({**r, "key": r["key"]}, o, s)
                                                                 for s in ("test", "wikitext2")}} for o in others]
        out_rows.append(row)
    learned = [f"{r['label'].removesuffix(' mask')}={portable(r['model'])}" for r in rows if r.get("model")]
    learners = {lr["row"]: cmp.tuned(lr["row"]) for r in rows if (lr := r.get("learner") or {}).get("row")}
    regenerate = " && ".join(prerequisites(opts, recipe_tuning(cmp), learned, learners) + [
        "python benchmarks/mask_swap.py " + shlex.join(
            ["--tier", opts.tier, "--tokens", opts.tokens, "--seeds", opts.seeds, "--recipe-from",
             portable(opts.recipe_from)] + [x for name_path in learned for x in ("--learned", name_path)]
            + [x for spec in learn_specs(rows) for x in ("--learn", spec)])])
    doc = {"generated": datetime.date.today().isoformat(), "regenerate": regenerate, "model": cmp.tier["model"],
           "budget": cmp.budget, "recipe": {"method": "naive retraining + KD (fixed mask), dense weights ⊙ mask",
                                            **recipe, "eta": cmp.tier["eta"], "from": portable(opts.recipe_from)},
           "rows": out_rows}
    (docs / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# The learned mask, isolated: {cmp.tier['model']} retrained under fixed masks ({budget_name(cmp.budget)} "
             "tokens, KD runs 3/4)", "",
             f"One command reruns it from scratch: `{regenerate}`.", "",
             "Every row retrains the dense model, started at dense ⊙ mask, under its fixed mask with the same recipe: "
             f"naive retraining + KD (η {cmp.tier['eta']:g}), lr {recipe.get('lr'):g} (SparseGPT + KD's choice on "
             "the validation split), the same data, seeds and evaluation (test split and WikiText-2, as the "
             "comparison tables). Masks differ from SparseGPT's in the share of 2:4 groups given; the masks are "
             "files (the masks' own digest, and their file's SHA-256, in the JSON).", "",
             "The column *before retraining* scores the dense weights ⊙ the mask with no training at all (test / "
             "WikiText-2, the same evaluation): how much of a row's figure the mask itself gives, and how much the "
             "retraining recovers. — where the mask's file is not on the machine that scored the table.", "",
             "| Mask | Groups ≠ SparseGPT's | Groups ≠ magnitude's | Before retraining (test / WikiText-2) | Test ppl "
             "| WikiText-2 ppl | vs SparseGPT's mask (test) | vs SparseGPT's mask (WikiText-2) | Wall time |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|"]
    earlier = set()
    for r, j in zip(rows, out_rows):
        src = {x.get("recorded_in") for x in r.get("seeds") or [r]} - {None}
        earlier |= src
        lines.append(f"| {r['label']}{' †' if src else ''} | {100 * r['groups_vs_sparsegpt']:.2f} % | "
                     f"{format_number(100 * (r.get('groups_vs_magnitude') or 0), '{:.2f}')} % | {_before(r)} | "
                     f"{_cell(r, 'heldout')} | "
                     f"{_cell(r, 'wikitext2')} | {_pair(j, 'test')} | {_pair(j, 'wikitext2')} | {compute_cell(r)} |")
    if earlier:
        lines += ["", "† run by an earlier invocation whose run folder is not here; taken from "
                  + "; ".join(f"`{x}`" for x in sorted(earlier)) + " (`--fresh` runs it again)."]
    starts = [(r, j) for r, j in zip(rows, out_rows) if "paired_vs_start" in j]
    if starts:
        lines += ["", "A learned mask against the magnitude mask its run started from (Eq. 6 on the dense weights: the "
                  "first mask of paper-exact CAST and of SR-STE), seed by seed: " + "; ".join(
                      f"{r['label']}: test {_pair({'paired': j['paired_vs_start']}, 'test')}, WikiText-2 "
                      f"{_pair({'paired': j['paired_vs_start']}, 'wikitext2')}" for r, j in starts) + "."]
    duels = [(r, p) for r, j in zip(rows, out_rows) for p in j.get("paired_vs_learned", [])]
    if duels:
        labels = {r["key"]: r["label"] for r in rows}
        lines += ["", "Learned masks against each other, seed by seed: " + "; ".join(
            f"{r['label']} − {labels[p['against']]}: test {_pair({'paired': p}, 'test')}, WikiText-2 "
            f"{_pair({'paired': p}, 'wikitext2')}" for r, p in duels) + "."]
    lines += ["", "Paired: mean of the per-seed differences (row − SparseGPT's mask, perplexity points), 95 % t "
              "interval; **better** / **worse** only where it excludes 0, else **level**.", "",
              "Masks: " + "; ".join(f"{r['label']}: `{portable(r['mask'])}` ({_mask_id(r)})" for r in rows),
              *learner_lines(rows),
              "", "Wall time: one run's, mean over the seeds (retraining and its evaluations; the one-shot masks' "
              "pruning is not in it), its thread count and the most cores other jobs kept busy meanwhile (0 = an "
              f"idle machine); every run's own in the JSON. This invocation: {wall:.0f} s."]
    if plot(rows, docs / f"{stem}.png", f"{cmp.tier['model']}, {budget_name(cmp.budget)} tokens: one recipe, "
            f"{len(rows)} fixed masks"):
        lines += ["", f"![the masks compared]({stem}.png)"]
    (docs / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {docs / (stem + '.md')} and {docs / (stem + '.json')}")


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Each mask's mean (bar) and every seed (dots), test and WikiText-2 side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (split, name) in zip(axes, (("heldout", "test"), ("wikitext2", "WikiText-2"))):
        for i, r in enumerate(rows):
            runs = [x for x in r.get("seeds") or [r] if x.get("status") == "ok"]
            ax.bar(i, r[split], color="#4a78b5" if r["key"] == BASE else "#9bb0cc")
            ax.plot([i] * len(runs), [x[split] for x in runs], "k.", markersize=6)
        ax.set_xticks(range(len(rows)), [r["label"].removesuffix(" mask") for r in rows], rotation=15, fontsize=8)
        ax.set_ylabel(f"{name} perplexity (lower is better)")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def recipe_tuning(cmp: Comparison) -> dict:
    return cmp.tuning_from.get("naive-kd-sgpt") or {}


def comparison_run(path: str) -> tuple[Path, str, str, str | None] | None:
    """(runs folder, budget, row, seed) of a model exported by a comparison run
    (``<runs>/<model>-<budget>/<row>/seed-<s>/model``, or ``<runs>/<model>-<budget>/<row>/model`` for a row run
    once, seed None); None for any other folder."""
    parts = Path(path).parts
    if len(parts) >= 5 and parts[-1] == "model" and parts[-2].startswith("seed-") and "-" in parts[-4]:
        return Path(*parts[:-4]), parts[-4].rsplit("-", 1)[1], parts[-3], parts[-2].removeprefix("seed-")
    if len(parts) >= 4 and parts[-1] == "model" and "-" in parts[-3] and parts[-3].split("-")[-1][:1].isdigit():
        return Path(*parts[:-3]), parts[-3].rsplit("-", 1)[1], parts[-2], None
    return None


def _mask_id(r: dict) -> str:
    """The masks' digest where known; a row recorded before digests has its file's SHA-256 only."""
    if r.get("mask_digest"):
        return f"digest `{r['mask_digest'][:12]}`"
    return f"file SHA-256 `{str(r.get('mask_sha256'))[:12]}`"


def prerequisites(opts, tuning: dict, learned: list[str], learners: dict[str, dict] | None = None) -> list[str]:
    """The commands that make what this benchmark reads, so that the report's one line reruns it from scratch:
    SparseGPT + KD's lr grid (its choice is the recipe), the tuning of each row a ``--learn`` mask is learned by
    (one invocation per stage of its search, seed 0) and, for a learned mask exported by a comparison run
    (``…/<model>-<budget>/<row>/seed-<s>/model``), that run."""
    from compare_methods import stage_grids

    cmds = []
    grid = ",".join(f"{k}={','.join(map(str, v))}" for k, v in (tuning.get("grid") or {}).items())
    if grid:
        cmds.append(f"python benchmarks/compare_methods.py --tier {opts.tier} --tokens {opts.tokens} --tune {grid} "
                    "--tune-only naive-kd-sgpt --seeds 0 --only naive-kd-sgpt")
    for row, t in (learners or {}).items():
        cmds += [f"python benchmarks/compare_methods.py --tier {opts.tier} --tokens {opts.tokens} --tune {grid} "
                 f"--tune-only {row} --seeds 0 --only {row}" for grid in (stage_grids(t) if t.get("grid") else [])]
    for name_path in learned:
        if (run := comparison_run(name_path.split("=", 1)[1])) is not None:
            _, budget, row, seed = run
            cmds.append(f"python benchmarks/compare_methods.py --tier {opts.tier} --tokens {budget} --only {row}"
                        + (f" --seeds {seed}" if seed is not None else ""))
    return cmds


def learn_specs(rows: list[dict]) -> list[str]:
    """The ``--learn NAME=ROW:SEEDS`` that learn the table's learned-here masks again (from their records)."""
    specs: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        lr = r.get("learner") or {}
        if lr.get("name"):
            specs.setdefault((lr["name"], lr["row"]), []).append(lr["seed"])
    return [f"{name}={row}:{','.join(map(str, sorted(seeds)))}" for (name, row), seeds in specs.items()]


def learner_lines(rows: list[dict]) -> list[str]:
    """Each mask learned here (``--learn``): the learner run's own figures beside the comparison row's seed it
    repeats (a learner is that row only where they agree; code versions differ: see the comparison's notes)."""
    out = []
    for r in rows:
        lr = r.get("learner") or {}
        if lr.get("test") is None:
            continue
        ref = lr.get("comparison_row") or {}
        out.append(f"- learned by {r['label']}: `{lr.get('command')}` → test {lr['test']:.2f}, validation "
                   f"{format_number(lr.get('validation'))}, WikiText-2 {format_number(lr.get('wikitext2'))} (code "
                   f"{lr.get('code')})" + (f"; the comparison's own run of that row and seed: test {ref['test']:.2f}, "
                                           f"WikiText-2 {format_number(ref.get('wikitext2'))} (code {ref.get('code')})"
                                           if ref.get("test") is not None else ""))
    return ["", "Masks learned by this benchmark (`--learn`), each a run of a comparison row at its tuned "
            "setting; its mask file is committed beside the rows (`docs/results/mask-swap-rows/`):", ""] + out if out else []


def _before(r: dict) -> str:
    """Dense ⊙ mask before any retraining: test / WikiText-2 (— where not scored)."""
    b = r.get("before_retraining") or {}
    if b.get("test") is None:
        return "—"
    return f"{b['test']:.2f} / {format_number(b.get('wikitext2'))}"


def _cell(r: dict, split: str) -> str:
    """The mean over the seeds and, below it, every seed's value."""
    runs = [x for x in r.get("seeds") or [r] if x.get("status") == "ok"]
    per = ", ".join(f"s{x['seed']} {x[split]:.2f}" for x in runs)
    return f"{format_number(r.get(split))}<br>({per})"


def _pair(j: dict, split: str) -> str:
    p = (j.get("paired") or {}).get(split)
    if p is None:
        return "—"
    return f"{p['mean_diff']:+.2f} [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}] **{p['verdict']}**"


if __name__ == "__main__":
    sys.exit(main())
