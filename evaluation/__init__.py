"""Scoring on the benchmarks the field quotes: tinyvlm as an lmms-eval model (evaluation/lmms_model.py) and an
lmms-eval task over a local dataset built from the synthetic shapes' held-out split (evaluation/tasks/)."""
