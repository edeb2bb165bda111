"""``python -m cast_llm.cli``: the ``cast-llm`` command line (what ``accelerate launch -m cast_llm.cli`` runs)."""

from cast_llm.cli import entry

entry()
