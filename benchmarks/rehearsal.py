"""A paper-scale CAST run, scaled down and rehearsed on the CPU: every mechanism of the 8-GPU run, measured
against the plan.

The model is Llama-3.1-8B's architecture (its embedded config: GQA, untied head, rope scaling, bf16 on disk)
with 4 blocks, hidden 1024, MLP 3584 and a vocabulary of 8192 (random weights, its own small tokenizer and
text: nothing to download). It is trained the way the 8-GPU run is launched — ``--fsdp --preset llama`` —
on 2 gloo processes, with the preset's global batch scaled down (8 sequences of 128 tokens: micro-batch 1 ×
accumulation 4 × 2 processes), the SparseGPT warm start and the baseline evaluation, in three segments:

1. ``torchrun --shutdown-timeout 600`` from the start; SIGTERM to torchrun (which forwards it to the
   workers, then kills them after its shutdown timeout: 30 s by default, shorter than a step here) once the
   step-3 checkpoint exists;
2. resumed by two processes started directly, as ``srun`` starts one task per GPU (``RANK``,
   ``WORLD_SIZE``, ``MASTER_ADDR``, … in their environment, no torchrun); SIGTERM to each process once the
   step-6 checkpoint exists;
3. resumed by ``torchrun`` to the end: export (bf16, the model's own dtype) and final evaluation.

The processes run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc returns freed blocks from 128 KiB to the
system), so that their resident set follows their tensors, which is what the plan predicts (with glibc's
default the resident set runs up to 30 % above: ``docs/results/plan-vs-measured.md``).

Measured: every phase's wall time and peak resident set on each rank (the trainer's own ``phases`` in
``results.json``: ``VmHWM`` reset at each phase), the steps' peak per rank, each checkpoint's cost, the time
from SIGTERM to exit, and — independently, from outside — the largest resident set of each worker process
sampled every 0.1 s. Planned: the same quantities from ``cast_llm.plan`` (the steps' memory plan and
:mod:`cast_llm.plan.startup`) for this run's own configuration. Then the plan of the run it rehearses
(Llama-3.1-8B on 8 × 80 GB, ``cast-llm plan --model llama-3.1-8b --gpus 8 --fsdp
--activation-checkpointing --batch-size 0``).

    python benchmarks/rehearsal.py                    # ~5-10 min on 2 cores; writes docs/results/rehearsal.md
    python benchmarks/rehearsal.py --json out.json --md /tmp/r.md --work /tmp/rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from plan_vs_measured import filler_documents  # noqa: E402

from cast_llm.io import RunDir  # noqa: E402

GiB, MiB = 2**30, 2**20
SHAPE = dict(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=8192)  # 8B: 32 blocks, 4096, 14336, 32 heads, 8 kv, 128256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(folder: Path) -> Path:
    """Llama-3.1-8B's config with :data:`SHAPE`, random weights saved in bf16 (as the 8B is), a BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from cast_llm.plan.shapes import embedded_config

    if (folder / "config.json").is_file():
        return folder
    # the tokenizer's one special token (id 0) as BOS/EOS/pad: the 8B's ids are outside an 8192 vocabulary
    d = {**embedded_config("llama-3.1-8b"), **SHAPE, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(filler_documents(200), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(folder)
    return folder


def write_data(folder: Path) -> tuple[Path, Path]:
    corpus, wiki = folder / "corpus.jsonl", folder / "eval.txt"
    if not corpus.is_file():
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in filler_documents(600)))
        wiki.write_text("\n\n".join(filler_documents(20)))
    return corpus, wiki


class RssSampler:
    """The largest resident set of each worker (by its RANK), sampled every 0.1 s from outside."""

    def __init__(self, pids_fn):
        self.pids_fn, self.peak, self._stop = pids_fn, {}, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while not self._stop.is_set():
            for pid in self.pids_fn():
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
                    rss = next(int(x.split()[1]) * 1024 for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                               if x.startswith("VmRSS:"))
                except (OSError, StopIteration, ValueError):
                    continue
                self.peak[rank] = max(self.peak.get(rank, 0), rss)
            time.sleep(0.1)

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self.thread.join()
        return dict(sorted(self.peak.items()))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _wait_for(path: Path, procs, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.is_dir():
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process ended before {path} was written")
        if time.time() > deadline:
            raise RuntimeError(f"{path} not written within {timeout:.0f} s")
        time.sleep(0.05)


def segment(name, cmds, envs, out: Path, log: Path, *, stop_at: Path | None, timeout: float) -> dict:
    """Run one segment: ``cmds`` (one torchrun, or one process per rank), SIGTERM once ``stop_at`` exists."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        procs = [subprocess.Popen(c, env=e, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                 for c, e in zip(cmds, envs)]
        torchrun = len(procs) == 1
        sampler = RssSampler(lambda: _children(procs[0].pid) if torchrun else [p.pid for p in procs])
        signalled = None
        if stop_at is not None:
            _wait_for(stop_at, procs, timeout)
            signalled = time.perf_counter()
            for p in procs:  # torchrun forwards it to its workers; srun-style tasks get it each
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=timeout) for p in procs]
        ended = time.perf_counter()
        peaks = sampler.stop()
    results = json.loads(RunDir(out).results.read_text())
    return {"name": name, "commands": [shlex.join(c) for c in cmds], "exit_codes": codes,
            "wall_s": ended - t0, "sigterm_to_exit_s": None if signalled is None else ended - signalled,
            "rss_sampled_peak": peaks, "phases": results.get("phases", {}), "checkpoint": results.get("checkpoint"),
            "memory": {k: v for k, v in results.get("memory", {}).items() if k != "plan"},
            "log_tail": log.read_text().splitlines()[-3:]}


def the_plan(out: Path, framework: int):
    """The plan of this run's own configuration (its config.yaml), as the trainer makes it."""
    import torch

    from cast_llm.config import load_yaml, resolve
    from cast_llm.models import empty_model
    from cast_llm.train.config import TrainConfig
    from cast_llm.train.memory import plan_for_run

    data = load_yaml(RunDir(out).config)
    data.pop("resume", None)
    cfg = resolve(TrainConfig, ("config.yaml", data))
    skeleton = empty_model(cfg.model)
    memory, startup, _ = plan_for_run(cfg, skeleton, world=2, device=torch.device("cpu"), precision="no",
                                      framework=framework, native_bytes=2)
    return (cfg, memory, startup, sum(p.numel() for p in skeleton.parameters()),
            max(p.numel() for p in skeleton.parameters()), memory.shape.block_params)


def plan_8b() -> list[str]:
    from cast_llm.plan import PlanOptions, plan_run
    from cast_llm.plan.report import plan_lines
    from cast_llm.train.config import PRESETS, TrainConfig

    run = TrainConfig(**{**PRESETS["llama"], "model": "llama-3.1-8b", "fsdp": True,
                         "activation_checkpointing": "full", "output_dir": "(planned)"})
    return plan_lines(plan_run(run, PlanOptions(gpus=8, host_memory="1TB")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one, removed)")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--md", default=str(REPO / "docs/results/rehearsal.md"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, metavar="JSON", help="only write --md from a --json of an earlier run")
    args = ap.parse_args(argv)
    if args.render:
        Path(args.md).write_text(render(json.loads(Path(args.render).read_text())))
        return 0
    sys.path.insert(0, str(REPO / "src"))
    from _common import machine

    work = Path(args.work or tempfile.mkdtemp(prefix="cast-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "model")
    corpus, wiki = write_data(work)
    out = work / "run"
    if out.exists():
        raise SystemExit(f"{out} exists: give another --work")
    third = max(1, args.steps // 3)
    train = ["train", "--fsdp", "--preset", "llama", "--model", str(model), "--data", str(corpus),
             "--wikitext-file", str(wiki), "--seq-len", "128", "--global-batch", "8", "--batch-size", "1",
             "--max-steps", str(args.steps), "--save-every", str(third), "--calib-samples", "16",
             "--val-sequences", "4", "--wikitext-windows", "2", "--device", "cpu", "--no-progress",
             "--log-every", "1", "--no-report", "--threads", "1", "--output-dir", str(out)]
    resume = ["train", "--output-dir", str(out), "--resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    py = sys.executable

    def torchrun(tail):
        return [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
                "--shutdown-timeout", "600", "-m", "cast_llm.cli", *tail]

    ck = out / "checkpoints"
    load_before = os.getloadavg()
    t_all = time.perf_counter()
    segs = [segment("1: torchrun --shutdown-timeout 600, SIGTERM to torchrun", [torchrun(train)], [env], out, work / "seg1.log",
                    stop_at=ck / f"step-{third:08d}", timeout=3600)]
    port = str(_free_port())
    direct = [{**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]
    segs.append(segment("2: one process per rank (as srun), SIGTERM to each", [[py, "-m", "cast_llm.cli", *resume]] * 2,
                        direct, out, work / "seg2.log", stop_at=ck / f"step-{2 * third:08d}", timeout=3600))
    segs.append(segment("3: torchrun --resume to the end", [torchrun(resume)], [env], out, work / "seg3.log",
                        stop_at=None, timeout=3600))
    total = time.perf_counter() - t_all
    frameworks = segs[-1]["memory"]["framework_per_rank"]  # measured before the steps of the last segment
    cfg, memory, startup, params, largest, block = the_plan(out, max(frameworks))
    exported = json.loads((out / "config.json").read_text())
    result = {"machine": machine(), "load_before": load_before, "params": params, "largest_tensor": largest,
              "block_params": block,
              "segments": segs,
              "total_s": total, "batch": [cfg.batch_size, cfg.grad_accum, 2],
              "export_dtype": exported.get("dtype") or exported.get("torch_dtype"),
              "plan": {"steps": memory.as_dict(), "startup": startup.as_dict(), "frameworks": frameworks},
              "plan_8b": plan_8b(), "command": "python benchmarks/rehearsal.py " + shlex.join(argv or sys.argv[1:])}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    Path(args.md).write_text(render(result))
    print(render(result))
    return 0 if all(c == 0 for c in segs[-1]["exit_codes"]) else 1


def _mb(x) -> str:
    return "—" if x is None else f"{x / MiB:,.0f}"


def planned_growth(r: dict) -> dict[str, list[int | None]]:
    """What the plan says each phase adds to each rank's resident set (a CPU's host memory holds everything):
    the tensors it creates (loading rank 0's fp32 copy; the teacher's and the student's shards, with one whole
    tensor at a time in flight; SparseGPT's block; the gathered model at the end)."""
    plan, P4 = r["plan"], 4 * r["params"]
    st, pers = plan["startup"]["memory"], plan["steps"]["persistent"]
    teacher = next((v for k, v in pers.items() if k.startswith("teacher")), 0)
    student = pers["weights (fp32 master)"]
    largest = 4 * r["largest_tensor"]
    return {
        "load the model": [st["rank 0 host: loading the model (fp32, and its file)"], 0],
        "baseline evaluation (rank 0)": [st["rank 0 device: baseline evaluation (whole fp32 model)"] - P4, None],
        "teacher: sharded from rank 0": [teacher + largest, teacher + largest],
        # (on a CPU the block is already in host memory: the rest of SparseGPT's working set, and its masks)
        "one-shot start": [st["rank 0 device: SparseGPT warm start (one block)"] - 4 * r["block_params"]
                           + st["rank 0 host: SparseGPT's masks (bool)"], 0],
        "student: sharded": [student + largest, student + largest],
        "final model: gathered and folded": [st["rank 0 host: the end (gathered fp32 model, its masks)"], largest],
    }


def render(r: dict) -> str:
    segs, plan = r["segments"], r["plan"]
    st = plan["startup"]
    P4 = 4 * r["params"]
    lines = ["# Rehearsal: the paper-scale FSDP2 run, scaled down, on CPU", "",
             f"Command: `{r['command']}` (`benchmarks/rehearsal.py`; its docstring says what each segment does).",
             f"Machine: {r['machine']}. The 2 cores were shared with other jobs (load average "
             f"{', '.join(f'{x:.1f}' for x in r['load_before'])} before the start): timings are indicative.", "",
             f"Model: Llama-3.1-8B's architecture with {SHAPE['num_hidden_layers']} blocks, hidden "
             f"{SHAPE['hidden_size']}, MLP {SHAPE['intermediate_size']}, vocabulary {SHAPE['vocab_size']}: "
             f"{r['params'] / 1e6:.1f}M parameters ({P4 / MiB:,.0f} MiB in fp32), bf16 on disk. Batch: "
             f"micro-batch {r['batch'][0]} × accumulation {r['batch'][1]} × {r['batch'][2]} processes = "
             f"{r['batch'][0] * r['batch'][1] * r['batch'][2]} sequences of 128 tokens. Exported in "
             f"{r['export_dtype']}. Total wall time {r['total_s']:.0f} s.", "",
             "## Segments", "",
             "| segment | exit codes | wall | SIGTERM → exit | its first checkpoint, per rank | a step before it |",
             "|---|---|---:|---:|---|---:|"]
    for s in segs:
        c = s["checkpoint"] or {}
        cps = f"{_mb(c.get('bytes_per_rank'))} MiB in {c.get('seconds')} s" if c else "—"
        sig = "—" if s["sigterm_to_exit_s"] is None else f"{s['sigterm_to_exit_s']:.1f} s"
        step = f"{c['step_seconds']} s" if c.get("step_seconds") is not None else "—"
        lines.append(f"| {s['name']} | {s['exit_codes']} | {s['wall_s']:.0f} s | {sig} | {cps} | {step} |")
    step0 = [s["name"][0] for s in segs if (s["checkpoint"] or {}).get("step_seconds") is None and s["checkpoint"]]
    lines += ["", "Exit code 75 is the trainer's \"stopped with a checkpoint\"; torchrun reports a worker's "
              "non-zero exit as its own failure (1). A SIGTERM needs the step in flight plus a checkpoint: the "
              "trainer prints that figure at its first checkpoint."
              + (f" Segment {', '.join(step0)}'s first checkpoint is the step-0 one that saves a warm start slower "
                 "than a minute (no step before it; AdamS holds no moments yet, hence its size)." if step0 else ""),
              "",
              "## Host memory per rank (MiB): measured against the plan", "",
              "Around the steps, each phase's growth of the resident set (its peak less the resident set when it "
              "began: the trainer's own `phases` in `results.json`) against the tensors the plan says the phase "
              "creates on that rank. The steps: the peak over the steps per rank against the plan's peak plus "
              "that rank's framework, measured by the trainer just before the steps of that segment (interpreter, "
              "libraries, tokenizer, data: the resident set less the tensors the plan counts). `—`: the rank does "
              "not run the phase.", "",
              "| phase | rank 0 measured | rank 0 plan | rank 1 measured | rank 1 plan |", "|---|---:|---:|---:|---:|"]
    planned = planned_growth(r)

    def growth(rec, i):
        if len(rec["host_peak"]) <= i or rec["host_peak"][i] is None:
            return None
        return rec["host_peak"][i] - rec["host_start"][i]

    first, last = segs[0]["phases"], segs[-1]["phases"]
    for name, where in [("load the model", first), ("baseline evaluation (rank 0)", first),
                        ("teacher: sharded from rank 0", first), ("one-shot start", first),
                        ("student: sharded", first), ("final model: gathered and folded", last)]:
        if name in where:
            pl = planned[name]
            lines.append(f"| {name} | +{_mb(growth(where[name], 0))} | +{_mb(pl[0])} | "
                         f"+{_mb(growth(where[name], 1))} | +{_mb(pl[1])} |".replace("+—", "—"))
    steps = plan["steps"]["peak"] - plan["steps"]["persistent"].get("framework", 0)
    ratios = []
    for s in segs:
        m, fws = s["memory"].get("measured_per_rank"), s["memory"].get("framework_per_rank")
        if m:
            ratios.append(max(m[0] / (fws[0] + steps), m[1] / (fws[1] + steps)))
            lines.append(f"| the steps, segment {s['name'][0]} | {_mb(m[0])} | {_mb(fws[0] + steps)} | "
                         f"{_mb(m[1])} | {_mb(fws[1] + steps)} |")
    lines.append("| whole run, sampled from outside every 0.1 s | "
                 + " | — | ".join(_mb(max(s["rss_sampled_peak"].get(k, s["rss_sampled_peak"].get(str(k), 0))
                                         for s in segs)) for k in (0, 1)) + " | — |")
    lines += ["", "The steps measured " + ", ".join(f"{x:.2f}" for x in ratios) + " × the plan (segments 1, 2, "
              "3; the larger rank): inside the 30 % that the plan's verdict adds on a CPU (`cast_llm/plan/memory.py`, "
              "`CPU_RETENTION`; the processes here return freed blocks from 128 KiB to the system). The peak is the "
              "same in every segment; a resumed segment measures a smaller framework before its steps (it loaded "
              "and freed nothing), so what its ratio adds is memory outside the plan's tensors that the framework "
              "measure misses, not a term of the plan.", "",
              "## Phases (seconds per rank) against the plan's estimates", "",
              "The estimates use the stated CPU rates of `cast_llm/plan/startup.py`: of the right order, not "
              "measurements (a loaded 2-core machine is slower, an idle one faster); the timeouts take 4 × the "
              "estimates and never less than torch's defaults (10 and 30 minutes).", "",
              "| phase (first segment that ran it) | rank 0 | rank 1 | plan estimate |", "|---|---:|---:|---:|"]
    est = st["seconds"]
    match = {"load the model": "load the model (rank 0)", "baseline evaluation (rank 0)": "baseline evaluation (rank 0)",
             "one-shot start": "SparseGPT warm start (rank 0)", "one-shot evaluation (rank 0)": "one-shot evaluation (rank 0)",
             "export (rank 0)": "export (rank 0)", "final evaluation (rank 0)": "final evaluation (rank 0)"}
    seen = {}
    for s in segs:
        for name, rec in s["phases"].items():
            seen.setdefault(name, rec)
    for name, rec in seen.items():
        sec = rec["seconds"]
        e = est.get(match.get(name, ""), None)
        lines.append(f"| {name} | {sec[0] if sec[0] is not None else '—'} | "
                     f"{sec[1] if len(sec) > 1 and sec[1] is not None else '—'} | {'—' if e is None else f'{e:.1f}'} |")
    c = max((s["checkpoint"] for s in segs if s["checkpoint"]), key=lambda x: x["bytes_per_rank"], default={})
    lines += ["", f"Checkpoint per rank (the largest first checkpoint of a segment): "
              f"{_mb(c.get('bytes_per_rank'))} MiB written (plan: {_mb(st['checkpoint_bytes'])} MiB of tensors), "
              f"{c.get('seconds')} s; plan estimate "
              f"{est['a checkpoint (each rank: write + hash)']:.1f} s. Timeouts this run set: training collectives "
              f"{st['timeouts']['collective']:.0f} s, waiting for rank 0 {st['timeouts']['wait']:.0f} s.", "",
              "## The run it rehearses: Llama-3.1-8B on 8 × 80 GB", "",
              "`cast-llm plan --model llama-3.1-8b --gpus 8 --fsdp --activation-checkpointing --batch-size 0 "
              "--host-memory 1TB`:", "", "```", *r["plan_8b"], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
