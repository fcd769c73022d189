"""What the engine returns for a request: completions and timing."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one token; ``rank`` is 1 for the most likely token."""

    token_id: int
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    ``logprobs`` holds, per generated token, a dict of token id to ``Logprob`` (the
    sampled token and the top ``SamplingParams.logprobs`` alternatives).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once this sequence stopped."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (seconds on the engine's clock) of a request's life.

    ``token_times[i]`` is when output token i was produced, so TTFT is
    ``token_times[0] - arrival_time`` and the inter-token gaps are the differences.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def first_token_time(self) -> float | None:
        """When the first output token was produced."""
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if not self.token_times else self.token_times[0] - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds between arrival and first scheduling."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Every gap between consecutive output tokens, seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to last token, seconds."""
        return None if not self.token_times else self.token_times[-1] - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class RequestOutput:
    """The state of one prompt's request: its ``n`` completions so far and its timing.

    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` asked for them): per
    prompt token, token id -> ``Logprob`` for the token and its top alternatives, None for
    the first token; a delta output carries them once, with the request's first tokens."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
