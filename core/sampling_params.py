"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from servelab.core.errors import InvalidRequestError
from servelab.core.structured_output import StructuredOutputParams

MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for per token."""
LOGIT_BIAS_LIMIT = 100.0
"""The largest magnitude of a ``logit_bias`` value; larger ones are clamped to it."""


@dataclass
class SamplingParams:
    """How one request is decoded and when it stops.

    temperature 0 means greedy (argmax). ``top_k`` 0 or -1 disables top-k; ``top_p`` 1
    and ``min_p`` 0 disable nucleus and min-p filtering. Penalties follow the OpenAI
    (presence/frequency) and CTRL (repetition) definitions. ``n`` sequences are generated
    per prompt; with ``use_beam_search`` the ``n`` best of ``best_of`` beams are returned.
    ``logit_bias`` maps token ids to values added to their logits before sampling, as in
    the OpenAI API; values are clamped to [-100, 100] (-100 bans a token in practice).
    ``logprobs`` / ``prompt_logprobs``: how many most likely alternatives to return with each
    generated / prompt token's own log probability (0: the token's alone; None: none).
    Prompt logprobs are computed in the prefill pass, so such a request skips the prefix
    cache.
    ``structured_output`` constrains the text to a JSON schema, a choice, a regex or a
    grammar (``StructuredOutputParams``); it needs ``decoding=sampling`` or ``greedy``.
    ``stop_strings``, ``greedy``, ``needs_penalties`` and ``plain_argmax`` are derived on construction.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutputParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    greedy: bool = field(init=False, repr=False)
    """True when this request takes the argmax token at every step."""
    needs_penalties: bool = field(init=False, repr=False)
    """True when any presence, frequency or repetition penalty is active."""
    plain_argmax: bool = field(init=False, repr=False)
    """True when the token is the argmax of the raw logits and nothing else is asked of a
    step's logits: greedy, no logit bias, min_tokens, penalties, grammar or logprobs."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(s for s in (self.stop or []) if s)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self.greedy = self.temperature == 0.0 or self.top_k == 1
        self.needs_penalties = (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                                or self.repetition_penalty != 1.0)
        self.plain_argmax = (self.greedy and not self.logit_bias and not self.min_tokens and not self.needs_penalties
                             and self.structured_output is None and self.logprobs is None)
        if self.logit_bias:
            self.logit_bias = {token: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
                               for token, value in self.logit_bias.items()}

    def _validate(self) -> None:
        def fail(name: str, message: str) -> None:
            raise InvalidRequestError(name, message)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            fail("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.temperature < 0.0:
            fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}")
            for token, value in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    fail("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
                if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
                    fail("logit_bias", f"values must be numbers, got {value!r} for token {token}")
        if self.use_beam_search and self.temperature != 0.0:
            fail("temperature", "beam search is deterministic: temperature must be 0")
        self._validate_structured_output()

    def _validate_structured_output(self) -> None:
        spec = self.structured_output
        if spec is None:
            return
        if not isinstance(spec, StructuredOutputParams):
            raise InvalidRequestError("structured_output", f"must be a StructuredOutputParams, got {spec!r:.80}")
        if self.use_beam_search:
            raise InvalidRequestError(spec.param, "structured output cannot be combined with beam search")
        if self.min_tokens:
            raise InvalidRequestError("min_tokens", "must be 0 with structured output (the constraint decides "
                                                    f"where the text ends), got {self.min_tokens}")

