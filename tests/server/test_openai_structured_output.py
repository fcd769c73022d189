"""Structured output over HTTP: response_format and guided_* on both endpoints, streamed
or not, with the official client; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re

import openai
import pytest
from server_process import MODEL

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"},
                         "tag": {"enum": ["a", "b"]}},
          "required": ["id", "ok", "tag"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Give me a record."}]


def test_completion_with_a_json_schema(client):
    result = client.completions.create(model=MODEL, prompt="{", max_tokens=100, n=2, seed=1,
                                       extra_body={"response_format": RESPONSE_FORMAT})
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_streamed_chat_with_a_json_schema(client):
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, stream=True,
                                            response_format=RESPONSE_FORMAT)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object_and_streamed_completion_choice(client):
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                            response_format={"type": "json_object"})
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(result.choices[0].message.content), dict)
    else:
        assert result.choices[0].message.content.startswith("{")
    chunks = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, stream=True,
                                       extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("alpha", "beta", "gamma delta")


@pytest.mark.parametrize("field, value, full, cut", [
    ("guided_regex", r"[a-f]{2}-[0-9]{3}", r"[a-f]{2}-[0-9]{3}", None),
    ("guided_grammar", 'root ::= "x=" [0-9]+ ";"', r"x=[0-9]+;", r"x=[0-9]*"),
    ("guided_json", json.dumps({"type": "integer", "minimum": 0}), r"0|[1-9][0-9]*", r"[1-9][0-9]*"),
])
def test_guided_regex_grammar_and_json_on_both_endpoints(client, field, value, full, cut):
    """``cut``: what a text cut by max_tokens may be (None: the match is short enough to finish)."""
    completion = client.completions.create(model=MODEL, prompt="id:", max_tokens=30, temperature=0,
                                           extra_body={field: value})
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                          extra_body={field: value})
    for text, finish in ((completion.choices[0].text, completion.choices[0].finish_reason),
                         (chat.choices[0].message.content, chat.choices[0].finish_reason)):
        assert re.fullmatch(full if finish == "stop" else cut, text), (text, finish)


@pytest.mark.parametrize("fields, param, phrase", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "(a"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "invalid grammar"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "at least 1 item"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex", "cannot be combined with guided_choice"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "must be 0 with structured output"),
])
def test_bad_constraints_are_400_naming_the_field(http, fields, param, phrase):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4})):
        response = http.post(path, json={**body, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and phrase in error["message"], error
        assert error["type"] == "invalid_request_error"


def test_openai_client_raises_for_a_bad_schema_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"guided_regex": "[z-a]"})
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=4).choices[0].text is not None


def test_openapi_documents_the_fields_and_their_limits(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[request]["properties"]
        assert {"response_format", "guided_json", "guided_choice", "guided_regex", "guided_grammar"} <= set(fields)
        choice = next(t for t in fields["guided_choice"]["anyOf"] if t.get("type") == "array")
        assert choice["maxItems"] == 1024 and choice["items"]["maxLength"] == 4096
        assert next(t for t in fields["guided_regex"]["anyOf"] if t.get("type") == "string")["maxLength"] == 65536
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert "schema" in schemas["JSONSchemaFormat"]["required"]
