"""How a setting is declared: once, as a field of a frozen config dataclass whose metadata carries
its help text and its check. The CLI (`sgl_tpu/cli.py`), the checks run by `__post_init__`
(`check_settings`) and the flag table of docs/serving.md are derived from these fields.

    page_size: int = setting(16, "tokens per KV page ...", check=Int(1, power_of_two=True),
                             see="architecture.md")

A check is any callable `check(name, value)` that raises `ValueError` naming the field; `Int`,
`Number` and `OneOf` cover the common cases and say what they accept (`describe`), and `OneOf`
gives the CLI its choices. Checks that relate two fields stay in the class's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Check = Callable[[str, Any], None]


def setting(default: Any, help: str, *, check: Check | None = None, see: str | tuple[str, ...] = (),
            flag: bool = True) -> Any:
    """A config field: `default`, the `--help` text, the `check` run on construction, the doc
    pages the flag table links (`see`: "page.md", "page.md#anchor" or "#anchor" of the table's
    page) and whether the CLI has a flag for it."""
    see = (see,) if isinstance(see, str) else see
    return dataclasses.field(default=default, metadata={"help": help, "check": check,
                                                        "see": see, "flag": flag})


def check_settings(config: Any) -> None:
    """Run every field's check (ValueError naming the first bad field)."""
    for f in dataclasses.fields(config):
        check = f.metadata.get("check")
        if check is not None:
            check(f.name, getattr(config, f.name))


class Rule:
    """A check that says what it accepts: `{name} must be {describe()}, got {value!r}`."""

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def __call__(self, name: str, value: Any) -> None:
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")


@dataclass(frozen=True)
class Int(Rule):
    """An int (never a bool) in [lo, hi]; `power_of_two` also asks for a power of two."""

    lo: int = 1
    hi: int | None = None
    power_of_two: bool = False

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.lo:
            return False
        if self.power_of_two and (value <= 0 or value & (value - 1)):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        if self.power_of_two:
            return "a power of two"
        if self.hi is not None:
            return f"an integer in [{self.lo}, {self.hi}]"
        return "a positive integer" if self.lo == 1 else f"an integer >= {self.lo}"


@dataclass(frozen=True)
class Number(Rule):
    """An int or float (never a bool, never NaN) from `lo` (excluded if `lo_open`) up to `hi`
    (included; with no `hi`, any finite number)."""

    lo: float = 0
    hi: float = math.inf
    lo_open: bool = False

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        above = self.lo < value if self.lo_open else self.lo <= value
        return above and (value < math.inf if self.hi == math.inf else value <= self.hi)

    def describe(self) -> str:
        if self.hi == math.inf:
            return f"a finite number {'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class OneOf(Rule):
    """One of `choices` (the CLI offers exactly these)."""

    choices: tuple[str, ...]

    def accepts(self, value: Any) -> bool:
        return value in self.choices

    def describe(self) -> str:
        return f"one of {self.choices}"


@dataclass(frozen=True)
class OrNone(Rule):
    """None (unset), or what `rule` accepts."""

    rule: Rule

    @property
    def choices(self) -> tuple[str, ...] | None:
        return getattr(self.rule, "choices", None)

    def accepts(self, value: Any) -> bool:
        return value is None or self.rule.accepts(value)

    def describe(self) -> str:
        return self.rule.describe()
