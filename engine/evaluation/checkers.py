"""Checkers: plain functions (problem, completion) -> bool or a reward in [0, 1], the same for
evaluation and for reinforcement learning's rewards.

    check = resolve("number")                      # exact | number | "pkg.module:function"
    check({"prompt": "What is 2 + 2?", "answer": "4"}, " 4\\n")   # True

A user's checker is named by its module path and function ("mytasks.checks:is_palindrome", or
"path/to/file.py:function"); the module is imported from the current directory. A problem is
the task file's JSON object as written (every field it has), a completion the generated text up
to its stop (the stop string or end-of-text token not included).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Callable

Checker = Callable[[dict, str], "bool | float"]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class CheckerError(ValueError):
    """A checker that cannot be found, imported or run; the message names what to fix."""


def exact(problem: dict, completion: str) -> bool:
    """The completion, stripped of surrounding whitespace, is the answer."""
    return completion.strip() == str(problem["answer"]).strip()


def last_number(text: str) -> float | None:
    """The last number written in text (thousands commas allowed), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def number(problem: dict, completion: str) -> bool:
    """The last number in the completion equals the answer's (as GSM8K-style graders read it)."""
    got, want = last_number(completion), last_number(str(problem["answer"]))
    if want is None:
        raise CheckerError(f"the answer {problem['answer']!r} holds no number for the 'number' "
                           "checker; use 'exact' or a checker of your own")
    return got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)


BUILTIN = {"exact": exact, "number": number}


def resolve(name: str) -> Checker:
    """A checker by name: a built-in one, or MODULE:FUNCTION / FILE.py:FUNCTION."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, _, function = name.rpartition(":")
    if not module_name or not function:
        raise CheckerError(f"checker {name!r} is neither {' nor '.join(BUILTIN)} nor "
                           "'module.path:function' (or 'file.py:function')")
    try:
        module = _import(module_name)
    except Exception as e:  # noqa: BLE001 - a user's module may raise anything on import
        raise CheckerError(f"checker {name!r}: its module does not import "
                           f"({type(e).__name__}: {e})") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise CheckerError(f"checker {name!r}: module {module_name} has no function "
                           f"{function!r}")
    return found


def _import(module_name: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        spec = importlib.util.spec_from_file_location(f"_checker_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:  # the user's own modules
        sys.path.insert(0, str(Path.cwd()))
    return importlib.import_module(module_name)


def reward(check: Checker, problem: dict, completion: str) -> float:
    """The checker's verdict as a reward in [0, 1] (True: 1.0); CheckerError when it raises or
    answers something else."""
    try:
        value = check(problem, completion)
    except CheckerError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's checker may raise anything
        raise CheckerError(f"its checker raised {type(e).__name__}: {e}") from None
    if isinstance(value, bool) or (isinstance(value, (int, float)) and 0 <= value <= 1):
        return float(value)
    raise CheckerError(f"its checker returned {value!r}; a checker returns a bool or a number "
                       "in [0, 1]")
