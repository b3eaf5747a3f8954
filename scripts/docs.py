"""The docs' generated parts: each section between `<!-- NAME -->` and `<!-- /NAME -->` made
again from the code that holds its facts, so that no page keeps a list of its own.

    python scripts/docs.py           # rewrite every generated section
    python scripts/docs.py --check   # say which are out of date, exit 1 (tests/test_docs.py)

Sections: docs/speedups.md's flag-table (the config fields stating a fast value),
docs/speedrun.md's departures (the fields stating departure=True: engine/fields.py) and
docs/rl.md's rl-options (rl.py's RLOptions).
"""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config import SECTIONS, speedup_flags  # noqa: E402 - the repository on the path first
from engine.fields import as_flag  # noqa: E402


def field_help(key: str) -> str:
    section, name = key.split(".")
    return next(f.metadata["help"] for f in dataclasses.fields(SECTIONS[section])
                if f.name == name)


def flag_table() -> str:
    """Every speedup flag: the fields it sets, reference -> fast, whether it needs CUDA, and
    what each field's help says it does."""
    lines = ["| # | `bench.py` flag | config keys | reference -> fast | CUDA only | what it does |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i, (name, flag) in enumerate(speedup_flags().items(), 1):
        keys = ", ".join(f"`{key}`" for key in flag.keys)
        helps = "; ".join(field_help(key) for key in flag.keys).replace("|", "\\|")
        lines.append(f"| {i} | `{name}` | {keys} | `{flag.reference}` -> `{flag.fast}` | "
                     f"{'yes' if flag.cuda else ''} | {helps} |")
    return "\n".join(lines)


def departure_table() -> str:
    """Every departure from GPT-2: the value to-loss's chain tries, what it does, what GPT-2 has
    instead (where the Hugging Face export refuses it), whether the packed decode kernel runs it."""
    lines = ["| flag | to-loss tries | what it does | Hugging Face export | packed CPU decode "
             "kernel |", "| --- | --- | --- | --- | --- |"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if not f.metadata.get("departure"):
                continue
            speedrun = f.metadata.get("speedrun")
            value = "-" if speedrun is None else f"`{as_flag(speedrun)}`"
            gpt2 = f.metadata.get("gpt2")
            export = f"refused (GPT-2 has {gpt2})" if gpt2 else "kept"
            kernel = "runs it" if f.metadata.get("kernel") else "forward() instead"
            if section != "model":  # a training setting: nothing of it is in the weights
                export = kernel = "-"
            text = f.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{section}.{f.name}` (`{as_flag(f.default)}`) | {value} | {text} | "
                         f"{export} | {kernel} |")
    return "\n".join(lines)


def rl_options() -> str:
    """rl.py's own options (RLOptions, the [rl] table): default, what it does, its choices."""
    from rl import RLOptions

    lines = ["| option | default | what it does |", "| --- | --- | --- |"]
    for f in dataclasses.fields(RLOptions):
        choices = f.metadata.get("choices")
        text = f.metadata["help"] + (f" ({' | '.join(choices)})" if choices else "")
        cell = text.replace("|", "\\|")
        default = as_flag(f.default) or "''"
        lines.append(f"| `{f.name}` | `{default}` | {cell} |")
    return "\n".join(lines)


SECTIONS_MADE = {("docs/speedups.md", "flag-table"): flag_table,
                 ("docs/speedrun.md", "departures"): departure_table,
                 ("docs/rl.md", "rl-options"): rl_options}


def replaced(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {name} -->\n).*?(\n<!-- /{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- {name} --> ... <!-- /{name} --> section to fill")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def main(argv: list[str]) -> int:
    check, stale = "--check" in argv, []
    for (page, name), make in SECTIONS_MADE.items():
        path = ROOT / page
        text = path.read_text()
        new = replaced(text, name, make())
        if new != text:
            stale.append(f"{page} <!-- {name} -->")
            if not check:
                path.write_text(new)
    if check and stale:
        print("out of date (python scripts/docs.py rewrites them): " + ", ".join(stale))
        return 1
    print(("rewrote " if stale else "up to date: ") + (", ".join(stale) or "every section"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
