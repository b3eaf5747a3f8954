"""Datasets (one folder each, with prepare.py) and the token loader (loader.py)."""
