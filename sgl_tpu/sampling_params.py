"""Per-request sampling parameters (SGLang's names and defaults), validated once at the edge.

`SamplingParams.from_dict` is the single entry for user input (Engine, native API, OpenAI API);
every problem raises `ValueError` with a message naming the field, which the HTTP layer turns
into a 400. Each process parses a request's params once: the HTTP process in
`TokenizerManager.validate`, the scheduler process again on arrival (it trusts nothing from
another process), the in-process `Engine` in `generate`, handing the parsed params to its
scheduler.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Keys SGLang's frontend and native API send that change nothing here yet, or are handled by
# the tokenizer side; accepted so that unmodified clients work.
_ACCEPTED_NOOP_KEYS = frozenset({"spaces_between_special_tokens", "logit_bias",
                                 "custom_params"})
# Other names of a field: SGLang's native API calls the seed `sampling_seed` (and the
# sglang-router keeps only that name when it re-serialises a request); OpenAI calls it `seed`.
_ALIASES = {"sampling_seed": "seed"}
MAX_STOP_REGEX = 16  # patterns per request (each is searched after every new token)
INT64_MAX = 2**63 - 1
# Every stop string is searched after every token, so their number and size are bounded.
MAX_STOP_STRS = 256
MAX_STOP_STR_CHARS = 4096
MAX_STOP_TOKEN_IDS = 4096


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    # Python regular expressions searched in the decoded output: the first match ends the
    # request, trimmed like a stop string; `matched_stop` reports the pattern (as SGLang).
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # tokens between a streamed request's updates (the HTTP side; None: --stream-interval)
    stream_interval: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, lo=0)
        _check_int("min_new_tokens", self.min_new_tokens, lo=0)
        _check_int("n", self.n, lo=1, hi=64)
        _check_int("top_k", self.top_k, lo=-1, hi=2**31 - 1)
        _check_float("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0, lo_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, lo=1, hi=2**31 - 1)
        if len(self.stop) > MAX_STOP_STRS:
            raise ValueError(f"stop: at most {MAX_STOP_STRS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STR_CHARS:
                raise ValueError("stop: every stop string must be a non-empty string of at "
                                 f"most {MAX_STOP_STR_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
        if len(self.stop_regex) > MAX_STOP_REGEX:
            raise ValueError(f"stop_regex: at most {MAX_STOP_REGEX} patterns, "
                             f"got {len(self.stop_regex)}")
        for pattern in self.stop_regex:
            if not isinstance(pattern, str) or not pattern:
                raise ValueError("stop_regex: every pattern must be a non-empty string")
            try:
                matches_empty = re.search(pattern, "") is not None
            except re.error as e:
                raise ValueError(f"stop_regex: invalid regular expression {pattern!r}: {e}"
                                 ) from None
            if matches_empty:  # it would end every request before its first character
                raise ValueError(f"stop_regex: {pattern!r} matches the empty string")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0)
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("regex", "json_schema", "ebnf"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf)) > 1:
            raise ValueError("only one of regex, json_schema and ebnf may be set")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, if any."""
        for kind in ("regex", "json_schema", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def samples(self) -> list[SamplingParams]:
        """The params of this request's `n` samples by `expand_n`'s rule (n = 1 each; with a
        seed, sample k gets `sample_seed(seed, k)`), without validating them again: those
        values are valid whenever these are, so a process parses a request once."""
        if self.n == 1:
            return [self]
        out = []
        for k in range(self.n):
            sample = copy.copy(self)
            object.__setattr__(sample, "n", 1)
            if self.seed is not None:
                object.__setattr__(sample, "seed", sample_seed(self.seed, k))
            out.append(sample)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a JSON-like dict; nulls mean "default"; unknown keys are an error."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError("sampling_params must be an object")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = set(d) - names - _ACCEPTED_NOOP_KEYS - set(_ALIASES)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if value is None or key in _ACCEPTED_NOOP_KEYS:
                continue
            if key in _ALIASES:
                key = _ALIASES[key]
                other = d.get(key)
                if other is not None and other != value:
                    raise ValueError(f"{key} and its alias {_alias_of(key)} disagree "
                                     f"({other!r} vs {value!r}); give one")
            if key in ("stop", "stop_regex"):
                value = (value,) if isinstance(value, str) else _as_tuple(key, value)
            elif key == "stop_token_ids":
                value = _as_tuple(key, value)
            elif key == "json_schema" and not isinstance(value, str):
                raise ValueError("json_schema must be a JSON string")
            kwargs[key] = value
        extra = {k: d[k] for k in _ACCEPTED_NOOP_KEYS & set(d) if d[k] is not None}
        return cls(**kwargs, extra=extra)


def expand_n(sampling: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """The sampling params of the `n` samples of one prompt (`n` itself removed). With a seed,
    sample k gets seed + k (mod 2**63): n different samples, each reproducible alone; without
    one, every sample gets its own random seed at admission. The one rule for every API."""
    out = []
    for k in range(n):
        d = {key: v for key, v in sampling.items() if key != "n"}
        if d.get("seed") is None and d.get("sampling_seed") is not None:
            d["seed"] = d.pop("sampling_seed")
        seed = d.get("seed")
        if n > 1 and isinstance(seed, int) and not isinstance(seed, bool):
            d["seed"] = sample_seed(seed, k)
        out.append(d)
    return out


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample k of a seeded request with n > 1."""
    return (seed + k) % (INT64_MAX + 1)


def _alias_of(name: str) -> str:
    return next(alias for alias, target in _ALIASES.items() if target == name)


def _as_tuple(name: str, value: Any) -> tuple:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list")
    return tuple(value)


def _check_int(name: str, value: Any, *, lo: int, hi: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_short_repr(value)}")
    if value < lo or value > hi:
        bound = f">= {lo}" if hi == INT64_MAX else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: Any, *, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {_short_repr(value)}")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    too_low = value <= lo if lo_open else value < lo
    if too_low or value > hi:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{lo}, {hi}], got {value}")


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
