"""What every benchmark writes: markdown tables, RESULTS/STEM.{json,md}, and figures."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

MIB = 2**20


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def section(intro: str, header: list[str], rows: list[list]) -> list[str]:
    """A page's lines for one table: the sentence that says what it holds, then the table."""
    return [intro, "", markdown_table(header, rows), ""]


def not_measured(row: dict) -> str:
    """'skipped: why' or 'failed: error' for a row whose status is not ok."""
    why = row.get("reason") or row.get("error", "")
    return f"{row.get('status', 'not run')}: {why}" if why else row.get("status", "not run")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write_report(report: dict, markdown: str, folder: str | Path, stem: str) -> list[Path]:
    """FOLDER/STEM.json (every number) and FOLDER/STEM.md (the page); their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.json", folder / f"{stem}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown.rstrip("\n") + "\n")
    return paths


def figure(**kwargs):
    """A matplotlib Figure (no pyplot, no display needed), or None where it is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    return Figure(**kwargs)


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
