"""Maps the engine's delta outputs of one API call onto OpenAI choices."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from servelab.core.outputs import Logprob, RequestOutput


@dataclass
class ChoiceDelta:
    """What one engine output adds to one choice.

    ``finish_reason`` is set on the choice's last delta only, so it reaches the client
    exactly once; ``first`` marks the choice's first delta (where chat sends the role and
    completions echo the prompt).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool

    def worth_sending(self) -> bool:
        """True when a streamed chunk for this delta carries anything."""
        return bool(self.text or self.finish_reason or (self.token_ids and self.logprobs is not None))


@dataclass
class Choice:
    """A whole choice, accumulated from its deltas (non-streamed responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChoiceTracker:
    """Choice ``i * n + k`` is completion ``k`` of the API call's prompt ``i``.

    ``update`` turns an engine output into per-choice deltas, dropping what follows a
    choice's finish; ``collect=True`` also accumulates whole choices. Counts usage, and
    keeps each prompt's ``prompt_logprobs`` (with its token ids) when the engine sends them.
    ``returns_tokens=False`` (``max_tokens=0``): the tokens the engine generated are dropped
    and each choice finishes with ``length``.
    """

    def __init__(self, request_ids: list[str], n: int, prompt_tokens: int, collect: bool = False,
                 returns_tokens: bool = True):
        self.n = n
        self.returns_tokens = returns_tokens
        self._base = {request_id: i * n for i, request_id in enumerate(request_ids)}
        self._started: set[int] = set()
        self._finished: set[int] = set()
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.choices: dict[int, Choice] | None = {} if collect else None
        self.prompt_logprobs: dict[int, list] = {}
        self.prompt_token_ids: dict[int, list[int]] = {}

    @property
    def num_choices(self) -> int:
        """Choices in the response."""
        return len(self._base) * self.n

    def update(self, output: RequestOutput) -> list[ChoiceDelta]:
        """The deltas ``output`` brings, in choice order."""
        base = self._base[output.request_id]
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[base // self.n] = output.prompt_logprobs
            self.prompt_token_ids[base // self.n] = output.prompt_token_ids
        deltas = []
        for completion in output.outputs:
            index = base + completion.index
            if index in self._finished:
                continue
            finish = completion.finish_reason
            if finish is not None:
                self._finished.add(index)
            first = index not in self._started
            self._started.add(index)
            if self.returns_tokens:
                delta = ChoiceDelta(index, completion.text, list(completion.token_ids), completion.logprobs, finish,
                                    completion.stop_reason if finish else None, first)
            else:
                delta = ChoiceDelta(index, "", [], None if completion.logprobs is None else [],
                                    "length" if finish else None, None, first)
            self.completion_tokens += len(delta.token_ids)
            if self.choices is not None:
                self._collect(delta)
            deltas.append(delta)
        return deltas

    def _collect(self, delta: ChoiceDelta) -> None:
        choice = self.choices.setdefault(delta.index, Choice(delta.index))
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + list(delta.logprobs)
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason

    def collected(self) -> list[Choice]:
        """Every choice in index order (after the stream ended)."""
        return [self.choices.get(i, Choice(i)) for i in range(self.num_choices)]

    def usage(self) -> dict:
        """The OpenAI ``usage`` object."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def best_choices(choices: list[Choice], candidates: int, n: int) -> list[Choice]:
    """Of each prompt's ``candidates`` choices (consecutive, as ``ChoiceTracker`` numbers
    them), the ``n`` with the highest log probability per token, renumbered ``i * n + k``
    in that order (OpenAI's ``best_of``). Choices need the sampled tokens' logprobs."""
    def per_token(choice: Choice) -> float:
        if not choice.token_ids:
            return float("-inf")
        return sum(entry[token].logprob for token, entry in zip(choice.token_ids, choice.logprobs)) / len(choice.token_ids)

    best = []
    for start in range(0, len(choices), candidates):
        ranked = sorted(choices[start:start + candidates], key=per_token, reverse=True)[:n]
        for k, choice in enumerate(ranked):
            best.append(replace(choice, index=start // candidates * n + k))
    return best
