"""Each setting is declared once (issue 51 item 2): a field that two commands' configs share comes from one option
group both derive from, never from two declarations that can drift apart (the token cache's key did)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import re

import pytest

import cast_llm
from cast_llm.config import add_arguments, option, shown

CONFIG_NAME = re.compile(r"(Config|Settings|Options)$")

# (PlanOptions, cast_llm.plan.config, is scanned too since the plan reads the run's own TrainConfig: issue 51 item 1)
EXCLUDED_MODULES: tuple[str, ...] = ()

# Field names still declared in more than one config dataclass, each with the classes that declare it. The list
# may only shrink: a new double declaration fails below, and so does an entry here that no longer exists (take it
# out). Each is a setting of the same name that a shared option group could not honestly hold: its meaning, type
# or list of values differs between the commands, or a group would need overrides in two classes that do not
# derive from each other (which this test counts as two declarations). Shared: --device (DeviceSettings; train and
# finetune narrow its values), --output-dir (OutputDirSettings; zeroshot's defaults to "."), --model
# (ModelSettings; finetune's has no default), --lr and train/finetune's --batch-size (RunConfig; one command each
# overrides it).
KNOWN = {
    # the one flag name a user types for "which algorithm" in each command: three lists of methods (the training
    # methods, the one-shot pruners, the quantizers), each the command's own choices
    "method": {"TrainConfig", "PruneConfig", "QuantizeConfig"},
    # the training loop's micro-batch (RunConfig, train's override adds 0 = the plan's), a benchmark's batch of
    # prompts (1), and lm-eval's items per forward, a string that may be 'auto'
    "batch_size": {"RunConfig", "TrainConfig", "BenchConfig", "ZeroShotOptions"},
    # a text source with the embedded default, against finetune's required records (JSONL / CSV, labels) that
    # pair with its --eval-data
    "data": {"CalibrationSettings", "FinetuneConfig"},
    # five lists and defaults (export's written dtype, auto = as stored; quantize's and bench's fp16 / bf16 / fp32
    # for the stored tensors and for the kernels; generate's auto = bf16; zeroshot's fp32), one spelling:
    # config.dtype_option (test_every_dtype_flag_is_spelled_one_way)
    "dtype": {"ExportConfig", "QuantizeConfig", "BenchInferenceConfig", "GenerateConfig", "ZeroShotOptions"},
}


def config_classes() -> list[type]:
    found = {}
    for info in pkgutil.walk_packages(cast_llm.__path__, "cast_llm."):
        if info.name.endswith("__main__") or info.name in EXCLUDED_MODULES:
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name
                    and CONFIG_NAME.search(obj.__name__)):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def declared_here(cls) -> set[str]:
    """The fields ``cls`` declares itself (not inherited)."""
    own = vars(cls).get("__annotations__", {})
    return {f.name for f in dataclasses.fields(cls) if f.name in own}


def declaring_class(cls, name: str) -> type:
    """The class on ``cls``'s MRO whose declaration of field ``name`` ``cls`` uses."""
    return next(k for k in cls.__mro__ if dataclasses.is_dataclass(k) and name in declared_here(k))


def double_declarations(classes) -> dict[str, set[str]]:
    """``{field: classes declaring it}`` for every field two unrelated config dataclasses declare separately
    (an option group both derive from is one declaration; a subclass may re-declare its base's field)."""
    out: dict[str, set[str]] = {}
    for i, a in enumerate(classes):
        for b in classes[i + 1:]:
            if issubclass(a, b) or issubclass(b, a):
                continue
            for name in {f.name for f in dataclasses.fields(a)} & {f.name for f in dataclasses.fields(b)}:
                da, db = declaring_class(a, name), declaring_class(b, name)
                if da is not db and not issubclass(da, db) and not issubclass(db, da):
                    out.setdefault(name, set()).update((da.__name__, db.__name__))
    return out


def test_no_field_is_declared_in_two_config_dataclasses():
    classes = config_classes()
    names = {c.__name__ for c in classes}
    assert {"TrainConfig", "PrepareDataConfig", "PruneConfig", "QuantizeConfig", "BenchInferenceConfig"} <= names
    found = double_declarations(classes)
    new = {k: sorted(v - KNOWN.get(k, set())) for k, v in found.items() if v - KNOWN.get(k, set())}
    assert not new, ("declared in two config dataclasses that do not derive from each other (declare it once in an "
                     f"option group both take: cast_llm.config / cast_llm.data.config): {new}")
    gone = {k: sorted(v - found.get(k, set())) for k, v in KNOWN.items() if v - found.get(k, set())}
    assert not gone, f"no longer declared twice: take these out of KNOWN: {gone}"


def test_the_scan_finds_a_planted_double_declaration():
    @dataclasses.dataclass
    class AlphaConfig:
        seq_len: int = option(512, "tokens")

    @dataclasses.dataclass
    class BetaConfig:
        seq_len: int = option(512, "tokens per sequence")

    @dataclasses.dataclass
    class GroupSettings:
        seq_len: int = option(512, "tokens")

    @dataclasses.dataclass
    class GammaConfig(GroupSettings):
        pass

    @dataclasses.dataclass
    class DeltaConfig(GroupSettings):
        extra: int = option(0, "its own")

    @dataclasses.dataclass
    class EpsilonConfig(DeltaConfig):
        extra: int = option(1, "a subclass may re-declare its base's field")

    assert double_declarations([AlphaConfig, BetaConfig]) == {"seq_len": {"AlphaConfig", "BetaConfig"}}
    assert double_declarations([GammaConfig, DeltaConfig, EpsilonConfig]) == {}
    assert double_declarations([AlphaConfig, GammaConfig]) == {"seq_len": {"AlphaConfig", "GroupSettings"}}


def test_the_token_cache_key_is_one_declaration_for_train_and_prepare_data():
    """prepare-data fills the cache a train run with the same flags reads: every setting of the key (DataSettings)
    is the very same field in both configs, so a default changed in one place changes both."""
    from cast_llm.data.config import DataSettings, PrepareDataConfig
    from cast_llm.train.config import TrainConfig

    train = {f.name: f for f in dataclasses.fields(TrainConfig)}
    prepare = {f.name: f for f in dataclasses.fields(PrepareDataConfig)}
    key = [f.name for f in dataclasses.fields(DataSettings)]
    assert {"model", "data", "tokens", "seq_len", "val_fraction", "test_fraction", "max_documents"} <= set(key)
    for name in key:
        assert train[name] is prepare[name], name
    assert set(prepare) - set(key) == {"rebuild", "progress"} and prepare["progress"] is train["progress"]


def test_prune_and_quantize_share_their_calibration_settings_with_train():
    from cast_llm.prune.config import PruneConfig
    from cast_llm.quant.config import QuantizeConfig
    from cast_llm.train.config import TrainConfig

    fields = [{f.name: f for f in dataclasses.fields(c)} for c in (PruneConfig, QuantizeConfig, TrainConfig)]
    for name in ("model", "data", "calib_samples", "seq_len", "n", "m", "seed", "output_dir", "overwrite"):
        assert fields[0][name] is fields[1][name] is fields[2][name], name
    for name in ("calib_batch_size", "device"):
        assert fields[0][name] is fields[1][name], name


def test_every_command_that_runs_our_kernels_takes_one_kernels_setting():
    from cast_llm.cli.eval_zeroshot import ZeroShotOptions
    from cast_llm.cli.generate import GenerateConfig
    from cast_llm.deploy.config import BenchInferenceConfig
    from cast_llm.finetune.config import FinetuneConfig
    from cast_llm.train.config import TrainConfig

    kernels = [{f.name: f for f in dataclasses.fields(c)}["kernels"]
               for c in (TrainConfig, FinetuneConfig, BenchInferenceConfig, GenerateConfig, ZeroShotOptions)]
    assert all(f is kernels[0] for f in kernels)


def test_the_library_bench_config_is_the_commands():
    from cast_llm.deploy.bench import BenchConfig as used_by_run_bench
    from cast_llm.deploy.config import BenchConfig, BenchInferenceConfig

    assert used_by_run_bench is BenchConfig and issubclass(BenchInferenceConfig, BenchConfig)
    base = {f.name: f for f in dataclasses.fields(BenchConfig)}
    cli = {f.name: f for f in dataclasses.fields(BenchInferenceConfig)}
    assert all(cli[name] is f for name, f in base.items())  # no default restated


def test_a_command_words_a_shared_setting_without_redeclaring_it():
    @dataclasses.dataclass
    class SharedSettings:
        width: int = option(8, "the width", min=1)

    @dataclasses.dataclass
    class OneConfig(SharedSettings):
        OPTION_TEXT = {"width": "the width of one"}
        OPTION_SECTIONS = {"width": "layout"}

    @dataclasses.dataclass
    class TwoConfig(OneConfig):
        OPTION_TEXT = {"width": "the width of two"}

    width = dataclasses.fields(TwoConfig)[0]
    assert shown(SharedSettings, width) == ("the width", None)
    assert shown(OneConfig, width) == ("the width of one", "layout")
    assert shown(TwoConfig, width) == ("the width of two", "layout")  # the nearest class wins, per attribute
    parser = argparse.ArgumentParser()
    add_arguments(parser, TwoConfig)
    action = next(a for a in parser._actions if a.dest == "width")
    group = next(g.title for g in parser._action_groups if action in g._group_actions)
    assert (action.help, group) == ("the width of two (default: 8)", "layout")


@pytest.mark.parametrize("package, name", [("prune", "PruneConfig"), ("quant", "QuantizeConfig"),
                                           ("deploy", "ExportConfig"), ("deploy", "BenchInferenceConfig")])
def test_the_job_configs_live_in_their_packages(package, name):
    module = importlib.import_module(f"cast_llm.{package}")
    assert getattr(module, name).__module__.startswith(f"cast_llm.{package}.")


def test_the_torch_free_copies_of_library_names_agree():
    """The configs keep a few lists of names so that ``--help`` imports no torch; they must match the library's."""
    from cast_llm.deploy import bench
    from cast_llm.deploy.config import BACKENDS
    from cast_llm.prune import config as prune_config
    from cast_llm.prune import oneshot
    from cast_llm.quant import config as quant_config
    from cast_llm.quant import quantize

    assert BACKENDS == tuple(bench.BACKENDS)
    assert prune_config.METHODS == oneshot.METHODS and set(quant_config.METHODS) == set(quantize.METHODS)


def test_every_dtype_flag_is_spelled_one_way():
    """Each command's --dtype (and train's --teacher-dtype) takes the same names (fp32 / bf16 / fp16, plus auto where
    the command has one) and torch's spellings for them: `eval zeroshot --dtype bf16` once refused what every other
    command takes, and asked for `bfloat16`."""
    from cast_llm.config import coerce, dtype_name
    from cast_llm.errors import CastError

    fields = [(cls, f) for cls in config_classes() for f in dataclasses.fields(cls)
              if f.name == "dtype" or f.name.endswith("_dtype")]
    assert len({cls.__name__ for cls, _ in fields}) >= 5
    for cls, f in fields:
        assert f.metadata.get("parse") is dtype_name, f"{cls.__name__}.{f.name}: declare it with config.dtype_option"
        assert set(f.metadata["choices"]) <= {"auto", "fp32", "bf16", "fp16"}, (cls.__name__, f.metadata["choices"])
        for name in f.metadata["choices"]:
            assert coerce(cls, f.name, name.upper(), "test") == name
        if "bf16" in f.metadata["choices"]:
            assert coerce(cls, f.name, "bfloat16", "test") == "bf16"
        with pytest.raises(CastError, match="must be one of"):
            coerce(cls, f.name, "int8", "test")
