"""Greedy decoding with the whole decoder step in one CUDA graph, for any Hugging Face causal LM.

Eager decoding of a 7B model is host-bound (hundreds of small kernel launches per token: ~30 ms per step on
the H100 of docs/results/gpu for ~5 ms of GPU work), which hides what 2:4 weights save. Capturing the decode
step removes the host: every replay launches the recorded kernels only.

:class:`StaticDecoder` runs the model with a ``transformers.StaticCache`` (fixed tensors, written in place),
and passes everything that changes per step as a **static buffer** updated in place before each replay: the
token ids ``(B, 1)``, ``position_ids``, ``cache_position`` (where the model takes it) and a ready-made 4-D
attention mask ``(B, 1, 1, max_len)`` — so no mask logic of the library (which differs between versions and
reads tensors on the host) runs inside the graph. Step 0 runs eagerly (it also triggers lazy setup: cuBLAS
workspaces, cuSPARSELt plans); step 1 is captured and replayed; later steps only replay.

Runners (``runner=``): ``"manual"`` — ``torch.cuda.CUDAGraph`` capture on a side stream; ``"compile"`` —
``torch.compile(mode="reduce-overhead")`` of the same step function (cudagraph trees; 2:4 layers are one
opaque custom op each); ``"eager"`` — no graph, the same code path (CPU tests, and the reference the graphed
runs are checked against).

The graphed runners are the in-situ checked kernel path ``sparse24.decode_graph`` (:mod:`cast_llm.kernels`):
the first replay's logits are compared with the same step run eagerly (it rewrites the same cache slot with
the same values), and a capture that raises or a mismatch above 1 % of the largest logit switches the decoder
to the eager runner for the rest of its prompt (said once, the verdict kept for this GPU, driver, library
versions, model class and dtype: later decoders there run eagerly at once); ``CAST_LLM_KERNELS=reference``
never captures.
"""

from __future__ import annotations

import importlib.metadata
import inspect

import torch

from cast_llm import kernels

__all__ = ["StaticDecoder", "make_static_cache", "DECODE_GRAPH", "MATCH_REL"]

MATCH_REL = 1e-2  # max |replay − eager| / max |eager|: bf16 noise passes, a stale or garbage buffer does not


def make_static_cache(model, max_len: int, batch_size: int):
    """A ``StaticCache`` for ``model``, built with whichever constructor arguments this transformers takes."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": max_len}
    p = next(model.parameters())
    for name, value in (("max_batch_size", batch_size), ("batch_size", batch_size), ("device", p.device),
                        ("dtype", p.dtype)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


class EagerRunner:
    """The graph runners' interface without a graph: ``replay`` calls the step function again."""

    name = "eager"

    def warmup(self, fn):
        return fn()

    def capture(self, fn) -> None:
        self.fn = fn

    def replay(self):
        return self.fn()


class CudaGraphRunner:
    """Manual capture with ``torch.cuda.CUDAGraph`` (warm-up and capture on one side stream)."""

    name = "manual"

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.graph = None

    def warmup(self, fn):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def capture(self, fn) -> None:
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.out = fn()

    def replay(self):
        self.graph.replay()
        return self.out


class CompiledRunner:
    """``torch.compile(mode="reduce-overhead")`` of the step: torch's cudagraph trees capture and replay."""

    name = "compile"

    def warmup(self, fn):
        return fn()

    def capture(self, fn) -> None:
        self.fn = torch.compile(fn, mode="reduce-overhead", dynamic=False)

    def replay(self):
        torch.compiler.cudagraph_mark_step_begin()
        return self.fn()


def _runner(runner, device: torch.device):
    if not isinstance(runner, str):
        return runner
    if runner == "manual":
        return CudaGraphRunner(device)
    if runner == "compile":
        return CompiledRunner()
    if runner == "eager":
        return EagerRunner()
    raise ValueError(f"runner must be 'manual', 'compile' or 'eager', got {runner!r}")


class StaticDecoder:
    """Prefill eagerly, then decode one token per step with the step captured once (see module docstring).

    Single use: one prompt per instance (the captured graph points at this instance's cache and buffers).
    """

    def __init__(self, model, *, batch_size: int, max_len: int, runner="manual"):
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # a multiple of 16 keys keeps the attention mask's rows aligned for the fused SDPA kernels
        self.batch_size, self.max_len = batch_size, -(-max_len // 16) * 16
        self.runner = _runner(runner, self.device)
        self.cache = make_static_cache(model, self.max_len, batch_size)
        names = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in names else "past_key_values"
        self.takes_cache_position = "cache_position" in names
        self.takes_logits_to_keep = "logits_to_keep" in names
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.bool_mask = impl != "eager"  # sdpa / flash / flex take a bool mask; eager adds a float one
        dev = self.device
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)
        self.position_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=dev)
        self.mask = self._mask_like(torch.zeros(batch_size, 1, 1, self.max_len, dtype=torch.bool, device=dev))
        self.length = 0
        self.steps = 0

    def _mask_like(self, keep: torch.Tensor) -> torch.Tensor:
        if self.bool_mask:
            return keep
        return torch.zeros(keep.shape, dtype=self.dtype, device=keep.device).masked_fill_(
            ~keep, torch.finfo(self.dtype).min)

    def _call(self, ids, position_ids, cache_position, mask):
        kwargs = {"input_ids": ids, "position_ids": position_ids, "attention_mask": mask, "use_cache": True,
                  self.cache_kw: self.cache}
        if self.takes_cache_position:
            kwargs["cache_position"] = cache_position
        if self.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1, :]

    def _step_fn(self):
        return self._call(self.ids, self.position_ids, self.cache_position, self.mask)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``(B, P)`` eagerly into the cache; the logits of its last position ``(B, V)``."""
        if self.length:
            raise RuntimeError("a StaticDecoder decodes one prompt; make a new one")
        b, p = input_ids.shape
        if b != self.batch_size or p >= self.max_len:
            raise ValueError(f"prompt {tuple(input_ids.shape)} does not fit batch {self.batch_size}, max_len "
                             f"{self.max_len}")
        dev = self.device
        q, k = torch.arange(p, device=dev), torch.arange(self.max_len, device=dev)
        keep = (k[None, :] <= q[:, None]).expand(b, 1, p, self.max_len)  # causal, future slots masked
        positions = torch.arange(p, device=dev).expand(b, p)
        logits = self._call(input_ids, positions, torch.arange(p, device=dev), self._mask_like(keep))
        self.mask.copy_(self._mask_like((k < p).expand(b, 1, 1, self.max_len)))
        self.length = p
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence ``(B,)`` at the next position; its logits ``(B, V)`` — a static buffer
        for graphed runners, valid until the next step."""
        if not self.length:
            raise RuntimeError("call prefill() first")
        if self.length >= self.max_len:
            raise RuntimeError(f"the static cache holds {self.max_len} positions; all are used")
        pos = self.length
        self.ids.copy_(tokens.view(-1, 1))
        self.position_ids.fill_(pos)
        self.cache_position.fill_(pos)
        self.mask[..., pos] = True if self.bool_mask else 0.0
        if self.steps == 0:
            logits = self.runner.warmup(self._step_fn)
        elif self.steps == 1:
            logits = self._capture_checked()
        else:
            logits = self.runner.replay()
        self.length += 1
        self.steps += 1
        return logits

    def _variant(self) -> tuple:
        try:
            transformers = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            transformers = None
        return (type(self.model).__name__, f"transformers {transformers}", self.dtype, self.runner.name)

    def _capture_checked(self):
        """Step 1: capture, replay, and check the replay against the same step run eagerly (see the module
        docstring); on any failure the decoder goes on with the eager runner."""
        if self.runner.name == "eager":
            self.runner.capture(self._step_fn)
            return self.runner.replay()
        variant = self._variant()
        if kernels.choose(DECODE_GRAPH.name, self.device, variant, only=(self.runner.name,)) == kernels.REFERENCE:
            self.runner = EagerRunner()
            return self._capture_checked()
        try:
            self.runner.capture(self._step_fn)
            got = self.runner.replay()
            want = self._step_fn()
            err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
            check = kernels.Check(err, MATCH_REL)
            if not check.ok:
                raise RuntimeError(f"the graph's logits differ from eager ones: max |Δ| = {err:.3g} of max |logit|")
        except Exception as e:  # noqa: BLE001 - a graph is an optimisation: the eager step is the same numbers
            kernels.record(DECODE_GRAPH.name, self.device, variant, self.runner.name, e)
            self.runner = EagerRunner()
            self.runner.capture(self._step_fn)
            return self.runner.replay()
        kernels.record(DECODE_GRAPH.name, self.device, variant, self.runner.name, None, check)
        return got

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation ``(B, new_tokens)`` of ``input_ids``."""
        tok = self.prefill(input_ids).argmax(-1)
        out = [tok]
        for _ in range(new_tokens - 1):
            tok = self.step(tok).argmax(-1)
            out.append(tok)
        return torch.stack(out, dim=1)


def _probe(impl, device: torch.device, variant: tuple) -> kernels.Check:
    """``cast-llm doctor``'s check: a tiny random LLaMA decoding 4 tokens with the runner ``impl`` against the
    eager runner, in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (1, 8), device=device)
    outs = []
    for runner in (impl(device) if impl is CudaGraphRunner else impl(), EagerRunner()):
        dec = StaticDecoder(model, batch_size=1, max_len=16, runner=runner)
        dec.prefill(ids)
        tok = torch.zeros(1, dtype=torch.long, device=device)
        outs.append(torch.stack([dec.step(tok).float().clone() for _ in range(4)]))
    got, want = outs
    return kernels.Check(float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)), MATCH_REL)


def _cuda_only(device: torch.device) -> str | None:
    return None if device.type == "cuda" else "CUDA graphs capture CUDA work only"


DECODE_GRAPH = kernels.register(kernels.CheckedPath(
    name="sparse24.decode_graph",
    what="the decoder step replayed as one CUDA graph (deploy/sparse24/decode.py)",
    reference="the same step run eagerly",
    measure="max |Δ logit| / max |logit|",
    candidates=(kernels.Candidate("manual", lambda: CudaGraphRunner, _cuda_only),
                kernels.Candidate("compile", lambda: CompiledRunner, _cuda_only, compiles=True)),
    probe=_probe, in_situ=True,
    variants=lambda device: [("LlamaForCausalLM", "tiny random", torch.bfloat16)],
))
