"""Appends sampled tokens to a request and decides whether it stops."""

from __future__ import annotations

from typing import Any

from servelab.core.detokenizer import IncrementalDetokenizer
from servelab.core.outputs import Logprob
from servelab.core.request import Request


class StopChecker:
    """Applies EOS, stop token ids, stop strings, ``max_tokens`` and ``max_model_len``.

    Requests with stop strings (or streamed text) get an ``IncrementalDetokenizer``; a stop
    string ends the request and cuts the text before it (or after it with
    ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def append(self, request: Request, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
               now: float) -> int:
        """Append tokens (with their ``logprobs`` entries when the request asked for them)
        until one stops the request; return how many were kept and set
        ``finish_reason``/``stop_reason`` when it stops."""
        params = request.sampling_params
        max_tokens = params.max_tokens
        keep_logprobs = request.logprobs is not None and logprobs is not None
        for count, token in enumerate(token_ids, start=1):
            request.token_ids.append(token)
            request.token_times.append(now)
            if keep_logprobs:
                entry = logprobs[count - 1]
                request.logprobs.append(entry)
                request.cumulative_logprob += entry[token].logprob
            num_output = request.num_output_tokens
            if request.detokenizer is not None and self._hit_stop_string(request, token):
                return count
            if num_output > params.min_tokens:
                if token == request.eos_token_id and not params.ignore_eos:
                    request.finish_reason = "stop"
                    return count
                if token in params.stop_token_ids:
                    request.finish_reason, request.stop_reason = "stop", token
                    return count
            if (max_tokens is not None and num_output >= max_tokens) or request.num_tokens >= self.max_model_len:
                request.finish_reason = "length"
                return count
        return len(token_ids)

    def attach_detokenizer(self, request: Request) -> None:
        """Give the request incremental text (needed for stop strings and streaming)."""
        if request.detokenizer is None and self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling_params.skip_special_tokens)
            for token in request.output_token_ids:
                detokenizer.add(token)
            request.detokenizer = detokenizer

    def _hit_stop_string(self, request: Request, token: int) -> bool:
        detokenizer = request.detokenizer
        delta = detokenizer.add(token)
        stops = request.sampling_params.stop_strings
        if not delta or not stops or request.num_output_tokens <= request.sampling_params.min_tokens:
            return False
        text = detokenizer.text
        for stop in stops:
            begin = max(0, len(text) - len(delta) - len(stop) + 1)
            found = text.find(stop, begin)
            if found >= 0:
                keep = found + len(stop) if request.sampling_params.include_stop_str_in_output else found
                request.stop_text_len = keep
                request.finish_reason, request.stop_reason = "stop", stop
                return True
        return False
