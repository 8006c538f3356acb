"""The trace of one run: a record per request, the input of metrics.py.

Times are seconds since the run started (one monotonic clock for the whole run). Token counts say
where they came from: "server" (meta_info / usage) or "tokenizer" (counted by the harness with
the model's tokenizer, for servers such as llama.cpp that send no usage in streams).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    program_id: str
    step: int  # index of the program step
    branch: int  # -1: a Gen step; k: fork branch k; len(branches): the fork's judge
    start_s: float
    end_s: float
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried output
    chunk_tokens: list[int] = field(default_factory=list)  # generated tokens after each chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not report it
    prompt_tokens_source: str = "server"
    completion_tokens_source: str = "server"
    constrained: bool = False
    valid_json: bool | None = None  # for constrained requests: did the output parse
    tool_request: bool = False  # the request offered function tools
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # {id, name, arguments}
    invalid_tool_calls: int = 0  # calls with an unknown name or schema-invalid arguments
    error: str | None = None
    text: str = ""
    prompt: str = ""  # the prompt text sent (the oracle's input, oracle.py)
    compacted: bool = False  # the program compacted its context right before this request
    forked: bool = False  # a subagent's first request (forked from its parent's context)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.start_s if self.chunk_times else None


@dataclass
class Trace:
    wall_s: float
    num_programs: int
    records: list[RequestRecord]

    def to_dict(self, with_text: bool = False) -> dict[str, Any]:
        records = []
        for r in self.records:
            d = asdict(r)
            if not with_text:
                d.pop("text")
                d.pop("prompt")
            records.append(d)
        return {"wall_s": self.wall_s, "num_programs": self.num_programs, "records": records}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        return cls(d["wall_s"], d["num_programs"],
                   [RequestRecord(**r) for r in d["records"]])
