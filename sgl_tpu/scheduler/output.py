"""Output assembly: a request's new tokens of one step -> the `ReqOutput` the detokenizer (or
the in-process Engine) receives. Token log-probs are `[logprob, token_id]`, top log-probs a
list of those per token; input log-probs ride along once, with the request's first output."""

from __future__ import annotations

from sgl_tpu.executor.step import StepResult
from sgl_tpu.messages import ReqOutput
from sgl_tpu.scheduler import finish
from sgl_tpu.scheduler.req import Req

LogprobEntries = tuple[list[list] | None, list | None]  # (token entries, top entries)


def token_logprobs(req: Req, result: StepResult, row: int, token: int) -> LogprobEntries:
    """The entries of `token`, sampled at `row` of `result`, if the request asked for them."""
    if not req.return_logprob:
        return None, None
    k = req.top_logprobs_num
    tops = [[[float(result.top_logprobs[row, c]), int(result.top_ids[row, c])]
             for c in range(k)]] if k else None
    return [[float(result.logprobs[row]), token]], tops


def make_output(req: Req, new_ids: list[int], logprobs: LogprobEntries = (None, None)
                ) -> ReqOutput:
    lp, tops = logprobs
    out = ReqOutput(
        rid=req.rid, new_token_ids=new_ids, finished=req.finished,
        finish_reason=req.finish_reason, prompt_tokens=req.prompt_len,
        completion_tokens=len(req.output_ids) - len(req.draft),
        cached_tokens=req.cached_tokens,
        stop_text_offset=req.stop_text_offset,
        skip_special_tokens=req.sampling.skip_special_tokens,
        stop_strs=[] if req.sampling.no_stop_trim else list(req.sampling.stop),
        output_token_logprobs=lp, output_top_logprobs=tops)
    if req.return_logprob and not req.input_logprobs_sent:
        out.input_token_logprobs = req.input_token_logprobs
        out.input_top_logprobs = req.input_top_logprobs
        req.input_logprobs_sent = True
    return out


def error_output(rid: str, prompt_len: int, message: str) -> ReqOutput:
    """A request refused before it ran (bad parameters, a grammar that failed): a 400."""
    return ReqOutput(rid=rid, new_token_ids=[], finished=True,
                     finish_reason=finish.abort(message, 400), prompt_tokens=prompt_len)
