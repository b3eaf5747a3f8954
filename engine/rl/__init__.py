"""Reinforcement learning from a task's checker (rl.py; docs/rl.md)."""
