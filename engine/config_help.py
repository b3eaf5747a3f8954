"""--help's words for every script: its own options, then every config key as the command line
resolves it. config.py loads this only when -h/--help is given, so a run never pays for it, and
hands it what it resolved: this module reads nothing of config.py's itself.
"""
from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]  # config paths are shown relative to it


def fields_help(title: str, current: Any, flag: Callable[[str], str], default: Any = None,
                 from_file: Any = None, config: str = "", shared: frozenset = frozenset()
                 ) -> list[str]:
    """[title], then per field `flag=value`, its help and choices; given `default`, a value that
    differs says where it was set (the config, as in `from_file`, or the command line); a name
    in `shared` (a key of several sections) needs its section's prefix."""
    lines = [f"[{title}]"]
    for f in dataclasses.fields(current):
        value, choices, note = getattr(current, f.name), f.metadata.get("choices"), ""
        setting = f"{flag(f.name)}={value!r}"
        if default is not None:
            if value != (initial := getattr(default, f.name)):
                came_from = (f"config {config}" if value == getattr(from_file, f.name)
                             else "command line")
                setting += f" ({came_from}; default {initial!r})"
            note = " (use the section prefix)" if f.name in shared else ""
        text = f.metadata.get("help", "") + (f" [{' | '.join(choices)}]" if choices else "")
        lines.append(f"  {setting:<32}  {text}{note}")
    return lines + [""]


def script_help(prog: str, options: Any) -> list[str]:
    positional = getattr(options, "positional", None)
    return fields_help(f"{prog} options", options, lambda name: (
        f"[{name.upper()} | --{name.replace('_', '-')}]" if name == positional
        else f"--{name.replace('_', '-')}"))


def render(prog: str, line: Any, config_path: Path, default_config: str, resolved: tuple,
           sections: dict[str, type], lead: tuple[str, ...]) -> str:
    """The script's options, then every config key as the command line (`line`, its config file
    at `config_path`) resolved it, `resolved` = (the config file's, the resolved config, the
    script's options), marked where not the default; `lead` sections first."""
    if unknown := [s for s in lead if s not in sections]:
        raise ValueError(f"lead names unknown sections {unknown}; sections are {list(sections)}")
    from_file, cfg, options = resolved
    path = config_path.resolve()
    label = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    names = collections.Counter(f.name for cls in sections.values()
                                for f in dataclasses.fields(cls))
    shared = frozenset(name for name, count in names.items() if count > 1)
    count = len(line.overrides)
    overrides = f" + {count} override{'s' * (count != 1)} from the command line" if count else ""
    lines = [f"usage: python {prog} [options] [--config NAME] [--section.key=value | "
             "--key=value ...]", "",
             f"config: {line.config_name} ({label}){overrides}",
             "Each key shows the value this command line resolves to; one not the built-in default",
             f"says where it was set: (config {Path(line.config_name).stem}; default ...) or "
             "(command line; default ...).", "",
             f"  {'--config NAME':<13}  configs/NAME.toml or a path (default: {default_config})",
             f"  {'-h, --help':<13}  this list, for the config and overrides given with it", ""]
    lines += script_help(prog, options) if options is not None else []
    for section in [*lead, *(s for s in sections if s not in lead)]:
        lines += fields_help(section, getattr(cfg, section), lambda name: f"--{section}.{name}",
                              sections[section](), getattr(from_file, section),
                              Path(line.config_name).stem, shared)
    return "\n".join(lines)
