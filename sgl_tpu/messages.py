"""Every message that crosses a process boundary, typed and msgpack-encoded (no pickle).

    TokenizerManager ──TokenizedGenerateReq / AbortReq / ControlReq──► Scheduler
                     ──OpenSessionReq / CloseSessionReq / ToolPauseReq──► Scheduler
                     ──LoadLoraReq / UnloadLoraReq──► Scheduler
    Scheduler        ──BatchTokenIdOut──► Detokenizer ──BatchStrOut──► TokenizerManager
    Scheduler        ──ControlResp / ReadyMsg──► TokenizerManager

Tensor parallelism (sgl_tpu/parallel) adds a second channel, decoded by `decode_runner`:

    leader (rank 0)  ──LeaderWelcome, Runner* calls──► follower ranks 1..N-1
    follower         ──FollowerHello, FollowerReady / FollowerFailed──► leader

Per-step outputs are incremental: a `ReqOutput` carries the step's new token ids, a `ReqStrOut`
the new text and ids, so a request of L tokens moves O(L) bytes in all, not O(L^2).

The in-process `Engine` uses the same structs without encoding them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    """One generation request, and every per-request field it carries from the HTTP layer to
    the scheduler, declared here once: each API's protocol module maps its names onto these
    fields, `TokenizerManager.generate` sends the struct as it is, and the scheduler's intake
    copies the fields `Req` shares by name (scheduler/intake.py)."""

    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields, validated by the sender
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # the log-prob entries' token text (the HTTP side's answer; the scheduler ignores it)
    return_text_in_logprobs: bool = False
    session_id: str | None = None
    # cache control (scheduler/retention.py)
    priority: int | None = None
    retention_seconds: float = 0.0
    tool_pause: bool = False  # the client's hint: this turn ends in a tool call
    may_call_tools: bool = False  # tools offered: a ToolPauseReq may follow its finish
    # the program (agent) it is a turn of when no session names one (Anthropic's
    # metadata.user_id): scheduling and reports only, no KV retention (scheduler/programs.py)
    program_id: str | None = None
    # the client named no max_tokens: `sampling` holds the rest of the context, which
    # admission control does not count as the request's working set (scheduler/programs.py)
    max_new_tokens_defaulted: bool = False
    # an embedding request (/v1/embeddings, /encode): prefill only (`sampling` has
    # max_new_tokens 0), answered with the prompt's hidden states pooled by --pooling
    embed: bool = False
    # LoRA: the loaded adapter it runs with (an id from LoadLoraReq's answer; 0: the base model)
    lora_id: int = 0


class AbortReq(msgspec.Struct, tag=True):
    rid: str


class OpenSessionReq(msgspec.Struct, tag=True):
    """/open_session (answered by a ControlResp: data {"session_id"} or {"error", "status"})."""

    call_id: int
    session_id: str | None = None  # None: the scheduler picks one
    ttl_s: float | None = None  # None: --session-ttl-s


class CloseSessionReq(msgspec.Struct, tag=True):
    """/close_session (answered by a ControlResp like OpenSessionReq)."""

    call_id: int
    session_id: str


class ToolPauseReq(msgspec.Struct, tag=True):
    """These finished requests' answers hold tool calls (parsed on the HTTP side): pin their
    KV for the tool-pause grace period. No answer."""

    rids: list[str]


class KvHintAction(msgspec.Struct):
    """One action of a `kv_hints` envelope (SGLang RFC #27574's hint kinds, #36224's
    envelope): retain, prefetch or release the KV of one program."""

    action_id: str
    action_type: str  # "retain" | "prefetch" | "release" (scheduler/prefetch.py)
    ttl_s: float | None = None  # the payload's ttl_seconds


class KvHintsReq(msgspec.Struct, tag=True):
    """/kv_hints (a ControlResp: data {"results": [{"action_id", "status", "detail"?}]})."""

    call_id: int
    session_id: str  # the program's key
    actions: list[KvHintAction]


class ControlReq(msgspec.Struct, tag=True):
    """Request/reply calls to the scheduler: "flush_cache", "server_info", "health"."""

    call_id: int
    name: str


class LoadLoraReq(msgspec.Struct, tag=True):
    """/load_lora_adapter (a ControlResp: data {"lora_id", "adapters"} or {"error", "status"})."""

    call_id: int
    lora_name: str
    lora_path: str


class UnloadLoraReq(msgspec.Struct, tag=True):
    """/unload_lora_adapter (a ControlResp like LoadLoraReq's)."""

    call_id: int
    lora_name: str


class ControlResp(msgspec.Struct, tag=True):
    call_id: int
    ok: bool
    data: dict[str, Any] = {}


class ReadyMsg(msgspec.Struct, tag=True):
    """A child process announces it is ready (model loaded, buckets compiled) or failed."""

    process: str
    ok: bool = True
    error: str = ""
    info: dict[str, Any] = {}


class ReqOutput(msgspec.Struct):
    """New tokens of one request in one scheduler step (token ids; text comes later)."""

    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Character offset in the decoded output where a matched stop string begins (trim there).
    stop_text_offset: int = -1
    skip_special_tokens: bool = True
    stop_strs: list[str] = []  # the request's stop strings (streamed text holds back a prefix)
    # [logprob, token_id] per new token, and top-k [[logprob, token_id], ...] per new token.
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]]] | None = None
    # Sent once, with the first output of a request that asked for input log-probs.
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[Any] | None = None
    # an embedding request's answer, with its final output: the pooled hidden state (float32,
    # not normalized)
    embedding: list[float] | None = None


class BatchTokenIdOut(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]


class ReqStrOut(msgspec.Struct):
    """Detokenized news of one request in one step: only what is new since its previous
    message (the receiver accumulates; `ResponseAccumulator`), plus what the API reports.

    The text so far is `(previous text)[:text_cut] + new_text` (`text_cut` -1: no cut). A cut
    happens only in a final message, when a stop match (`stop_regex`) begins inside text that an
    earlier message already delivered.
    """

    rid: str
    new_text: str  # output text since the previous message (stop strings trimmed when finished)
    new_output_ids: list[int]  # output token ids since the previous message
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text_cut: int = -1
    output_token_logprobs: list[list[Any]] | None = None  # new entries since the last message
    output_top_logprobs: list[Any] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[Any] | None = None
    embedding: list[float] | None = None  # as in ReqOutput


class BatchStrOut(msgspec.Struct, tag=True):
    outputs: list[ReqStrOut]


# ---- tensor parallelism: the leader's runner calls, replayed by every follower rank -------------
class SeqStepMsg(msgspec.Struct, array_like=True):
    """One `executor.step.SeqStep` on the wire. Arrays travel as little-endian bytes (a decode
    step of 64 sequences with long page tables stays one memcpy per array, not 30k ints)."""

    token_ids: bytes  # i64[k]
    prefix_len: int
    pages: bytes  # i64[num_pages]
    sampling: list[float]  # parallel.calls.RUNNER_SAMPLING_FIELDS, in that order
    seed: int
    num_output_tokens: int
    counts_row: int
    counts_reset: bool
    sample_valid: bool
    bitmask: bytes | None  # i32[W]
    return_logprob: bool


class RunnerForward(msgspec.Struct, tag=True):
    """`ModelRunner.forward(mode, steps)`; `seq` numbers every call of the channel."""

    seq: int
    mode: int  # executor.step.ForwardMode
    steps: list[SeqStepMsg]


class RunnerTokenLogprobs(msgspec.Struct, tag=True):
    """`ModelRunner.token_logprobs` on the hidden states of forward call `hidden_seq`."""

    seq: int
    hidden_seq: int
    target_ids: bytes  # i64[n]


class RunnerRowLogits(msgspec.Struct, tag=True):
    """`ModelRunner.row_logits` on the hidden states of forward call `hidden_seq`."""

    seq: int
    hidden_seq: int
    rows: bytes  # i64[n]


class RunnerWarmup(msgspec.Struct, tag=True):
    seq: int


class RunnerShutdown(msgspec.Struct, tag=True):
    """The leader is closing: followers leave their loop and exit cleanly."""

    seq: int


class FollowerHello(msgspec.Struct, tag=True):
    """A follower's first message; the leader answers `LeaderWelcome`."""

    rank: int
    pid: int
    host: str = ""


class LeaderWelcome(msgspec.Struct, tag=True):
    world_size: int


class FollowerReady(msgspec.Struct, tag=True):
    """A follower loaded its weights and is about to join the group's collectives."""

    rank: int


class FollowerFailed(msgspec.Struct, tag=True):
    """A follower's replay raised: it exits, and the leader's next call reports this."""

    rank: int
    error: str


RunnerCall = RunnerForward | RunnerTokenLogprobs | RunnerRowLogits | RunnerWarmup | RunnerShutdown
RunnerMessage = RunnerCall | FollowerHello | LeaderWelcome | FollowerReady | FollowerFailed


class TorchFollowerSpec(msgspec.Struct, tag=True):
    """What a local torch tensor-parallel follower process is started with (JSON on stdin;
    backends/torch/tp_launch.py)."""

    rank: int
    world_size: int
    leader_endpoint: str  # the leader's runner channel
    init_method: str  # torch.distributed rendezvous, "tcp://host:port"
    model_path: str | None
    server_args: dict[str, Any]  # the leader's ServerArgs fields (the runner config follows)
    parent_pid: int
    local_rank: int = 0  # rank on its host: its device index
    ranks_per_node: int = 1  # ranks on its host (they split the host's CPUs)
    log_level: str = "info"
    connect_timeout_s: float = 60.0
    dist_timeout_s: float = 300.0

Message = (TokenizedGenerateReq | AbortReq | ControlReq | ControlResp | ReadyMsg
           | BatchTokenIdOut | BatchStrOut | OpenSessionReq | CloseSessionReq | ToolPauseReq
           | LoadLoraReq | UnloadLoraReq | KvHintsReq)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_runner_decoder = msgspec.msgpack.Decoder(RunnerMessage)


def encode(msg: Message | RunnerMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


def decode_runner(data: bytes) -> RunnerMessage:
    """A message of the tensor-parallel runner channel (sgl_tpu/parallel)."""
    return _runner_decoder.decode(data)
