"""Log probabilities in the two OpenAI formats.

Entries come from the engine: per generated token, a dict of token id to ``Logprob``
holding the sampled token and the top-``k`` alternatives, with ``decoded_token`` filled
by the engine process. Logprobs are of the model's raw distribution; ``-inf`` is sent
as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

from typing import Sequence

from servelab.core.outputs import Logprob

FLOOR = -9999.0


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, FLOOR)


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else ""


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]],
                        text_offset: int) -> tuple[dict, int]:
    """The ``choices[].logprobs`` of ``/v1/completions`` (tokens, token_logprobs,
    top_logprobs, text_offset) and the text offset after these tokens."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        tokens.append(_text(chosen))
        values.append(_value(chosen))
        top: dict[str, float] = {}
        for lp in sorted(entry.values(), key=lambda lp: lp.rank):
            top.setdefault(_text(lp), _value(lp))  # distinct ids may decode alike: keep the likelier
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(_text(chosen))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, text_offset


def echo_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                  first_token_text: str) -> tuple[dict, int]:
    """The prompt's part of an echoed ``/v1/completions`` choice's logprobs: every prompt
    token, the first with no logprob (null, as it has no context), and the text offset
    after the prompt."""
    rest, offset = completion_logprobs(prompt_token_ids[1:], entries[1:], len(first_token_text))
    return {"tokens": [first_token_text, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}, offset


def joined_logprobs(first: dict, second: dict) -> dict:
    """Two ``/v1/completions`` logprobs objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(entries: Sequence[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` list: per prompt token null (the first) or token id ->
    ``{"logprob", "rank", "decoded_token"}``."""
    return [None if entry is None else
            {str(lp.token_id): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": _text(lp)}
             for lp in entry.values()} for entry in entries]


def _chat_token(logprob: Logprob) -> dict:
    text = _text(logprob)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_logprobs: int) -> dict:
    """The ``choices[].logprobs`` of ``/v1/chat/completions``: ``{"content": [...]}``
    with the ``top_logprobs`` most likely tokens at each position."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        item = _chat_token(entry[token_id])
        ranked = sorted((lp for lp in entry.values() if lp.rank <= top_logprobs), key=lambda lp: lp.rank)
        item["top_logprobs"] = [_chat_token(lp) for lp in ranked[:top_logprobs]]
        content.append(item)
    return {"content": content}
