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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_configure(config):
    # model-loading progress bars would drown the one-line errors the CLI tests look for
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
