"""The torch.compile candidates (inductor's C++ on this CPU) against their float64 references: the AdamS update
(optim/compiled_adams.py) and the KD loss (distill/paths.py). Each kind compiles once per test process (seconds);
the suite leaves these candidates out everywhere else (CAST_LLM_COMPILE=0, tests/conftest.py)."""

from __future__ import annotations

import torch

from cast_llm import distill, kernels
from cast_llm.optim import functional
from cast_llm.optim.adams import AdamS

CPU = torch.device("cpu")


def test_compiled_adams_update_matches_float64_in_both_mask_storages_and_skips_on_a_flag(monkeypatch):
    monkeypatch.setenv("CAST_LLM_COMPILE", "1")
    path = kernels.REGISTRY["adams.update"]
    impl = kernels.implementation("adams.update", "compiled")
    for packed, mode, maximize, wd in ((False, "proportional", False, 0.0), (True, "additive", True, 0.1)):
        variant = functional.update_variant(torch.zeros(1), torch.zeros(1), packed, mode, maximize, wd)
        check = path.probe(impl, CPU, variant)
        assert check.ok, (variant, check)
    # found_inf: nothing moves, the counts neither
    p, g = torch.randn(64, 32), torch.randn(64, 32)
    mu, v, mask, step = torch.zeros(64, 32), torch.zeros(64, 32), torch.rand(64, 32) > 0.5, torch.zeros(())
    before = [x.clone() for x in (p, mu, v, step)]
    impl([p], [g], [mu], [v], [mask], [step], beta1=0.9, beta2=0.99, lr=1e-2, eps=1e-8, l1_decay=0.1,
         total_steps=5, weight_decay=0.0, maximize=False, found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip((p, mu, v, step), before))


def test_adams_takes_the_fastest_checked_candidate_and_matches_the_reference(monkeypatch):
    monkeypatch.setenv("CAST_LLM_COMPILE", "1")

    def run():
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(32, 64, generator=gen))
        opt = AdamS([{"params": [w], "sparse": True}], lr=1e-2, l1_decay=0.1, total_steps=6, mask_interval=2)
        for _ in range(4):
            w.grad = torch.randn(w.shape, generator=gen)
            opt.step()
        return w.detach()

    got = run()
    took = kernels.taken()["paths"]["adams.update"][0]["took"]
    assert took in ("compiled", "blockwise")  # both passed; the faster one at the timing size runs
    kernels.reset()
    monkeypatch.setenv("CAST_LLM_KERNELS", "reference")
    torch.testing.assert_close(got, run(), rtol=1e-5, atol=1e-6)


def test_compiled_kd_loss_matches_float64(monkeypatch):
    monkeypatch.setenv("CAST_LLM_COMPILE", "1")
    path = distill.KD_LOSS
    impl = kernels.implementation("kd.loss", "compiled")
    check = path.probe(impl, CPU, (torch.float32, torch.float32, "T = 1", "gradient"))
    assert check.ok, check
