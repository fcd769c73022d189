"""The structured output fields of both generation endpoints: OpenAI's
``response_format`` and vLLM's ``guided_json`` / ``guided_choice`` / ``guided_regex`` /
``guided_grammar``, turned into one ``StructuredOutputParams``."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from servelab.core.errors import InvalidRequestError
from servelab.core.structured_output import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputParams

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
