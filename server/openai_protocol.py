"""Request models of the OpenAI routes (pydantic): the one place `CompletionRequest` and
`ChatCompletionRequest` are defined. SGLang's extensions arrive as extra top-level fields
(the OpenAI client's `extra_body`). `request_fields()` maps a request's names onto the fields of
the request the scheduler gets (`messages.TokenizedGenerateReq`); the sampling parameters are
mapped by `openai_common.sampling_params`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


# SamplingRequest's fields that the scheduler's request takes by the same name (checked by
# `TokenizerManager.validate`); None leaves the request's default.
REQ_FIELDS = ("session_id", "priority", "retention_seconds", "tool_pause", "program_id")


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints; the SGLang extensions are accepted through extra_body."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # `user` and `safety_identifier`: logged at debug level only
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # names the session, as `session_id` does
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None  # a JSON schema as a string, like the native field
    rid: str | None = None
    session_id: str | None = None  # an agent's session: retention hint for its KV
    session_params: dict[str, Any] | None = None  # SGLang's; its `id` names the session too
    # cache control (scheduler/retention.py): the KV's eviction priority (SGLang's field), a
    # retention pin in seconds, the hint that this turn ends in a tool call
    priority: StrictInt | None = None
    retention_seconds: StrictInt | StrictFloat | None = None
    tool_pause: bool | None = None
    # the program (agent) this request is a turn of, when no session names one: scheduling
    # (--schedule-policy program) and reports only, no KV retention; Anthropic's
    # metadata.user_id arrives here
    program_id: str | None = None

    def request_fields(self) -> dict[str, Any]:
        """`messages.TokenizedGenerateReq` fields (not the prompt, sampling or rid)."""
        return {name: value for name in REQ_FIELDS if (value := getattr(self, name)) is not None}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def request_fields(self) -> dict[str, Any]:
        want_lp = self.logprobs is not None
        return {**super().request_fields(), "return_logprob": want_lp,
                "top_logprobs_num": self.logprobs or 0, "return_text_in_logprobs": True,
                "logprob_start_len": 0 if want_lp and self.echo else -1}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, name: for the template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: bool = True  # SGLang: false keeps the reasoning block in `content`
    chat_template_kwargs: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    def request_fields(self) -> dict[str, Any]:
        return {**super().request_fields(), "return_logprob": self.logprobs,
                "top_logprobs_num": self.top_logprobs or 0, "return_text_in_logprobs": True,
                "max_new_tokens_defaulted": self.max_completion_tokens is None
                and self.max_tokens is None}


