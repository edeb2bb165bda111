"""Zero-shot and few-shot accuracy through EleutherAI's lm-evaluation-harness (method.md §7).

The paper scores its sparse models with lm-eval on HellaSwag, RACE, PIQA, WinoGrande, ARC-e, ARC-c and
OpenBookQA (zero-shot), plus few-shot MMLU, MATH, TriviaQA, NQ, BoolQ, CSQA, SciQ, GSM8K. We call the
harness's Python API on the model *object* we hold (``HFLM(pretrained=model)``), not on a path, so a
checkpoint from any stage of training, or a model pruned in memory a moment ago, is scored as it is.

A multiple-choice item is scored as the harness does: every choice becomes the continuation
``target_delimiter + choice`` of the prompt; its log-likelihood is the sum of the log-probabilities of its
tokens. ``acc`` takes the argmax of those sums, ``acc_norm`` the argmax of the sums divided by the choice's
length in characters (lm-eval 0.4's ``len(choice)``; ``acc_bytes`` would divide by UTF-8 bytes).

Averages: ``average["acc"]`` is the mean ``acc`` over the tasks that report it; ``average["acc_norm"]`` the
mean over the same tasks of ``acc_norm`` where the harness has it and ``acc`` where it does not (RACE,
WinoGrande) - the usual convention of papers that quote one number per task.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cast_llm.errors import CastError
from cast_llm.io import atomic_write_json, atomic_write_text, cache_dir, read_json

DEFAULT_TASKS = ("hellaswag", "race", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
HEADLINE_METRICS = ("acc", "acc_norm")


@dataclass
class TaskScore:
    """One row of the result: a task (or a group's aggregate), its accuracies and their standard errors."""

    task: str
    acc: float | None = None
    acc_stderr: float | None = None
    acc_norm: float | None = None
    acc_norm_stderr: float | None = None
    n_samples: int | None = None  # items scored (after --limit)
    num_fewshot: int | None = None
    is_group: bool = False
    # every numeric "metric,filter" value the harness reported (exact_match of generative tasks, ...)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ZeroShotResult:
    tasks: list[TaskScore]  # the requested tasks (groups as their aggregate row)
    subtasks: list[TaskScore]  # members of requested groups
    average: dict[str, float | None]
    num_fewshot: int | None
    limit: float | None
    seconds: float
    lm_eval_version: str
    model: str = ""
    # per task: [{"doc_id", "target", "loglikelihoods"}], only with log_samples=True
    samples: dict[str, list[dict]] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.samples is None:
            d.pop("samples")
        return d

    def write_json(self, path: str | Path) -> Path:
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def to_markdown(self) -> str:
        return _markdown(self)

    def write_markdown(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.to_markdown())

    def __str__(self) -> str:
        return self.to_markdown()


# ---------------------------------------------------------------- task loading


@contextlib.contextmanager
def _quiet_lm_eval(verbose: bool):
    """lm-eval warns on every in-memory model ("pretrained is not of type str") and logs each task build;
    keep its errors, drop the rest unless asked."""
    logger = logging.getLogger("lm_eval")
    old = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _is_download_error(e: BaseException) -> bool:
    # datasets raises ConnectionError (offline or unreachable hub); huggingface_hub/httpx/requests have their
    # own exception trees, so look at the module and the message as well as the type
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    mod = type(e).__module__.split(".")[0]
    text = f"{type(e).__name__} {e}".lower()
    return mod in ("httpx", "requests", "urllib3", "huggingface_hub") or any(
        s in text for s in ("offline", "couldn't reach", "connection", "datasetnotfound", "dataset not found")
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def task_error(name: str, e: BaseException) -> CastError:
    """A one-line CastError for a task that could not be built (unknown name, dataset not downloadable)."""
    if isinstance(e, KeyError) and "not a registered task" in str(e):
        return _unknown_task(name)
    if _is_download_error(e):
        return CastError(
            f"task '{name}': its dataset could not be downloaded ({type(e).__name__}: {_first_line(e)}); "
            "run once with network access (datasets caches it) or use a local task with --include-path"
        )
    return CastError(f"task '{name}' could not be loaded: {type(e).__name__}: {_first_line(e)}")


def _unknown_task(name: str) -> CastError:
    return CastError(
        f"unknown lm-eval task '{name}': not in lm-eval's task list nor under --include-path "
        "(list them with `lm-eval ls tasks`)"
    )


TASK_NAMES_MARKER = "cast-llm lm-eval task names"


def _task_names_path() -> Path:
    """Where the names of lm-eval's own tasks (tasks, groups, tags) are remembered, per lm-eval version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("lm_eval")
    except PackageNotFoundError:
        release = "unknown"
    return cache_dir() / f"lm-eval-task-names-{release}.json"


def cached_task_names() -> set[str] | None:
    """lm-eval's own task names as remembered by an earlier scan (None: none remembered, or the file is not one
    cast-llm wrote, or a link)."""
    path = _task_names_path()
    if path.is_symlink() or not path.is_file():
        return None
    data = read_json(path)  # {} where unreadable
    if not isinstance(data, dict) or data.get("written_by") != TASK_NAMES_MARKER or not isinstance(
            data.get("names"), list):
        return None
    return set(data["names"])


def _remember_task_names(manager, known: set[str] | None) -> None:
    """Keep the scanned index's names (a typo is then refused at once, not after a ~15 s scan); ``known``: what
    :func:`cached_task_names` read before the scan (the same names: nothing to write). A file there that cast-llm
    did not write, or a link, is left alone."""
    names = sorted(manager.all_tasks)
    if known is not None and known == set(names):
        return
    path = _task_names_path()
    if path.is_symlink() or (path.exists() and known is None):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"written_by": TASK_NAMES_MARKER, "names": names})
    except OSError:
        pass  # a read-only cache only costs the next typo its scan


def _task_manager(names: list[str], include_path):
    """A TaskManager; scanning lm-eval's own ~15k task configs takes seconds, so when every requested
    name is a task under ``include_path`` only that folder is indexed, and without one a name missing from the
    names an earlier scan remembered (:func:`cached_task_names`) is refused before scanning (and before importing
    lm-eval's task code, ~6 s here)."""
    known = cached_task_names() if include_path is None else None
    for name in names if known is not None else ():
        if name not in known:
            raise _unknown_task(name)
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        paths = include_path if isinstance(include_path, (list, tuple)) else [include_path]
        for p in paths:
            if not Path(p).exists():
                raise CastError(
                    f"--include-path {p} does not exist (pass a folder of lm-eval task YAML files)"
                )
        local = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
        if all(n in local.all_subtasks for n in names):
            return local
        return TaskManager(include_path=[str(p) for p in paths])
    manager = TaskManager()
    _remember_task_names(manager, known)
    return manager


@dataclass
class TaskSet:
    """Tasks built and ready to score (datasets downloaded): see :func:`load_tasks`."""

    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager
    objects: list  # Task / Group objects for simple_evaluate
    groups: dict[str, list[str]]  # requested group -> its leaf task names
    nested: set[str] = field(default_factory=set)  # everything inside a requested group (leaves, subgroups)


def load_tasks(
    tasks: str | list[str] | tuple[str, ...], include_path=None, *, verbose: bool = False
) -> TaskSet:
    """Build the tasks one name at a time so that a failure names its task (a one-line CastError).

    Separate from :func:`evaluate_zeroshot` so that the CLI fails on a missing dataset before it spends time
    loading a model.
    """
    names = parse_tasks(tasks)
    with _quiet_lm_eval(verbose):
        tm = _task_manager(names, include_path)
        objects, groups, nested = [], {}, set()
        for name in names:
            try:
                loaded = tm.load([name])
            except Exception as e:  # lm-eval and datasets raise anything from KeyError to ConnectionError
                raise task_error(name, e) from None
            if name in loaded["groups"]:
                objects.append(loaded["groups"][name])
                groups[name] = list(loaded["tasks"])
                nested |= (set(loaded["groups"]) - {name}) | set(loaded["tasks"])
            else:  # a task, or a tag that expands to several tasks
                objects.extend(loaded["tasks"].values())
    return TaskSet(names, tm, objects, groups, nested)


def parse_tasks(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """``"a,b , c"`` -> ``["a", "b", "c"]``; duplicates dropped, order kept."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = list(dict.fromkeys(s.strip() for s in items if s and s.strip()))
    if not out:
        raise CastError("no tasks given: pass --tasks as a comma-separated list, e.g. arc_easy,piqa")
    return out


# ---------------------------------------------------------------- evaluation


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _score(name: str, row: dict, n_samples, num_fewshot, is_group: bool) -> TaskScore:
    """Read one ``results[name]`` dict of the harness (keys like ``"acc,none"``, ``"acc_stderr,none"``)."""
    metrics = {
        k: float(v) for k, v in row.items() if "," in k and "_stderr" not in k and _number(v) is not None
    }
    score = TaskScore(
        task=name, n_samples=n_samples, num_fewshot=num_fewshot, is_group=is_group, metrics=metrics
    )
    for metric in HEADLINE_METRICS:
        # the unfiltered value ("none") when present, else the first filter the task defines
        key = (
            f"{metric},none"
            if f"{metric},none" in row
            else next((k for k in row if k.startswith(f"{metric},")), None)
        )
        if key is None:
            continue
        setattr(score, metric, _number(row[key]))
        setattr(score, f"{metric}_stderr", _number(row.get(key.replace(",", "_stderr,", 1))))
    return score


def _average(rows: list[TaskScore]) -> dict[str, float | None]:
    scored = [r for r in rows if r.acc is not None]
    if not scored:
        return {"acc": None, "acc_norm": None, "n_tasks": 0}
    return {
        "acc": sum(r.acc for r in scored) / len(scored),
        "acc_norm": sum(r.acc_norm if r.acc_norm is not None else r.acc for r in scored) / len(scored),
        "n_tasks": len(scored),
    }


def _collect_samples(raw: dict) -> dict[str, list[dict]]:
    out = {}
    for task, docs in (raw.get("samples") or {}).items():
        out[task] = [
            {
                "doc_id": d["doc_id"],
                "target": d.get("target"),
                "loglikelihoods": [
                    float(r[0])
                    for r in d.get("filtered_resps", d.get("resps", []))
                    if isinstance(r, (list, tuple))
                ],
            }
            for d in docs
        ]
    return out


def evaluate_zeroshot(
    model,
    tokenizer,
    tasks: TaskSet | list[str] | tuple[str, ...] | str = DEFAULT_TASKS,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 8,
    device: str | None = None,
    include_path: str | Path | list | None = None,
    seed: int = 0,
    max_length: int | None = None,
    log_samples: bool = False,
    verbose: bool = False,
    model_name: str = "",
) -> ZeroShotResult:
    """Score an in-memory causal LM with lm-eval (method.md §7, zero-/few-shot accuracy).

    ``num_fewshot=None`` keeps each task's own default (0 for the paper's zero-shot tasks); ``limit`` caps the
    items per task (a float < 1 is a fraction; for smoke tests only - numbers on a subset are not comparable).
    ``tasks``: names, or a :class:`TaskSet` from :func:`load_tasks`; ``include_path`` adds folders of local
    task YAML files. ``device`` moves the model there first (None: leave it where it is). ``seed`` seeds
    python/numpy/torch and the few-shot sampler. The model is put in eval mode for the run and its previous
    mode restored. Raises CastError, naming the task, when a task is
    unknown or its dataset cannot be downloaded.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    if num_fewshot is not None and num_fewshot < 0:
        raise CastError(f"--num-fewshot must be ≥ 0, got {num_fewshot}")
    if limit is not None and limit <= 0:
        raise CastError(f"--limit must be positive, got {limit}")
    taskset = tasks if isinstance(tasks, TaskSet) else load_tasks(tasks, include_path, verbose=verbose)
    names, groups = taskset.names, taskset.groups
    if device is not None:
        model.to(device)
    was_training = model.training
    t0 = time.perf_counter()
    try:
        with _quiet_lm_eval(verbose):
            lm = HFLM(
                pretrained=model,
                tokenizer=tokenizer,
                backend="causal",
                batch_size=batch_size,
                max_length=max_length,
            )
            try:
                raw = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=taskset.objects,
                    task_manager=taskset.manager,
                    num_fewshot=num_fewshot,
                    limit=limit,
                    log_samples=log_samples,
                    random_seed=seed,
                    numpy_random_seed=seed,
                    torch_random_seed=seed,
                    fewshot_random_seed=seed,
                )
            except Exception as e:  # a lazily downloaded few-shot split fails here, not at load time
                if _is_download_error(e):
                    raise task_error(",".join(names), e) from None
                raise
    finally:
        model.train(was_training)
    results, n_samples, configs = raw["results"], raw.get("n-samples", {}), raw.get("configs", {})

    def row(name: str, is_group: bool) -> TaskScore:
        n = n_samples.get(name, {}).get("effective")
        if is_group:  # a group's size and shots are those of its members
            members = groups.get(name, [])
            n = sum(n_samples.get(m, {}).get("effective", 0) for m in members) or None
            shots = {configs.get(m, {}).get("num_fewshot") for m in members}
            k = shots.pop() if len(shots) == 1 else None
        else:
            k = configs.get(name, {}).get("num_fewshot")
        return _score(name, results.get(name, {}), n, k, is_group)

    top_names = [*groups, *(t for t in results if t not in taskset.nested and t not in groups)]
    top = [row(n, n in groups) for n in top_names]
    order = {n: i for i, n in enumerate(names)}  # requested order; a tag's tasks follow alphabetically
    top.sort(key=lambda r: (order.get(r.task, len(order)), r.task))
    subtasks = [row(m, False) for g in groups for m in groups[g]]
    return ZeroShotResult(
        tasks=top,
        subtasks=subtasks,
        average=_average(top),
        num_fewshot=num_fewshot,
        limit=limit,
        seconds=time.perf_counter() - t0,
        lm_eval_version=lm_eval.__version__,
        model=model_name,
        samples=_collect_samples(raw) if log_samples else None,
    )


# ---------------------------------------------------------------- report


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}"


def _markdown(r: ZeroShotResult) -> str:
    shots = "task default" if r.num_fewshot is None else str(r.num_fewshot)
    head = f"# Zero-/few-shot accuracy{f' — {r.model}' if r.model else ''}\n\n"
    head += f"lm-eval {r.lm_eval_version}, few-shot: {shots}"
    head += f", limit: {r.limit} items per task (subset: not comparable to full runs)" if r.limit else ""
    lines = [
        head,
        "",
        "| task | n | shots | acc (%) | ± | acc_norm (%) | ± |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in r.tasks:
        name = f"{t.task} (group)" if t.is_group else t.task
        n, k = ("—" if v is None else v for v in (t.n_samples, t.num_fewshot))
        lines.append(
            f"| {name} | {n} | {k} | {_pct(t.acc)} | {_pct(t.acc_stderr)} "
            f"| {_pct(t.acc_norm)} | {_pct(t.acc_norm_stderr)} |"
        )
    a = r.average
    lines.append(
        f"| **average** ({a.get('n_tasks', 0)} tasks) | | | {_pct(a['acc'])} | | {_pct(a['acc_norm'])} | |"
    )
    lines += ["", "± is the standard error. The acc_norm average uses acc for tasks without acc_norm."]
    others = [t for t in r.tasks if t.acc is None and t.metrics]
    if others:  # generative few-shot tasks (GSM8K, TriviaQA, ...) report other metrics
        lines += ["", "| task | metric | value |", "|---|---|---:|"]
        lines += [f"| {t.task} | {k} | {v:.4f} |" for t in others for k, v in sorted(t.metrics.items())]
    return "\n".join(lines) + "\n"
