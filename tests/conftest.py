import atexit
import itertools
import os
import shutil
import tempfile

import pytest
import torch

# 2 cores here: one intra-op thread per test process is faster than two fighting over a busy core
torch.set_num_threads(int(os.environ.get("CAST_TEST_THREADS", "1")))
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("CAST_TEST_THREADS", "1"))  # the trainer then keeps it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the CPU dispatcher's cold timings (and the careful head's check) overflow a 32 MiB cache in the suite and its
# subprocesses, whatever this machine's sysfs says (480 MiB on one Xeon VM: 2 x that per candidate made the
# generate / payoff / bench tests 2-3x slower); the tests check choices and reports, not timing precision
os.environ.setdefault("CAST_LLM_L3_BYTES", str(32 << 20))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# the token cache (and any other per-user cache) of this test session: never the developer's own. pytest-xdist's
# workers share the one their controller made (they inherit its environment; it removes the folder at exit), so
# the embedded model's GGUF is converted once a session, not once a worker (~10 s of CPU each here)
_SHARED = "CAST_TEST_SESSION_CACHE"
if "PYTEST_XDIST_WORKER" in os.environ and os.path.isdir(os.environ.get(_SHARED, "")):
    _CACHE = os.environ[_SHARED]
else:
    _CACHE = tempfile.mkdtemp(prefix="cast-llm-test-cache-")
    os.environ[_SHARED] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["CAST_LLM_CACHE"] = _CACHE
# kernel verdicts (cast_llm.kernels) go to a file of this test process, never the user's cache; the
# torch.compile candidates are left out (tens of seconds of compiling each) except where a test asks for them
_VERDICTS = tempfile.mkdtemp(prefix="cast-llm-verdicts-")
atexit.register(shutil.rmtree, _VERDICTS, ignore_errors=True)
os.environ["CAST_LLM_KERNEL_VERDICTS"] = os.path.join(_VERDICTS, "verdicts.json")
os.environ["CAST_LLM_COMPILE"] = "0"
_KERNELS_MODE = os.environ.get("CAST_LLM_KERNELS")  # a run of the whole suite in reference mode keeps it


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_kernel_verdicts(tmp_path_factory, monkeypatch):
    """Every test decides its kernel paths afresh (cast_llm.kernels: probes, verdicts, warnings), from an empty
    verdict file of its own: what one test injected or cached never leaks into another."""
    from cast_llm import kernels

    monkeypatch.setenv("CAST_LLM_KERNEL_VERDICTS", str(tmp_path_factory.mktemp("verdicts") / "verdicts.json"))
    if _KERNELS_MODE is None:  # a command's --kernels sets the variable for its child processes: not for the next test
        monkeypatch.delenv("CAST_LLM_KERNELS", raising=False)
    else:
        monkeypatch.setenv("CAST_LLM_KERNELS", _KERNELS_MODE)
    monkeypatch.setattr(kernels.switch, "_MODE", [])
    kernels.reset()
    yield
    kernels.reset()


@pytest.fixture(autouse=True)
def _short_cpu_gemm_timings(monkeypatch):
    """The CPU dispatcher's timings shortened for the suite's tiny layers (three rounds of 5 ms over at most 16
    copies of a weight, against the product's five of 20 ms over up to 512): what the tests check is which
    candidate a measurement picks and what is reported, not how precise the timing is; a test that needs the
    product's values sets them back."""
    from cast_llm.deploy.sparse24 import cycles

    monkeypatch.setattr(cycles, "REPEATS", 3)
    monkeypatch.setattr(cycles, "MIN_TIME", 0.005)
    monkeypatch.setattr(cycles, "MAX_COPIES", 16)


@pytest.fixture(scope="session")
def triton_interpreter():
    """Code run under Triton's interpreter (TRITON_INTERPRET=1, one intra-op thread) in a process of its own:
    ``triton_interpreter.run(code)`` forks it from one warm server per pytest worker that has imported torch,
    Triton, the package's kernels and the tests' check modules (tests/warm_interpreter.py), instead of paying
    those imports in a new interpreter per test."""
    from warm_interpreter import WarmInterpreter

    here = os.path.dirname(os.path.abspath(__file__))
    server = WarmInterpreter({"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}, path=[here], preload=[
        "torch", "triton", "transformers", "cast_llm.cli", "cast_llm.optim.triton_adams", "cast_llm.train.trainer",
        "test_triton_adams", "step_kernel_checks", "step_sync_checks", "tiny"])
    yield server
    server.close()


@pytest.fixture(scope="session")
def plain_transformers():
    """Code run in a process that has imported torch and transformers and never cast_llm (what a user without
    cast-llm has): ``plain_transformers.run(code)`` forks it from one warm server per pytest worker."""
    from warm_interpreter import WarmInterpreter

    server = WarmInterpreter({}, preload=["torch", "transformers", "transformers.models.llama.modeling_llama",
                                          "transformers.models.gpt2.modeling_gpt2",
                                          "transformers.models.opt.modeling_opt"])
    yield server
    server.close()


@pytest.fixture(scope="session")
def _warm_cli_server():
    from warm_interpreter import WarmInterpreter

    server = WarmInterpreter({"OMP_NUM_THREADS": "1"}, preload=[
        "torch", "transformers", "transformers.models.llama.modeling_llama", "cast_llm.cli", "cast_llm.cli.train",
        "cast_llm.cli.finetune", "cast_llm.train.trainer", "cast_llm.finetune.job"])
    yield server
    server.close()


@pytest.fixture(scope="session")
def warm_torchrun():
    """``warm_torchrun.run(argv, nproc)``: torchrun's launch of NPROC ranks on this machine, each rank forked from
    a warm server per rank and pytest worker that has imported the training stack (tests/warm_interpreter.py's
    WarmRanks): for the tests that compare what several ranks compute. The tests that signal the launcher or
    start `accelerate launch` run the real launcher."""
    from warm_interpreter import WarmRanks

    ranks = WarmRanks(["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                       "transformers", "transformers.models.llama.modeling_llama", "accelerate", "cast_llm.cli",
                       "cast_llm.cli.train", "cast_llm.train.trainer"], path=[os.path.dirname(os.path.abspath(__file__))])
    yield ranks
    ranks.close()


@pytest.fixture
def warm_cli(_warm_cli_server):
    """The command line in a process of its own, as ``python -c "from cast_llm.cli import main; ..."`` runs it
    (one intra-op thread): ``warm_cli.start(code, unbuffered=True)`` forks it, Popen-like, from one warm
    server per pytest worker that has imported the training and fine-tuning stacks. For the tests that signal
    or kill a running command; a child a failing test left running is killed after it, so the next test's
    starts."""
    yield _warm_cli_server
    _warm_cli_server.reap()


def pytest_configure(config):
    # model-loading progress bars would drown the one-line errors the CLI tests look for
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------- markers
# the fixtures above whose tests run code in another process (a child of a warm interpreter)
_SPAWNING_FIXTURES = {"triton_interpreter", "plain_transformers", "warm_cli"}


def _spawning_tests(path) -> set[str]:
    """Names of the test functions in ``path`` that start other processes: they call ``subprocess`` directly,
    through a module-level helper that does, or take a module fixture that does or one of _SPAWNING_FIXTURES
    (found in the source, so a new such test is marked too)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    fixtures = {f.name for f in funcs if any("fixture" in ast.unparse(d) for d in f.decorator_list)}

    def spawns(f, names) -> bool:
        return any((isinstance(c, ast.Attribute) and isinstance(c.value, ast.Name) and c.value.id in names)
                   or (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in names)
                   for c in ast.walk(f)) or any(a.arg in names & (fixtures | _SPAWNING_FIXTURES)
                                                for a in f.args.args)

    spawners = {"subprocess", "WarmInterpreter", *_SPAWNING_FIXTURES}
    for _ in range(len(funcs)):  # helpers and fixtures that call (or take) ones that spawn
        more = {f.name for f in funcs if not f.name.startswith("test") and spawns(f, spawners)}
        if more <= spawners:
            break
        spawners |= more
    return {f.name for f in funcs if f.name.startswith("test") and spawns(f, spawners)}


_SPAWNING: dict = {}


def pytest_itemcollected(item):
    # tests that start other processes (a CLI in a fresh interpreter, torchrun, the Triton interpreter) are
    # `slow` too: `make test-fast` leaves them out, `make test` (and CI) runs everything. Marked as collected,
    # before -m selects.
    path = getattr(item, "path", None)
    if path is None or path.suffix != ".py":
        return
    if path not in _SPAWNING:
        _SPAWNING[path] = _spawning_tests(path)
    if getattr(item, "originalname", None) in _SPAWNING[path]:
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # after -m / -k have selected and pytest has grouped the fixtures
def pytest_collection_modifyitems(config, items):
    """Each half of the run order starts with its share of the slow tests and ends with quick ones.

    `make test` runs two pytest-xdist workers with --dist worksteal: the first gets the first half of this
    order, the second the rest, and an idle worker steals from the end of the other's queue. In file order
    the slow tests (two thirds of the time in under 5 % of the tests, measured 2026-11-29) cluster in a few
    late files, so the run ended with one worker in a long multi-process test and the other idle. Here the
    slow tests are split between the halves, a file's slow tests kept together (they share module fixtures,
    e.g. one FSDP2 reference run), and each half ends with quick tests that steal well. Without xdist the
    order changes nothing else."""
    slow = [i for i in items if i.get_closest_marker("slow")]
    if len(slow) < 2:
        return
    quick = [i for i in items if not i.get_closest_marker("slow")]
    first: list = []
    second: list = []
    groups = [list(g) for _, g in itertools.groupby(slow, key=lambda i: getattr(i, "path", None))]
    for group in sorted(groups, key=len, reverse=True):  # the larger files first, each to the shorter half
        (first if len(first) <= len(second) else second).extend(group)
    k = max(0, len(items) // 2 - len(first))  # xdist's first worker takes len(items) // 2 tests
    items[:] = first + quick[:k] + second + quick[k:]
