"""``python -m cast_llm.inference MODEL_DIR PATH TOKENS PROMPT_TOKENS``: one path's measurement for
:func:`cast_llm.inference.payoff`, printed as one JSON line."""

import json
import sys
import warnings

from transformers.utils import logging as hf_logging

from cast_llm.inference import _measure

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
args = sys.argv[1:]
print(json.dumps(_measure(args[0], args[1], int(args[2]), int(args[3]))))
