import os

import pytest
import torch

# two cores here: keep intra-op threads small so parallel test processes do not thrash
torch.set_num_threads(int(os.environ.get("CAST_TEST_THREADS", "2")))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
