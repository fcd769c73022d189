"""What a request's output must match: a JSON schema, any JSON object, one of some
strings, a regex or an EBNF grammar (``SamplingParams.structured_output``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from servelab.core.errors import InvalidRequestError

MAX_SPEC_CHARS = 65536
"""The longest JSON schema (as JSON text), regex or grammar a request may give."""
MAX_CHOICES = 1024
"""The most strings a ``choice`` constraint may list."""
MAX_CHOICE_CHARS = 4096
"""The longest string of a ``choice`` constraint."""
KINDS = ("json", "json_object", "choice", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """Exactly one constraint on the generated text.

    ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value that
    validates against it. ``json_object``: any JSON object. ``choice``: exactly one of
    these strings. ``regex``: a full match of this regular expression. ``grammar``: an
    EBNF grammar (GBNF: ``root ::= ...``) as xgrammar reads it. Once the constraint is
    complete only EOS (or a ``stop_token_ids`` token) may follow. ``param``: the request
    field the constraint came from, which errors name (the OpenAI server sets
    ``response_format`` or ``guided_regex``, ...). Specs longer than ``MAX_SPEC_CHARS``,
    more than ``MAX_CHOICES`` choices or choices longer than ``MAX_CHOICE_CHARS`` are
    refused.
    """

    json: str | dict | None = None
    json_object: bool = False
    choice: tuple[str, ...] | None = None
    regex: str | None = None
    grammar: str | None = None
    param: str = "structured_output"

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(self.param, f"give exactly one of {', '.join(KINDS)}; got "
                                                  f"{', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", self._schema_text(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", self._checked_choice(self.choice))
        for kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if text is not None and (not isinstance(text, str) or not text or len(text) > MAX_SPEC_CHARS):
                raise InvalidRequestError(self.param, f"{kind} must be a non-empty string of at most "
                                                      f"{MAX_SPEC_CHARS} characters")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(self.param, f"json_object must be a boolean, got {self.json_object!r}")

    def _schema_text(self, schema: str | dict) -> str:
        """The schema as compact JSON text (property order kept: it is the output's order)."""
        try:
            value = json.loads(schema) if isinstance(schema, str) else schema
            text = json.dumps(value, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(self.param, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(self.param, f"a JSON schema must be an object or a boolean, got {text[:80]}")
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(self.param, f"the JSON schema must be at most {MAX_SPEC_CHARS} characters "
                                                  f"as JSON, got {len(text)}")
        return text

    def _checked_choice(self, choice: object) -> tuple[str, ...]:
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not 1 <= len(choice) <= MAX_CHOICES:
            raise InvalidRequestError(self.param, f"choice must be a list of 1 to {MAX_CHOICES} strings")
        for item in choice:
            if not isinstance(item, str) or not 1 <= len(item) <= MAX_CHOICE_CHARS:
                raise InvalidRequestError(self.param, f"every choice must be a string of 1 to {MAX_CHOICE_CHARS} "
                                                      f"characters, got {item!r:.80}")
        return tuple(choice)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
