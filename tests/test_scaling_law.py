"""The token scaling law ln ppl = A + B / D^β (method.md §7): fit, inverse, leave-one-out, CLI, sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from cast_llm.cli import main
from cast_llm.errors import CastError
from cast_llm.scaling import (
    CHINCHILLA_BETA,
    fit_token_scaling,
    format_billions,
    format_count,
    parse_budgets,
    plot_token_scaling,
    read_points_csv,
    run_sweep,
)

A, B = 2.9, 0.35  # asymptote exp(2.9) ≈ 18.2
D = np.array([0.005, 0.01, 0.02, 0.04, 0.08])  # 5M … 80M tokens, in billions


def law(d, a=A, b=B, beta=CHINCHILLA_BETA):
    return np.exp(a + b * np.asarray(d) ** (-beta))


def test_exact_recovery():
    fit = fit_token_scaling(D, law(D))
    assert fit.A == pytest.approx(A, abs=1e-10) and fit.B == pytest.approx(B, abs=1e-10)
    assert abs(fit.r2 - 1) < 1e-10 and fit.n_points == 5 and fit.beta == CHINCHILLA_BETA
    assert fit.predict_ppl(0.3) == pytest.approx(float(law(0.3)), rel=1e-12)
    assert isinstance(fit.predict_ppl(0.3), float)
    np.testing.assert_allclose(fit.predict_ppl(D), law(D), rtol=1e-12)
    assert fit.asymptote_ppl == pytest.approx(math.exp(A))


def test_other_beta_exact_recovery():
    fit = fit_token_scaling(D, law(D, beta=0.5), beta=0.5)
    assert (fit.A, fit.B) == pytest.approx((A, B), abs=1e-10)


def test_noisy_points():
    rng = np.random.default_rng(0)
    d = np.geomspace(0.002, 0.2, 12)
    ppl = law(d) * np.exp(rng.normal(0, 0.01, d.size))  # 1 % multiplicative noise
    fit = fit_token_scaling(d, ppl)
    assert 0.95 < fit.r2 < 1
    assert fit.A == pytest.approx(A, abs=0.05) and fit.B == pytest.approx(B, rel=0.1)
    # least squares: no other (A, B) has a smaller residual
    x, y = d**-CHINCHILLA_BETA, np.log(ppl)
    sse = lambda a, b: float(np.sum((y - a - b * x) ** 2))  # noqa: E731
    best = sse(fit.A, fit.B)
    for da, db in [(1e-3, 0), (-1e-3, 0), (0, 1e-3), (0, -1e-3)]:
        assert sse(fit.A + da, fit.B + db) > best


def test_leave_one_out_exact_and_noisy():
    loo = fit_token_scaling(D, law(D)).leave_one_out()
    assert loo.tokens_billions == D.max() and loo.fit.n_points == 4
    assert loo.predicted_ppl == pytest.approx(loo.actual_ppl, rel=1e-10) and abs(loo.relative_error) < 1e-10
    ppl = law(D)
    ppl[-1] *= 1.1  # the largest run came out 10 % worse than the law of the others
    loo = fit_token_scaling(D, ppl).leave_one_out()
    assert loo.relative_error == pytest.approx(1 / 1.1 - 1, rel=1e-9)
    # repeated seeds at the largest budget are held out together; actual = their geometric mean
    d2, p2 = np.append(D, D[-1]), np.append(law(D), law(D[-1]) * 1.21)
    loo = fit_token_scaling(d2, p2).leave_one_out()
    assert loo.fit.n_points == 4 and loo.actual_ppl == pytest.approx(float(law(D[-1])) * 1.1, rel=1e-12)


def test_tokens_to_reach_inverts_predict():
    fit = fit_token_scaling(D, law(D))
    for d in (0.001, 0.03, 7.5, 40.0):
        assert fit.tokens_to_reach(fit.predict_ppl(d)) == pytest.approx(d, rel=1e-9)
    target = 19.0
    d_star = (B / (math.log(target) - A)) ** (1 / CHINCHILLA_BETA)
    assert fit.tokens_to_reach(target) == pytest.approx(d_star, rel=1e-10)
    assert fit.tokens_to_reach(fit.asymptote_ppl) is None  # the asymptote itself is never reached
    assert fit.tokens_to_reach(15.0) is None  # below the asymptote
    rising = fit_token_scaling(D, law(D, b=-0.2))  # ppl grows with tokens: B < 0
    assert rising.B < 0 and rising.tokens_to_reach(30.0) is None


@pytest.mark.parametrize(
    "tokens, ppl, msg",
    [
        ([0.01, 0.02], [30, 29], "at least 3 points"),
        ([0.01, 0.02, 0.04], [30, 29], "same length"),
        ([0.01, 0.0, 0.04], [30, 29, 28], "tokens must be positive"),
        ([0.01, -1, 0.04], [30, 29, 28], "tokens must be positive"),
        ([0.01, 0.02, 0.04], [30, 0, 28], "ppl must be positive"),
        ([0.01, math.nan, 0.04], [30, 29, 28], "NaN"),
        ([0.01, 0.02, 0.04], [30, math.inf, 28], "NaN or infinity"),
        ([0.02, 0.02, 0.02], [30, 29, 28], "2 distinct token budgets"),
    ],
)
def test_refusals(tokens, ppl, msg):
    with pytest.raises(ValueError, match=msg):
        fit_token_scaling(tokens, ppl)


def test_refuses_bad_beta_and_targets():
    with pytest.raises(ValueError, match="beta"):
        fit_token_scaling(D, law(D), beta=0)
    fit = fit_token_scaling(D, law(D))
    with pytest.raises(ValueError):
        fit.tokens_to_reach(-1.0)
    with pytest.raises(ValueError):
        fit.predict_ppl(0.0)
    with pytest.raises(ValueError, match="besides the largest"):
        fit_token_scaling([0.01, 0.01, 0.02], [30, 31, 29]).leave_one_out()


def test_counts_format():
    assert [format_count(n) for n in (20_000_000, 1_500_000, 1_250_000, 2 * 10**9, 12345)] == [
        "20M",
        "1.5M",
        "1250k",
        "2B",
        "12345",
    ]
    assert format_billions(0.02) == "20M" and format_billions(1.5) == "1.5B"
    assert parse_budgets("4M, 1M,2M,2000000") == [1_000_000, 2_000_000, 4_000_000]
    with pytest.raises(CastError, match="at least 3"):
        parse_budgets("1M,2M")


def test_plot(tmp_path):
    fit = fit_token_scaling(D, law(D))
    png = plot_token_scaling(fit, dense_ppl=19.5, path=tmp_path / "sub" / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    plot_token_scaling(fit, (D[:3], law(D[:3])), dense_ppl=10.0, path=tmp_path / "unreachable.png")


# ---------------------------------------------------------------- CLI


def _csv(path: Path, rows, header="tokens,ppl") -> Path:
    path.write_text(header + "\n" + "\n".join(",".join(map(str, r)) for r in rows) + "\n")
    return path


def test_read_csv_units(tmp_path):
    raw = read_points_csv(_csv(tmp_path / "a.csv", [("5M", 30.0), (10_000_000, 29.0), ("2e7", 28.0)]))
    assert [p.tokens_billions for p in raw] == [0.005, 0.01, 0.02]
    bil = read_points_csv(_csv(tmp_path / "b.csv", [(0.005, 30.0)], header="Tokens_Billions,Perplexity,run"))
    assert bil[0].tokens_billions == 0.005 and bil[0].ppl == 30.0
    with pytest.raises(CastError, match="needs a 'ppl' column"):
        read_points_csv(_csv(tmp_path / "c.csv", [(1, 2)], header="steps,loss"))
    with pytest.raises(CastError, match="line 3"):
        read_points_csv(_csv(tmp_path / "d.csv", [("5M", 30), ("lots", 29)]))


def test_cli_fit_csv(tmp_path, capsys):
    rows = [(f"{round(d * 1000)}M", repr(float(p))) for d, p in zip(D, law(D), strict=True)]
    png = tmp_path / "fit.png"
    rc = main(
        ["scaling-law", "fit", str(_csv(tmp_path / "p.csv", rows)), "--dense-ppl", "19", "--plot", str(png)]
    )
    out = capsys.readouterr().out
    assert rc == 0 and png.is_file()
    assert f"A  = {A:.6f}" in out and f"B  = {B:.6f}" in out and "R² = 1.000000" in out
    assert "leave-one-out: without D = 80M, predicted ppl" in out and "(error +0.00%)" in out
    d_star = (B / (math.log(19) - A)) ** (1 / CHINCHILLA_BETA)
    assert f"D* = {d_star:.4g} billion tokens" in out

    rc = main(["scaling-law", "fit", str(tmp_path / "p.csv"), "--dense-ppl", "10", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["fit"]["A"] == pytest.approx(A) and rep["dense_reachable"] is False
    assert rep["leave_one_out"]["relative_error"] == pytest.approx(0, abs=1e-9)


def test_cli_fit_refuses_two_points(tmp_path, capsys):
    rc = main(["scaling-law", "fit", str(_csv(tmp_path / "p.csv", [("1M", 30), ("2M", 29)]))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "at least 3 points" in err and "\n" not in err


def _run(
    folder: Path, tokens: int, wiki: float | None, heldout: float, dense_wiki=19.0, dense_held=12.0
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    res = {
        "tokens_trained": tokens,
        "method": "cast",
        "perplexity": {
            "wikitext2": {"dense": dense_wiki if wiki else None, "sparse": wiki},
            "heldout": {"dense": dense_held, "sparse": heldout},
        },
    }
    (folder / "results.json").write_text(json.dumps(res))
    (folder / "cast_run.json").write_text("{}")
    return folder


def test_cli_fit_run_dirs(tmp_path, capsys):
    runs = [
        _run(tmp_path / f"r{i}", round(d * 1e9), float(law(d)), float(law(d, a=2.4))) for i, d in enumerate(D)
    ]
    assert main(["scaling-law", "fit", *map(str, runs), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["fit"]["A"] == pytest.approx(A) and rep["dense_ppl"] == 19.0  # dense ppl from the runs
    assert main(["scaling-law", "fit", *map(str, runs), "--metric", "heldout", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["fit"]["A"] == pytest.approx(2.4) and rep["dense_ppl"] == 12.0


def test_cli_run_dirs_fall_back_to_heldout(tmp_path, capsys):
    runs = [
        _run(tmp_path / f"r{i}", round(d * 1e9), None if i == 1 else 30.0, float(law(d)))
        for i, d in enumerate(D[:3])
    ]
    assert main(["scaling-law", "fit", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    assert "note: 1 run(s) have no WikiText-2 perplexity" in out and f"A  = {A:.6f}" in out
    rc = main(
        ["scaling-law", "fit", *map(str, runs), "--metric", "wikitext2"]
    )  # asked for explicitly: no fallback
    assert rc == 2 and "has no 'wikitext2' sparse perplexity" in capsys.readouterr().err


def test_cli_unfinished_run_dir(tmp_path, capsys):
    unfinished = tmp_path / "r"
    unfinished.mkdir()
    (unfinished / "results.json").write_text(json.dumps({"perplexity": {"heldout": {"dense": 12.0}}}))
    assert main(["scaling-law", "fit", str(unfinished)]) == 2
    assert "has not finished" in capsys.readouterr().err
    assert main(["scaling-law", "fit", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv does not exist" in capsys.readouterr().err


class FakeTrainer:
    """Stands in for `cast-llm train`: records the command, writes results.json as a finished run would."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def __call__(self, cmd: list[str]) -> int:
        self.calls.append(cmd)
        tokens = int(cmd[cmd.index("--tokens") + 1])
        if tokens == self.fail_at:
            return 1
        d = tokens / 1e9
        _run(Path(cmd[cmd.index("--output-dir") + 1]), tokens, float(law(d)), float(law(d, a=2.4)))
        return 0


def test_sweep_orchestration(tmp_path, capsys):
    out = tmp_path / "sweep"
    _run(out / "tokens-10M", 10_000_000, float(law(0.01)), 20.0)  # finished before: must be skipped
    fake = FakeTrainer()
    budgets = [5_000_000, 10_000_000, 20_000_000, 40_000_000]
    runs = run_sweep(budgets, out, ["--preset", "smollm2-cpu"], runner=fake, log=lambda s: None)
    assert [r.name for r in runs] == ["tokens-5M", "tokens-10M", "tokens-20M", "tokens-40M"]
    assert [c[c.index("--tokens") + 1] for c in fake.calls] == ["5000000", "20000000", "40000000"]
    cmd = fake.calls[0]
    assert cmd[1:4] == ["-m", "cast_llm.cli", "train"] and cmd[4:6] == ["--preset", "smollm2-cpu"]
    assert cmd[cmd.index("--output-dir") + 1] == str(out / "tokens-5M")
    with pytest.raises(CastError, match="sets --tokens"):
        run_sweep(budgets, out, ["--tokens=3M"], runner=fake)


def test_sweep_resumes_or_restarts_unfinished(tmp_path):
    out = tmp_path / "sweep"
    half = out / "tokens-2M"
    (half / "checkpoints" / "step-00000010").mkdir(parents=True)
    (half / "checkpoints" / "step-00000010" / "meta.json").write_text("{}")  # a complete checkpoint
    (half / "cast_run.json").write_text("{}")
    fresh = out / "tokens-4M"
    fresh.mkdir(parents=True)
    (fresh / "cast_run.json").write_text("{}")
    fake = FakeTrainer()
    run_sweep([1_000_000, 2_000_000, 4_000_000], out, [], runner=fake, log=lambda s: None)
    assert [c[-1] for c in fake.calls] == [str(out / "tokens-1M"), "--resume", "--overwrite"]
    (out / "tokens-8M").mkdir()
    (out / "tokens-8M" / "notes.txt").write_text("mine")
    with pytest.raises(CastError, match="not a cast-llm run"):
        run_sweep([1_000_000, 2_000_000, 8_000_000], out, [], runner=fake, log=lambda s: None)


def test_sweep_command_end_to_end(tmp_path, capsys, monkeypatch):
    import cast_llm.scaling.budget_sweep as scaling_law

    out = tmp_path / "sweep"
    fake = FakeTrainer(fail_at=4_000_000)
    monkeypatch.setattr(scaling_law, "run_command", fake)
    argv = ["scaling-law", "sweep", "--budgets", "1M,2M,4M", "--output-dir", str(out), "--", "--preset", "x"]
    assert main(argv) == 2  # the 4M run fails: one line, what to do
    assert "training for 4M tokens failed (exit code 1)" in capsys.readouterr().err
    fake.fail_at = None
    assert main(argv) == 0  # again: 1M and 2M skipped, 4M trained, then the fit
    assert [c[c.index("--tokens") + 1] for c in fake.calls] == ["1000000", "2000000", "4000000", "4000000"]
    printed = capsys.readouterr().out
    assert f"A  = {A:.6f}" in printed and "D* = " in printed  # dense ppl 19.0 from the runs
    points = read_points_csv(out / "points.csv")
    assert [p.tokens_billions for p in points] == [0.001, 0.002, 0.004]
    assert (out / "scaling.png").is_file() and json.loads((out / "scaling.json").read_text())["fit"][
        "n_points"
    ] == 3


def test_sweep_keeps_files_it_did_not_write_and_follows_no_link(tmp_path, capsys, monkeypatch):
    """The fit writes points.csv / scaling.json / scaling.png: a user's file of that name in --output-dir, or a
    link planted there, is refused in one line before any training; the sweep's own files (listed in its
    marker) are replaced on a second sweep."""
    import cast_llm.scaling.budget_sweep as scaling_law

    out = tmp_path / "sweep"
    out.mkdir()
    mine = out / "points.csv"
    mine.write_text("my own data\n")
    fake = FakeTrainer()
    monkeypatch.setattr(scaling_law, "run_command", fake)
    argv = ["scaling-law", "sweep", "--budgets", "1M,2M,4M", "--output-dir", str(out), "--", "--preset", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "points.csv" in err and "did not write" in err and len(err.strip().splitlines()) == 1
    assert fake.calls == [] and mine.read_text() == "my own data\n"  # nothing trained, nothing touched
    mine.unlink()
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    (out / "scaling.json").symlink_to(victim)
    assert main(argv) == 2 and "scaling.json" in capsys.readouterr().err and victim.read_text() == "keep"
    (out / "scaling.json").unlink()
    assert main(argv) == 0  # the sweep's own files from now on
    assert json.loads((out / scaling_law.SWEEP_MARKER).read_text())["files"] == list(scaling_law.SWEEP_FILES)
    assert main(argv) == 0  # and replaced by the next sweep
    assert victim.read_text() == "keep"


def test_sweep_dry_run(tmp_path, capsys, monkeypatch):
    import cast_llm.scaling.budget_sweep as scaling_law

    monkeypatch.setattr(scaling_law, "run_command", lambda cmd: pytest.fail("dry run must not train"))
    assert main(["scaling-law", "sweep", "--budgets", "1M,2M,4M", "--output-dir", str(tmp_path), "--dry-run"]) == 0
    assert capsys.readouterr().out.count(" train ") == 3
