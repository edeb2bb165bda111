"""``python -m cast_llm``: the ``cast-llm`` command line."""

from cast_llm.cli import entry

entry()
