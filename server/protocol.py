"""Request bodies of the OpenAI-compatible API (pydantic; unknown fields are rejected),
with the structured output fields of both generation endpoints: OpenAI's
``response_format`` and vLLM's ``guided_json`` / ``guided_choice`` / ``guided_regex`` /
``guided_grammar``, turned into one ``StructuredOutputParams``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator
from typing_extensions import Annotated

from servelab.core.errors import InvalidRequestError
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import MAX_LOGPROBS, SamplingParams
from servelab.core.structured_output import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputParams

TENANT_HEADER = "X-Servelab-Tenant"
"""The header naming the tenant of a request whose body has no ``user``."""
SCHEMA_LIMIT = f"at most {MAX_SPEC_CHARS} characters as JSON"
Choice = Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema`` (OpenAI's shape). The output always validates
    against ``schema``, whatever ``strict`` says."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="The schema's name (1 to 64 of a-z A-Z 0-9 _ -).")
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema", description=f"A JSON schema, {SCHEMA_LIMIT}.")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object)
    or ``json_schema`` (the ``json_schema.schema`` it gives)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StructuredOutputFields(BaseModel):
    """The request fields that constrain the output; at most one may be given."""

    response_format: Optional[ResponseFormat] = Field(
        None, description="OpenAI: {type: json_object} or {type: json_schema, json_schema: {name, schema, strict}} "
                          f"constrain the output to JSON (a schema {SCHEMA_LIMIT}); {{type: text}} does not.")
    guided_json: Optional[Union[str, dict[str, Any]]] = Field(
        None, description=f"vLLM extension: a JSON schema the output validates against, {SCHEMA_LIMIT}.")
    guided_choice: Optional[list[Choice]] = Field(
        None, min_length=1, max_length=MAX_CHOICES,
        description=f"vLLM extension: the output is exactly one of these 1 to {MAX_CHOICES} strings "
                    f"(each 1 to {MAX_CHOICE_CHARS} characters).")
    guided_regex: Optional[str] = Field(
        None, min_length=1, max_length=MAX_SPEC_CHARS,
        description="vLLM extension: the output is a full match of this regular expression.")
    guided_grammar: Optional[str] = Field(
        None, min_length=1, max_length=MAX_SPEC_CHARS,
        description="vLLM extension: the output is a sentence of this EBNF (GBNF) grammar, rule root::=.")

    def structured_output(self) -> StructuredOutputParams | None:
        """The one constraint the request gives (None without any); ``InvalidRequestError``
        naming the field when two are given or one is invalid."""
        candidates = (*self._response_format(), ("guided_json", "json", self.guided_json),
                      ("guided_choice", "choice", self.guided_choice), ("guided_regex", "regex", self.guided_regex),
                      ("guided_grammar", "grammar", self.guided_grammar))
        given = [candidate for candidate in candidates if candidate[2] is not None]
        if len(given) > 1:
            raise InvalidRequestError(given[1][0], f"cannot be combined with {given[0][0]}: give at most one "
                                                   f"structured output constraint")
        if not given:
            return None
        param, kind, value = given[0]
        return StructuredOutputParams(**{kind: value}, param=param)

    def _response_format(self) -> tuple[tuple[str, str, Any], ...]:
        """(field, constraint kind, value) of ``response_format``, if it constrains."""
        fmt = self.response_format
        if fmt is None:
            return ()
        if fmt.type != "json_schema" and fmt.json_schema is not None:
            raise InvalidRequestError("response_format.json_schema", "is only allowed with type json_schema")
        if fmt.type == "text":
            return ()
        if fmt.type == "json_object":
            return (("response_format", "json_object", True),)
        if fmt.json_schema is None:
            raise InvalidRequestError("response_format.json_schema", "is required with type json_schema")
        return (("response_format.json_schema.schema", "json", fmt.json_schema.schema_),)


Prompt = Union[str, list[int]]


class StrictModel(BaseModel):
    """A request body: unknown fields are an error (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    """``include_usage``: send a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class GenerationRequest(StrictModel, StructuredOutputFields):
    """Fields shared by completions and chat completions.

    OpenAI fields plus the extensions vLLM accepts (``top_k``, ``min_p``,
    ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
    ``include_stop_str_in_output``, ``skip_special_tokens``) and structured output
    (``response_format``, ``guided_*``: ``StructuredOutputFields``). Values are checked
    by ``SamplingParams``, which names the offending field. Scheduling fields
    (``RequestMetadata``, read by ``policy=...``): ``priority`` (vLLM's; lower is served
    first), ``user`` (OpenAI's; the tenant), ``deadline`` (Unix seconds) and ``slo_class``;
    ``cache_salt`` keeps the request's cached prefix apart from other salts'.
    """

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    priority: StrictInt = Field(0, description="vLLM extension: an integer in [-1000, 1000]; lower is served "
                                               "first (policy=priority).")
    deadline: Optional[StrictFloat] = Field(None, description="servelab extension: when the whole response is "
                                                              "due, in seconds since the Unix epoch.")
    slo_class: Optional[str] = Field(None, description="servelab extension: one of the engine's slo_classes "
                                                       "(first-token and per-token targets).")
    cache_salt: Optional[str] = Field(None, description="vLLM extension: prefix caching reuses only blocks cached "
                                                        "under the same salt (1 to 256 characters).")

    @field_validator("deadline", mode="before")
    @classmethod
    def _whole_seconds(cls, value: Any) -> Any:
        """A deadline in whole seconds (a JSON integer) is a number of seconds too."""
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def metadata(self, header_tenant: str | None = None) -> RequestMetadata:
        """The request's scheduling metadata; the tenant is ``user``, else the
        ``X-Servelab-Tenant`` header (``header_tenant``). ``InvalidRequestError`` names the
        field (``user`` or the header for a bad tenant)."""
        source, tenant = ("user", self.user) if self.user is not None else (TENANT_HEADER, header_tenant)
        if tenant is None and self.priority == 0 and self.deadline is None and self.slo_class is None:
            return NO_METADATA
        try:
            return RequestMetadata(self.priority, tenant, self.deadline, self.slo_class)
        except InvalidRequestError as exc:
            if exc.field == "tenant":
                raise InvalidRequestError(source, exc.message) from None
            raise

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "is only allowed when stream is true")
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
        chosen = {name: value for name, value in given.items() if value is not None}  # null = the default
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens, max_tokens=max_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=self._logit_bias(),
            structured_output=self.structured_output(), **chosen)

    def _logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its JSON keys read as token ids."""
        if not self.logit_bias:
            return None
        try:
            return {int(token): value for token, value in self.logit_bias.items()}
        except ValueError:
            bad = next(t for t in self.logit_bias if not t.strip().lstrip("-").isdigit())
            raise InvalidRequestError("logit_bias", f"keys must be token ids, got {bad!r}") from None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either
    (choice ``i * n + k`` is completion ``k`` of prompt ``i``).

    ``echo`` puts the prompt before the completion; with ``logprobs`` the prompt tokens'
    logprobs lead the choice's (the first token has none), and ``max_tokens=0`` returns
    the prompt alone: how evaluation harnesses score text. ``prompt_logprobs`` (vLLM's
    extension) returns them as a ``prompt_logprobs`` list per choice instead."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0, description="tokens to generate; 0: none (with echo: the prompt "
                                                            "and its logprobs alone)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="most likely alternatives returned "
                                                                             "with each token's logprob")
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS, description="return each prompt token's "
                                           "logprob and this many most likely alternatives (prompt_logprobs)")
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[Prompt]:
        """The prompts, one per engine request."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for every prompt of this request."""
        if self.suffix:
            raise InvalidRequestError("suffix", "is not supported by this server")
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        if self.picks_best and self.stream:
            raise InvalidRequestError("best_of", f"best_of={self.best_of} > n={self.n} cannot be streamed: the best "
                                                 f"are known only when every candidate finished")
        prompt_logprobs = self.prompt_logprobs
        if self.echo_logprobs:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        max_tokens = 16 if self.max_tokens is None else max(self.max_tokens, 1)
        params = self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)
        if self.picks_best:   # every candidate, with the logprobs that rank them
            params = replace(params, n=self.best_of, logprobs=self.logprobs or 0)
        return params

    @property
    def generates(self) -> bool:
        """False for ``max_tokens=0``: the engine computes one token, which is not returned."""
        return self.max_tokens != 0

    @property
    def echo_logprobs(self) -> bool:
        """True when the prompt's logprobs lead each choice's logprobs."""
        return self.echo and self.logprobs is not None

    @property
    def picks_best(self) -> bool:
        """True when the server generates ``best_of`` candidates and returns the ``n`` best."""
        return self.best_of is not None and self.best_of > self.n


class TextPart(StrictModel):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat turn; ``content`` is text or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``;
    without either, generation runs to EOS or the context limit."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters for this conversation."""
        if not self.messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if logprobs is not None:
            _check_top_logprobs(logprobs)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, logprobs)


def _check_top_logprobs(value: int) -> None:
    if not 0 <= value <= 20:
        raise InvalidRequestError("top_logprobs", f"must be an integer in [0, 20], got {value}")


class TokenizeRequest(StrictModel):
    """``POST /tokenize``: exactly one of ``prompt`` (text) or ``messages`` (rendered with
    the chat template). ``add_special_tokens`` defaults to false, as for completions."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True

    def check(self) -> None:
        """Raise ``InvalidRequestError`` unless exactly one input is given."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or messages")


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``: token ids back to text."""

    model: Optional[str] = None
    tokens: list[int]


class LoadLoRAAdapterRequest(StrictModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter folder ``lora_path``
    as ``lora_name``; without ``lora_path``, the adapter store's (``lora.store``) adapter
    named ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: Optional[str] = Field(default=None, min_length=1)


class UnloadLoRAAdapterRequest(StrictModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: Optional[str] = None
