"""Tiny Shakespeare, one token per character (prepare.py)."""
PREPARE_ON_FIRST_USE = True  # from the bundled text, no download: a run prepares it itself
