"""What a decoding strategy hands back for one step (``DecodeResult``): the tokens the
scheduler applies."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.core.outputs import Logprob


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """A step's tokens per sampling request (1 .. k+1 each), in ``DecodeBatch`` order:
    what the scheduler applies in ``update_from_output``.

    ``logprobs[i][j]``: for token j of request i, token id -> Logprob (None when no request
    asked for logprobs; an empty dict for requests that did not ask).
    ``num_draft_tokens[i]`` / ``num_accepted_drafts[i]``: drafts verified for request i
    and how many of them it kept (None without speculation).
    ``accepted_nodes[i]``: the draft nodes request i kept, root to leaf, when its drafts
    were a token tree (None for chains: the first ``num_accepted_drafts[i]``).
    ``accepted_ranks[i]``: the rank among its drafted siblings (0: the first) of each
    node request i kept, root to leaf, then -1 when the target's token after them was
    none of the next depth's drafts (nothing more when the kept path ends at a leaf):
    one entry per depth the verification reached with drafts to try (None: not reported).
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]]] | None = None
    num_draft_tokens: tuple[int, ...] | None = None
    num_accepted_drafts: list[int] | None = None
    accepted_nodes: list[list[int]] | None = None
    accepted_ranks: list[list[int]] | None = None
