"""Mask-learning dynamics (method.md §7): per-layer statistics, weight tracking (Table 2) and the
``|pruned| / |kept|`` ratio histograms (Fig. 3), as pure functions and as training-loop observers.

See docs/analysis.md for the definition of every logged quantity and where it is stored.
"""

from cast_llm.analysis.layers import LayerCounts, layer_counts, packed_flips, packed_popcount
from cast_llm.analysis.observers import analysis_observers
from cast_llm.analysis.ratios import RatioHistogram, group_ratios, parse_hist_steps, resolve_hist_steps
from cast_llm.analysis.tracking import TrackerState, sample_positions

__all__ = [
    "LayerCounts",
    "layer_counts",
    "packed_flips",
    "packed_popcount",
    "RatioHistogram",
    "group_ratios",
    "parse_hist_steps",
    "resolve_hist_steps",
    "TrackerState",
    "sample_positions",
    "analysis_observers",
]

