from cast_llm.cli import entry

entry()
