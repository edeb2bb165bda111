"""Zero-shot evaluation through lm-eval (method.md §7) on a local task and a tiny random LLaMA.

The reference is a direct computation in this file: the log-likelihood of a choice is the sum of the
log-probabilities of the tokens of " <choice>" after the prompt, where those tokens are the tail of
``encode(prompt + " " + choice)`` beyond ``encode(prompt)``; acc takes the argmax, acc_norm the argmax of
the log-likelihood divided by ``len(choice)`` (characters, as lm-eval 0.4.13 does; ``acc_bytes`` would use
UTF-8 bytes).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from cast_llm.cli import main
from cast_llm.errors import CastError

DATA = Path(__file__).parent / "data" / "zeroshot"
ITEMS = [json.loads(line) for line in (DATA / "cast_mc.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained in milliseconds on the task's own text (no download, no cached model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"Question: {d['question']}\nAnswer: " + " ".join(d["choices"]) for d in ITEMS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    # float64 so that the harness's batched forward and ours agree to ~1e-12 and argmax never flips on a tie
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@torch.no_grad()
def direct_loglikelihoods(model, tokenizer, prompt: str, choices: list[str]) -> list[float]:
    ctx = tokenizer.encode(prompt)
    out = []
    for choice in choices:
        whole = tokenizer.encode(prompt + " " + choice)
        assert whole[: len(ctx)] == ctx
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0], dim=-1)
        out.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
    return out


def direct_scores(model, tokenizer, items=ITEMS):
    acc, acc_norm, lls = [], [], []
    for d in items:
        ll = direct_loglikelihoods(model, tokenizer, f"Question: {d['question']}\nAnswer:", d["choices"])
        lls.append(ll)
        acc.append(float(max(range(len(ll)), key=ll.__getitem__) == d["label"]))
        norm = [v / len(c) for v, c in zip(ll, d["choices"], strict=True)]
        acc_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == d["label"]))
    return sum(acc) / len(acc), sum(acc_norm) / len(acc_norm), lls


def test_matches_direct_loglikelihood(model, tokenizer):
    from cast_llm.eval.zeroshot import evaluate_zeroshot

    model.train()  # evaluate_zeroshot must score in eval mode and give the mode back
    res = evaluate_zeroshot(model, tokenizer, ["cast_mc"], include_path=DATA, batch_size=4, log_samples=True)
    assert model.training
    model.eval()
    acc, acc_norm, lls = direct_scores(model, tokenizer)
    (row,) = res.tasks
    assert row.task == "cast_mc" and row.n_samples == len(ITEMS) and row.num_fewshot == 0
    assert row.acc == pytest.approx(acc, abs=1e-12)
    assert row.acc_norm == pytest.approx(acc_norm, abs=1e-12)
    assert acc != acc_norm  # the item set is chosen so that the two metrics differ on this model
    n = len(ITEMS)  # lm-eval's stderr of a mean of 0/1 values: sample std / sqrt(n)
    assert row.acc_stderr == pytest.approx((acc * (1 - acc) * n / (n - 1) / n) ** 0.5, rel=1e-9)
    got = {s["doc_id"]: s["loglikelihoods"] for s in res.samples["cast_mc"]}
    for i, ll in enumerate(lls):
        assert got[i] == pytest.approx(ll, abs=1e-9)
    assert res.average == {"acc": row.acc, "acc_norm": row.acc_norm, "n_tasks": 1}


def test_limit_and_fewshot(model, tokenizer):
    from cast_llm.eval.zeroshot import evaluate_zeroshot

    res = evaluate_zeroshot(model, tokenizer, "cast_mc", include_path=DATA, limit=5, num_fewshot=2)
    (row,) = res.tasks
    assert row.n_samples == 5 and row.num_fewshot == 2 and res.limit == 5


def test_markdown_and_json(model, tokenizer, tmp_path):
    from cast_llm.eval.zeroshot import evaluate_zeroshot

    res = evaluate_zeroshot(model, tokenizer, ["cast_mc"], include_path=DATA, model_name="tiny")
    md = res.write_markdown(tmp_path / "z.md").read_text()
    assert "| cast_mc | 12 | 0 |" in md and "**average**" in md and "tiny" in md
    data = json.loads(res.write_json(tmp_path / "z.json").read_text())
    assert data["tasks"][0]["acc"] == res.tasks[0].acc and "samples" not in data


def _offline_task(tmp_path: Path) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "offline_mc.yaml").write_text(
        (DATA / "cast_mc.yaml")
        .read_text()
        .replace("task: cast_mc", "task: offline_mc")
        .replace(
            "custom_dataset: !function cast_mc_data.load", "dataset_path: cast-llm-tests/no-such-dataset"
        )
    )
    return folder


def test_undownloadable_task_is_one_line_cast_error(tmp_path, monkeypatch):
    from cast_llm.eval.zeroshot import load_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(CastError) as e:
        load_tasks(["offline_mc"], _offline_task(tmp_path))
    msg = str(e.value)
    assert "offline_mc" in msg and "could not be downloaded" in msg and "\n" not in msg


def test_cli_end_to_end(model, tokenizer, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    copy.deepcopy(model).to(torch.float32).save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    out = tmp_path / "out"
    rc = main(
        [
            "eval",
            "zeroshot",
            "--model",
            str(ckpt),
            "--tasks",
            "cast_mc",
            "--include-path",
            str(DATA),
            "--output-dir",
            str(out),
            "--device",
            "cpu",
            "--batch-size",
            "3",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| cast_mc | 12 | 0 |" in printed and "zeroshot.json" in printed
    data = json.loads((out / "zeroshot.json").read_text())
    assert (out / "zeroshot.md").read_text().startswith("# Zero-/few-shot accuracy")
    # the float32 checkpoint scores what the float64 model scores, up to argmax ties that random weights
    # make vanishingly unlikely on 12 items
    acc, acc_norm, _ = direct_scores(model, tokenizer)
    assert data["tasks"][0]["acc"] == pytest.approx(acc) and data["tasks"][0]["acc_norm"] == pytest.approx(
        acc_norm
    )

    rc = main(
        [
            "eval",
            "zeroshot",
            "--model",
            str(ckpt),
            "--tasks",
            "cast_mc",
            "--include-path",
            str(DATA),
            "--output-dir",
            str(out),
            "--device",
            "cpu",
            "--limit",
            "4",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0 and json.loads(captured.out)["tasks"][0]["n_samples"] == 4
    assert "wrote" in captured.err


def test_cli_offline_task_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rc = main(
        [
            "eval",
            "zeroshot",
            "--model",
            str(tmp_path / "never-loaded"),
            "--tasks",
            "offline_mc",
            "--include-path",
            str(_offline_task(tmp_path)),
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("cast-llm eval: error: task 'offline_mc'") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_without_model_the_embedded_model_is_the_default():
    import argparse

    from cast_llm.cli.eval_zeroshot import ZeroShotOptions
    from cast_llm.cli.options import resolve_options
    from cast_llm.config import ModelSettings

    # the one --model of every command that loads a model (cast_llm.config.ModelSettings), with its default
    assert resolve_options(ZeroShotOptions, argparse.Namespace()).model == ModelSettings().model == "smollm2-135m"


def test_eval_without_subcommand_prints_help(capsys):
    assert main(["eval"]) == 2
    assert "zeroshot" in capsys.readouterr().out


@pytest.mark.slow  # indexes lm-eval's ~15k built-in task configs (~10 s)
def test_unknown_task_is_one_line_error(capsys, tmp_path):
    rc = main(["eval", "zeroshot", "--model", str(tmp_path), "--tasks", "no_such_task_xyz"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "unknown lm-eval task 'no_such_task_xyz'" in err and "\n" not in err


def test_cli_default_tasks_are_the_papers_suite():
    from cast_llm.cli.eval_zeroshot import ZeroShotOptions
    from cast_llm.eval.zeroshot import DEFAULT_TASKS

    assert ZeroShotOptions().tasks == ",".join(DEFAULT_TASKS)


def test_a_typo_is_refused_before_the_scan_once_an_earlier_scan_remembered_the_names(monkeypatch, tmp_path):
    """lm-eval's index takes 11-20 s to build; its names are kept per lm-eval version in cast-llm's cache, so a
    mistyped task is refused at once. A file there that cast-llm did not write is neither read nor overwritten, a
    link is not followed."""
    import lm_eval.tasks

    from cast_llm.errors import CastError
    from cast_llm.eval import zeroshot as z

    monkeypatch.setenv("CAST_LLM_CACHE", str(tmp_path / "cache"))

    class Index:  # lm-eval's TaskManager, as far as _task_manager reads it
        all_tasks, built = ["arc_easy", "mmlu", "piqa"], 0

        def __init__(self, *args, **kwargs):
            Index.built += 1

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Index)
    assert z.cached_task_names() is None
    assert isinstance(z._task_manager(["piqa"], None), Index) and Index.built == 1
    assert z.cached_task_names() == {"arc_easy", "mmlu", "piqa"}
    with pytest.raises(CastError, match="unknown lm-eval task 'piqaa'"):
        z._task_manager(["piqa", "piqaa"], None)
    assert Index.built == 1  # refused without a scan
    path = z._task_names_path()
    written = path.stat().st_mtime_ns
    z._task_manager(["piqa"], None)  # the same names scanned again: the file is not rewritten
    assert Index.built == 2 and path.stat().st_mtime_ns == written
    path.write_text(json.dumps({"names": []}))  # not ours
    assert z.cached_task_names() is None
    z._task_manager(["piqa"], None)
    assert json.loads(path.read_text()) == {"names": []}
    path.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text("kept")
    path.symlink_to(target)
    z._task_manager(["piqa"], None)
    assert path.is_symlink() and target.read_text() == "kept" and z.cached_task_names() is None
