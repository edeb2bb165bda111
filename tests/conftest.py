import atexit
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
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# the token cache (and any other per-user cache) of this test session: never the developer's own
_CACHE = tempfile.mkdtemp(prefix="cast-llm-test-cache-")
os.environ["CAST_LLM_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# kernel verdicts (cast_llm.kernels) go to a file of this test process, never the user's cache; the
# torch.compile candidates are left out (tens of seconds of compiling each) except where a test asks for them
os.environ["CAST_LLM_KERNEL_VERDICTS"] = os.path.join(tempfile.mkdtemp(prefix="cast-llm-verdicts-"), "verdicts.json")
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


def pytest_configure(config):
    # model-loading progress bars would drown the one-line errors the CLI tests look for
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
