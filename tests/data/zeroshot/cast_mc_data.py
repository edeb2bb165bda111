"""Dataset loader of the local test task ``cast_mc`` (see cast_mc.yaml).

lm-eval 0.4.13 passes ``dataset_kwargs.data_files`` to ``datasets.load_dataset`` unchanged, so a relative path
there is resolved against the current directory, not the YAML's folder. A ``custom_dataset`` function imported
with ``!function`` (which lm-eval resolves next to the YAML) can find the JSONL file from its own location,
so the task works from any working directory.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(**kwargs):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / "cast_mc.jsonl")})
