"""Shared pieces of the 2:4 inference benchmarks (linear24.py, inference24.py): model shapes, random models
built on the device, the 2:4 twin of a model, and the run's identity (device and versions)."""

from __future__ import annotations

import copy
import json
import platform
import sys
from pathlib import Path

import torch

# LLaMA-family shapes: hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings, rope theta
SHAPES = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, True, 100000.0),
    "llama-7b": (4096, 11008, 32, 32, 32, 32000, False, 10000.0),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256, False, 500000.0),
    "tiny-llama": (64, 128, 2, 4, 2, 512, True, 10000.0),
}


def linear_shapes(name: str) -> dict[tuple[int, int], str]:
    """Distinct ``(out, in)`` shapes of a LLaMA's block linears -> the layers that have it."""
    hidden, inter, _, heads, kv, _, _, _ = SHAPES[name]
    kv_out = hidden // heads * kv
    shapes: dict[tuple[int, int], list[str]] = {}
    for layer, shape in (("q_proj", (hidden, hidden)), ("k_proj", (kv_out, hidden)), ("v_proj", (kv_out, hidden)),
                         ("o_proj", (hidden, hidden)), ("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                         ("down_proj", (hidden, inter))):
        shapes.setdefault(shape, []).append(layer)
    return {s: ",".join(names) for s, names in shapes.items()}


def random_llama(name: str, device, dtype, layers: int | None = None):
    """A LLaMA of a named shape with random weights, born on ``device`` in ``dtype`` (HF's own init runs
    there: no host copy, seconds for 7B on a GPU)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, inter, n_layers, heads, kv, vocab, tied, theta = SHAPES[name]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or n_layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, rope_theta=theta, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def prune24_(model) -> int:
    """Magnitude 2:4 on every target (the values do not change kernel speed); returns how many."""
    from cast_llm.prune.magnitude import magnitude_prune_
    from cast_llm.targets import find_targets

    targets = find_targets(model, n=2, m=4)
    for t in targets:
        magnitude_prune_(t.weight.t() if t.transposed else t.weight, 2, 4)
    return len(targets)


def twin(model):
    """A second module tree over the SAME tensors (deepcopy's memo maps every parameter and buffer to itself):
    swapping its targets for 2:4 layers leaves ``model`` dense, so both can be timed alternately."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def identity(device: torch.device) -> dict:
    """Where and with what a result was measured."""
    import transformers

    from cast_llm.deploy.sparse24 import cusparselt_direct

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform()}
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        info.update(device=f"{torch.cuda.get_device_name(device)} (sm{cap[0]}{cap[1]})", cuda=torch.version.cuda,
                    cusparselt=torch.backends.cusparselt.version(), cusparselt_loaded=cusparselt_direct.library_version())
    else:
        info.update(device=f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    return info


def write_json(path: str | None, obj: dict) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=str) + "\n")
    print(f"wrote {path}")


def command() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])
