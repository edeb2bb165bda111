"""Perplexity window by window: a score records each window's mean NLL, so the figure on any first n windows
(what a table scored on n windows reports) follows without the model — checked against scoring n windows, and
against a float64 reference computed here."""

from __future__ import annotations

import math

import pytest
import tiny
import torch

from cast_llm.eval.ppl import perplexity, perplexity_of_windows


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_first_windows_figure_is_the_figure_of_scoring_those_windows(batch_size):
    torch.manual_seed(0)
    model = tiny.model("llama").eval()
    ids = torch.randint(0, model.config.vocab_size, (7 * 16 + 5,))
    res = perplexity(model, ids, 16, batch_size=batch_size)
    assert res.windows == len(res.window_nll) == 7
    assert res.first(7) == pytest.approx(res.perplexity, rel=1e-12)
    for n in (1, 2, 5):
        assert res.first(n) == pytest.approx(perplexity(model, ids, 16, max_windows=n).perplexity, rel=1e-12)
    # float64 reference: the model in float64, every token's NLL by hand
    ref = tiny.model("llama").eval()
    ref.load_state_dict(model.state_dict())
    ref.double()
    with torch.no_grad():
        w = ids[: 7 * 16].view(7, 16)
        logp = torch.log_softmax(ref(input_ids=w, use_cache=False).logits[:, :-1], dim=-1)
        per = -logp.gather(-1, w[:, 1:, None]).squeeze(-1).mean(dim=1)
    assert list(res.window_nll) == pytest.approx(per.tolist(), rel=1e-5)
    assert res.first(3) == pytest.approx(math.exp(per[:3].mean().item()), rel=1e-5)


def test_the_record_stays_out_of_the_metadata_and_a_wrong_count_is_refused():
    model = tiny.model("llama").eval()
    res = perplexity(model, torch.randint(0, model.config.vocab_size, (64,)), 16)
    assert "window_nll" not in res.to_dict() and res.to_dict()["windows"] == 4
    with pytest.raises(ValueError, match="the first 5 windows: 4 were scored"):
        perplexity_of_windows(res.window_nll, 5)
    with pytest.raises(ValueError):
        perplexity_of_windows(res.window_nll, 0)
