"""The decoding strategy contract: turn logits into accepted tokens."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any, Sequence

import torch

from servelab.core.decode_result import DecodeResult
from servelab.core.errors import InvalidRequestError
from servelab.core.model import ModelShape
from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from servelab.core.component import ComponentBuilder
    from servelab.core.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The requests that produce tokens this step, in logits-row order.

    ``requests[i]`` owns ``1 + num_draft_tokens[i]`` consecutive logits rows (its last
    token's, then one per draft; a tree's drafts in node order); ``scheduled`` is the whole step
    (a draft model follows it to keep its own cache in step with the target's).
    """

    requests: tuple[Request, ...]
    num_draft_tokens: tuple[int, ...]
    scheduled: SchedulerOutput


@dataclass(frozen=True, slots=True)
class Proposal:
    """Draft tokens per request of a ``DecodeBatch`` (possibly empty lists), as chains or
    as token trees.

    ``parents``: None when each request's drafts are a chain; else ``parents[i][n]`` is
    the draft that draft n of request i continues (-1: the request's last token), every
    parent before its children (``core/token_tree.py``). A tree of N drafts takes N of
    the request's lookahead tokens.
    ``draft_probs``: [sum(len(d)), V] float32: the distribution each draft was drawn from,
    given its earlier siblings (None for deterministic drafters such as n-gram lookup or
    greedy drafts: one-hot). Siblings drawn without replacement from q carry q with the
    earlier siblings removed; drawn with replacement, q itself.
    """

    draft_token_ids: tuple[list[int], ...]
    draft_probs: torch.Tensor | None = None
    parents: tuple[list[int], ...] | None = None


@dataclass(frozen=True, slots=True)
class HiddenStates:
    """The target's last hidden states (its final norm's output, the LM head's input) of
    the tokens one step kept, for a strategy that sets ``reads_hidden_states``.

    ``requests[i]``'s kept tokens sit at positions ``first_positions[i]`` ..
    ``first_positions[i] + counts[i] - 1``, their states in ``states`` [sum(counts),
    hidden] from row ``sum(counts[:i])`` on: every token the step ran for the request (a prefill
    chunk's, a decode step's last token) and the drafts it kept (a tree's kept path, root
    to leaf). The token sampled last has none yet: the next step runs it.
    """

    requests: tuple[Request, ...]
    first_positions: tuple[int, ...]
    counts: tuple[int, ...]
    states: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodingContext:
    """What the engine hands a decoding strategy: the engine's ``registry`` (to build a
    draft model and its attention backend), the target's ``device``, compute ``dtype``,
    ``vocab_size``, ``max_model_len`` and ``tokenizer``, ``attention_config``, the resolved
    config of the target's attention backend (a draft model uses the same), and
    ``runs_model``: False under ``executor=simulated``, where no logits exist and a
    strategy must not load weights (``simulated_acceptance`` stands in for ``accept``).
    ``checkpoint``: the target's ``Checkpoint`` (config and lazy weights), for a strategy
    that reuses the target's weights (an EAGLE head: its embedding and LM head); None
    where the engine gives none."""

    registry: ComponentBuilder
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    tokenizer: Any
    attention_config: Any
    runs_model: bool = True
    checkpoint: Any = None


def lookahead_allowances(output: SchedulerOutput, max_model_len: int, block_size: int | None = None) -> tuple[int, ...]:
    """Draft tokens each sampling request of ``output`` may have verified this step: the
    step's lookahead for a decode grant (one new token after generated ones), cut at
    ``max_model_len``; 0 for the last chunk of a prefill. Given the cache's
    ``block_size``, 0 too for a grant whose blocks do not hold the lookahead slots: a
    request admitted with all but one token cached had none reserved (nor counted in
    the step's token budget)."""
    allowances = []
    for g in output.scheduled:
        if g.samples:
            decoding = g.num_new_tokens == 1 and g.request.num_output_tokens > 0
            allowance = min(output.num_lookahead_tokens, max_model_len - g.request.num_tokens) if decoding else 0
            room = len(g.block_ids) * block_size - g.num_computed_tokens - 1 if block_size is not None else allowance
            allowances.append(max(allowance, 0) if room >= allowance else 0)
    return tuple(allowances)


class DecodingStrategy(abc.ABC):
    """Chooses the next tokens from the model's logits.

    Built as ``cls(config, DecodingContext)``; a constructor raises ``ConfigError`` listing
    every problem of its config. Plain strategies set ``num_lookahead_tokens = 0`` and
    return no proposal; speculative strategies propose up to ``num_lookahead_tokens``
    drafts per request that the target verifies in one forward pass.
    """

    num_lookahead_tokens: int = 0
    #: True when ``propose`` returns token trees (``Proposal.parents``): the executor then
    #: refuses, when the engine is built, what cannot verify trees (a sliding window, ...).
    proposes_trees: bool = False
    #: The shape of the model that drafts, priced by ``executor=simulated`` (None: drafts
    #: cost nothing or there are none).
    draft_model_shape: ModelShape | None = None
    #: True when the strategy reads the target's last hidden states: the executor hands it
    #: those of every step's kept tokens (``observe_hidden_states``), and refuses, when the
    #: engine is built, a setup it cannot take them from (pipeline stages, LoRA).
    reads_hidden_states: bool = False
    #: Model steps an executor that runs ahead may take per scheduled decode step (multi-step
    #: decoding): it feeds each chosen token back for the next step itself, so a decode step
    #: gives each request up to ``decode_steps`` tokens, and the scheduler reserves their
    #: slots as lookahead. 1: one token per scheduled step.
    decode_steps: int = 1
    #: True when ``accept`` answers requests whose params are all ``plain_argmax`` with each
    #: row's first largest logit (``greedy_tokens``): a model may then choose those tokens
    #: itself between its multi-step decode steps.
    takes_plain_argmax: bool = False

    def __init__(self, config: Any, context: DecodingContext | None = None):
        self.config = config
        self.context = context

    def propose(self, batch: DecodeBatch) -> Proposal | None:
        """Draft tokens for the batch, or None."""
        return None

    @abc.abstractmethod
    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """logits: [sum(1 + drafts), V] float32. Returns the tokens each request keeps."""

    def runs_ahead(self, requests: Sequence[Request]) -> bool:
        """True when ``accept`` chooses each of these requests' next tokens from their logits
        alone (no penalty, pending ``min_tokens`` or grammar reads the tokens before), so an
        executor may run further steps on them before the scheduler appends any. False by
        default."""
        return False

    def check_request(self, params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` naming the field if this strategy cannot serve
        ``params``. By default structured output is refused: a strategy that supports it
        masks every row with the request's grammar (``decoding=sampling`` / ``greedy``)."""
        spec = params.structured_output
        if spec is not None:
            why = (f"speculative decoding (num_lookahead_tokens={self.num_lookahead_tokens}) drafts tokens no "
                   f"grammar checked" if self.num_lookahead_tokens else "it does not mask logits with a grammar")
            raise InvalidRequestError(spec.param, f"structured output is not supported by the decoding strategy "
                                                  f"{type(self).__name__}: {why}; use decoding=sampling or greedy")

    def observe_hidden_states(self, hidden: HiddenStates) -> None:
        """Take the target's hidden states of the tokens a step kept; called after
        ``accept`` (after every step that ran a request, sampling or not) when
        ``reads_hidden_states``. Nothing by default."""

    def on_request_finished(self, request: Request) -> None:
        """Release whatever per-request state the strategy keeps (draft caches, ...)."""

    def shutdown(self) -> None:
        """Release what the strategy holds (a draft model, its KV tensors); the engine
        calls it once, at its own shutdown, after every request finished or was aborted.
        Nothing by default."""

    def simulated_acceptance(self, allowances: tuple[int, ...], random: Random) -> list[int] | None:
        """Under ``executor=simulated``: how many of its ``allowances[i]`` drafts request i
        keeps this step (None: the strategy does not speculate)."""
        return None
