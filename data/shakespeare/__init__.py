"""Tiny Shakespeare in GPT-2 BPE tokens (prepare.py)."""
