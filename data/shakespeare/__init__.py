"""Tiny Shakespeare in GPT-2 BPE tokens (prepare.py)."""
PREPARE_ON_FIRST_USE = True  # from the bundled text, no download: a run prepares it itself
