"""Config fields and what they say about themselves: every section of the config (config.py,
ModelConfig included) declares its fields with opt(), and code that needs to know something of
an option reads it from the field instead of keeping a list of its own.

    name: int = opt(6, "transformer blocks", fixed=True, hf="n_layer", check=POSITIVE)

What a field may state (its metadata), and who reads it:
    help, choices   --help, and config.validate (a value outside the choices is refused)
    check           (what the value must be, test(value, its section)): config.validate
    resume          True: it may change when a run resumes without the run differing from one
                    never stopped (engine/training/restore.config_changes)
    fast            a speedup's fast value (its reference: the default): the start-up banner
                    (engine/training/speedups.settings), bench.py ablation's flags (flag: their
                    name, when not the field's; fields sharing one are set together; cuda: it
                    changes nothing off CUDA), docs/speedups.md's table (tests/test_docs.py)
    fixed           the trained weights set it: a checkpoint's value wins over the run's
                    config when its weights are loaded (engine/training/build.py)
    departure       one of the speedrun's departures from GPT-2, whose default is GPT-2's: the
                    banner's recipe, config.gpt2_recipe_flags, docs/speedrun.md's table;
                    speedrun: the value bench.py to-loss's chain tries
    gpt2            Hugging Face's GPT-2 cannot hold it off its default, and has this instead:
                    the export refuses such a model in one line (engine/hf.py)
    hf              its key in a Hugging Face GPT2Config (engine/hf.py)
    kernel          False: the packed decode kernel lacks it, so a model with it off its default
                    decodes through forward() (engine/inference/packed.py)
A departure is fixed by the weights and beyond the kernel unless it says otherwise.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any



@dataclasses.dataclass(frozen=True)
class Range:
    """check= for a number within bounds: what config.validate tests (it unpacks as (text,
    test), as any check= does) and, through bounds(), a pydantic Field's ge/gt/le/lt."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def __iter__(self):
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}"
        high = f"{self.le}]" if self.le is not None else f"{self.lt})"
        one = [f"{op} {v}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le),
                                          ("<", self.lt)) if v is not None]
        yield f"in {low}, {high}" if len(one) == 2 else one[0]
        yield lambda value, _: self.holds(value)

    def holds(self, x: float) -> bool:
        return ((self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt)
                and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt))


POSITIVE, NON_NEGATIVE, FRACTION = Range(gt=0), Range(ge=0), Range(ge=0, lt=1)
# a speedup flag of bench.py ablation: the config keys it sets (section.name), their reference
# (default) and fast values as the command line writes them, whether it needs CUDA
Flag = collections.namedtuple("Flag", "keys reference fast cuda")


def opt(default: Any, help: str, choices: tuple | None = None, **facts: Any) -> Any:
    """A config field: its default, one line of help, the allowed values and its facts."""
    if facts.get("departure"):
        facts = {"fixed": True, "kernel": False, **facts}
    return dataclasses.field(default=default,
                             metadata={"help": help, "choices": choices, **facts})


def facts(section: type, fact: str) -> dict[str, Any]:
    """{field name: the fact's value} for the fields of a config section that state it."""
    return {f.name: f.metadata[fact] for f in dataclasses.fields(section)
            if f.metadata.get(fact) is not None}


def departures(section: Any) -> list[str]:
    """'name=value' for each departure a section's values turn on ([]: all at their default)."""
    default = type(section)()
    return [f"{name}={getattr(section, name)}" for name in facts(type(section), "departure")
            if getattr(section, name) != getattr(default, name)]


def bounds(section: type, name: str) -> dict[str, float]:
    """A field's Range as pydantic's Field keywords (ge, gt, le, lt): one definition of the
    limits that the config and the server's requests both hold."""
    check = facts(section, "check")[name]
    return {k: v for k, v in dataclasses.asdict(check).items() if v is not None}


def as_flag(value: Any) -> str:
    """A value as the command line writes it: true, 64, sdpa."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def flags_from(sections: dict[str, type]) -> dict[str, Flag]:
    """bench.py ablation's flags from the fields that state `fast`, in the sections' order."""
    keys, values = collections.defaultdict(list), {}
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            if (fast := f.metadata.get("fast")) is not None:
                name = f.metadata.get("flag", f.name)
                keys[name].append(f"{section}.{f.name}")
                values.setdefault(name, (as_flag(f.default), as_flag(fast),
                                         bool(f.metadata.get("cuda"))))
    return {name: Flag(tuple(keys[name]), *values[name]) for name in keys}
