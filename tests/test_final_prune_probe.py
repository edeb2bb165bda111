"""The final prune's cost, measured: every CAST run records the validation perplexity of its dense-forward model
just before the final prune and of the pruned model just after it (``decay.final_prune`` in results.json)."""

from __future__ import annotations

import json

import pytest
import tiny

from cast_llm.cli import main


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prune-probe")
    tiny.save_model(d / "llama", "llama")
    tiny.write_corpus(d / "corpus.jsonl")
    (d / "eval.txt").write_text(" ".join([tiny.CORPUS] * 10))
    return d


def _train(workdir, out, *extra) -> dict:
    assert main(["train", "--model", str(workdir / "llama"), "--data", str(workdir / "corpus.jsonl"), "--output-dir",
                 str(out), "--wikitext-file", str(workdir / "eval.txt"), "--max-steps", "12", "--batch-size", "2",
                 "--seq-len", "32", "--log-every", "4", "--val-sequences", "2", "--test-sequences", "2",
                 "--wikitext-windows", "1", "--no-progress", "--no-report", "--mask-interval", "4",
                 "--no-baseline-eval", "--lr", "1e-3", *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_paper_exact_records_validation_before_and_after_its_final_prune(workdir, tmp_path):
    res = _train(workdir, tmp_path / "run", "--paper-exact", "--l1-decay", "1e-4")
    fp = res["decay"]["final_prune"]
    before, after = fp["validation_ppl_before"], fp["validation_ppl_after"]
    assert before is not None and after is not None and before > 1 and after > 1
    assert fp["step"] == 12 and fp["sparse_weight_ratio"] < 1  # the decay has not finished: the cut costs
    assert before != after
    # no repair: the pruned model is the exported one (the scales folded in), so its validation figure is the run's
    assert after == pytest.approx(res["perplexity"]["validation"]["sparse"], rel=1e-4)


def test_a_masked_repair_records_them_where_it_prunes(workdir, tmp_path):
    res = _train(workdir, tmp_path / "run", "--warm-start", "--init-mask", "magnitude", "--repair-fraction", "0.25",
                 "--final-prune", "hard")
    fp = res["decay"]["final_prune"]
    assert fp["step"] == 9  # the repair's first step: the prune happens there, the last quarter trains the pruned model
    assert fp["validation_ppl_before"] is not None and fp["validation_ppl_after"] is not None


def test_measuring_the_prune_changes_nothing_about_the_run(workdir, tmp_path, monkeypatch):
    """The two validation passes at a mid-run prune (the repair's start) leave the training as it was: the same
    final model to the last bit as a run that does not measure them."""
    from cast_llm.train.trainer import PretrainJob

    extra = ("--warm-start", "--init-mask", "magnitude", "--repair-fraction", "0.25", "--final-prune", "hard")
    measured = _train(workdir, tmp_path / "a", *extra)
    monkeypatch.setattr(PretrainJob, "_prune_probe", lambda self, ctx, model, label: None)
    plain = _train(workdir, tmp_path / "b", *extra)
    assert plain["decay"]["final_prune"]["validation_ppl_before"] is None
    assert measured["decay"]["final_prune"]["validation_ppl_before"] is not None
    for split in ("heldout", "validation", "wikitext2"):
        assert measured["perplexity"][split]["sparse"] == plain["perplexity"][split]["sparse"], split
