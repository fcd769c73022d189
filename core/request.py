"""A request's mutable state as it moves through the engine."""

from __future__ import annotations

import enum

from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Request:
    """One sequence being generated.

    Scheduling is token accounting: ``num_computed_tokens`` of ``num_tokens`` are in the
    KV cache; each step the scheduler grants some of the rest. ``token_ids`` holds the
    prompt followed by the generated tokens. ``forks`` are sibling sequences (``n > 1``)
    that share this request's prompt blocks once its prefill is done. ``prompt_logprobs``
    (when asked for) fills, one prefill chunk at a time, with a dict of token id to
    ``Logprob`` per prompt token; the first token has none (None). ``metadata`` is what
    scheduling policies know of it (priority, tenant, deadline, SLO class);
    ``deadline_time`` its deadline on the engine's clock (None: none); ``cache_salt``
    (None: none) keeps its cached prefix apart from other salts' (``prefix_root``);
    ``lora`` is the ``LoRAAdapter`` it runs with (None: the base model).
    """

    __slots__ = (
        "request_id", "prompt", "token_ids", "num_prompt_tokens", "sampling_params",
        "eos_token_id", "num_computed_tokens", "num_cached_prompt_tokens", "status",
        "finish_reason", "stop_reason", "arrival_time", "first_scheduled_time",
        "token_times", "finished_time", "num_preemptions", "generator", "logprobs",
        "cumulative_logprob", "detokenizer", "stop_text_len", "index", "group_id",
        "spec_proposed", "spec_accepted", "forks", "prompt_logprobs", "metadata", "deadline_time",
        "cache_salt", "lora",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        prompt: str | None = None,
        arrival_time: float = 0.0,
        index: int = 0,
        group_id: str | None = None,
        metadata: RequestMetadata = NO_METADATA,
        deadline_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.generator = None
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.detokenizer = None
        self.stop_text_len: int | None = None
        self.index = index
        self.group_id = group_id if group_id is not None else request_id
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.forks: list[Request] = []
        self.prompt_logprobs: list | None = [None] if sampling_params.prompt_logprobs is not None else None
        self.metadata = metadata
        self.deadline_time = deadline_time
        self.cache_salt: str | None = None
        self.lora = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_sequences(self) -> int:
        """This sequence and the siblings that will fork from it."""
        return 1 + len(self.forks)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs were asked for and some are not computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Record the logprobs of prompt tokens ``first .. first + len(entries) - 1``."""
        del self.prompt_logprobs[first:]
        self.prompt_logprobs.extend(entries)

    @property
    def is_finished(self) -> bool:
        """True once the request stopped for any reason."""
        return self.status is RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while tokens beyond the last one still need computing."""
        return self.num_tokens - self.num_computed_tokens > 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
