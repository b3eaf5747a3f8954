"""Evaluation on tasks (eval.py, docs/evaluation.md): task files and built-in tasks, checkers,
log-likelihood scoring and batched generation over the KV cache, statistics, the report card."""
