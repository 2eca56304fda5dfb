"""Tuning: what fits a :class:`~heterospec.policy.Policy` to a model pair and a machine.  It runs the
engine, so it sits above it (ops -> models -> policy -> engine -> tune -> tools).

- :mod:`.trace`: record each prompt's greedy output and, at every position, the engine's own maximal draft
  tree; replay any policy on it exactly, without a model;
- :mod:`.bins`: the paper's depth-3 regression tree on the path entropy (the bins' thresholds);
- :mod:`.costs`: time this machine's cycle and fit the cost model replay predicts speed with;
- :mod:`.optimise`: the per-bin extra depth and kept nodes that maximise predicted speed.
"""
from .bins import fit_thresholds
from .costs import profile_costs
from .optimise import optimise_policy
from .trace import Trace, record

__all__ = ["Trace", "record", "fit_thresholds", "profile_costs", "optimise_policy"]
