"""Speculative decoding: drafts (ngram.py), the policy that prices them (policy.py over
cost_model.py) and the scheduler's partner that ties them together (speculator.py).  The model
side is one forward mode, TARGET_VERIFY (graphexec/batch/forward_mode.py); acceptance is the
sampler's (graphexec/sampling/sampler.py)."""

from graphexec.speculative.speculator import SpeculationStats, Speculator

__all__ = ["SpeculationStats", "Speculator"]
