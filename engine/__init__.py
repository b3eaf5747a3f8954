"""The mechanisms behind the scripts, one job per module (see docs/layout.md)."""
