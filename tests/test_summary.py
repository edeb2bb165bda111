"""The end-of-run words (cast_llm.train.summary): the options line and whether the masks moved."""

from __future__ import annotations

import json

from cast_llm.train.summary import mask_movement, movement_line, reading, summary_table


def _results(**masks):
    ppl = {"dense": 20.0, "oneshot": 80.0, "sparse": 30.0}
    return {"perplexity": {"heldout": dict(ppl), "wikitext2": dict(ppl)}, "pattern": "2:4",
            "oneshot_method": "sparsegpt", "method": "cast", "masks": masks, "output_dir": "out",
            "tokens_trained": 1000, "options": "CAST (AdamS, …)"}


def test_a_mask_that_did_not_move_is_called_what_it_is():
    line = movement_line(_results(initial_flip_rate=7e-6, changed_groups=1.4e-5, flipped_fraction=0.0))
    assert line.startswith("masks: 0.0007 % of the mask entries differ from the first mask, 0.001 % of the 2:4 "
                           "groups changed, 0.00 % of the tracked weights flipped at least once")
    assert "the mask stayed SparseGPT's" in line and "not the mask" in line


def test_a_learned_mask_is_reported_with_its_rates():
    line = movement_line(_results(initial_flip_rate=0.05, changed_groups=0.09, flipped_fraction=0.1))
    assert "5.0000 % of the mask entries" in line and "9.000 % of the 2:4 groups" in line
    assert line.endswith("the mask was learned during training")
    table = summary_table(_results(initial_flip_rate=0.05, changed_groups=0.09, flipped_fraction=0.1))
    assert "\noptions: CAST (AdamS, …)\nmasks: " in table
    assert movement_line(_results()) is None  # a run that logged nothing says nothing


def test_mask_movement_reads_the_runs_own_records(tmp_path):
    recs = [{"step": 10, "flip_rate": 0.01, "initial_flip_rate": 0.01, "changed_groups": 0.02},
            {"step": 20, "flip_rate": 0.03, "initial_flip_rate": 0.02, "changed_groups": 0.03}, {"step": 21}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "dynamics.json").write_text(json.dumps({"weight_tracking": {"flipped_fraction": 0.25}}))
    assert mask_movement(tmp_path) == {"initial_flip_rate": 0.02, "changed_groups": 0.03, "flip_rate_mean": 0.02,
                                       "flipped_fraction": 0.25}
    assert mask_movement(tmp_path / "none") == {"initial_flip_rate": None, "changed_groups": None,
                                                "flip_rate_mean": None, "flipped_fraction": None}


def test_reading_without_reference_points_still_reads():
    res = {"perplexity": {"heldout": {"sparse": 30.0}, "wikitext2": {"sparse": 70.0}},
           "decay": {"final_prune": {"removed_fraction": 0.058, "sparse_weight_ratio": 0.942}}}
    assert reading(res) == ("reading: the decay had not finished (S_t 0.942): a longer run, or the short-budget "
                            "options, would lose less at the final prune")
    res["decay"] = {}
    assert reading(res) is None
