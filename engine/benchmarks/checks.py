"""The option checks every sub-command shares; each raises ConfigError with the fix."""
from __future__ import annotations

import dataclasses

from config import ConfigError


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def comma_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [item.strip() for item in text.split(",") if item.strip()]


def check(options: object, minimums: dict[str, float]) -> None:
    """Every field with choices holds one of them, and each named field is >= its minimum."""
    for f in dataclasses.fields(options):
        value, choices = getattr(options, f.name), f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag(f.name)}={value!r}: use " + " or ".join(choices))
    for name, least in minimums.items():
        if getattr(options, name) < least:
            raise ConfigError(f"{flag(name)} must be >= {least} (got {getattr(options, name)})")


def check_list(options: object, name: str, allowed: tuple | list) -> list[str]:
    """The comma list in field `name`, every item one of `allowed` -> the items."""
    items = comma_list(getattr(options, name))
    if not items or not set(items) <= set(allowed):
        raise ConfigError(f"{flag(name)}={getattr(options, name)!r}: use a comma list of "
                          + ", ".join(allowed))
    return items
