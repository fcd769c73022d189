"""StructuredOutputParams and the xgrammar-backed GrammarConstraints, on the toy tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from servelab import InvalidRequestError, SamplingParams, StructuredOutputParams
from servelab.checkpoints.toy import byte_level_tokenizer
from servelab.core.request import Request
from servelab.core.structured_output import MAX_CHOICES, MAX_SPEC_CHARS
from servelab.plugins.decoding.structured_output import GrammarConstraints, choice_grammar

TOKENIZER = byte_level_tokenizer()
EOS = TOKENIZER.eos_token_id
VOCAB = len(TOKENIZER) + 3   # the model's vocabulary may be wider than the tokenizer's


def token(text: str) -> int:
    (token_id,) = TOKENIZER.encode(text, add_special_tokens=False)
    return token_id


def request(spec: StructuredOutputParams | None, rid: str = "r", **params) -> Request:
    return Request(rid, [token("a")], SamplingParams(structured_output=spec, **params), EOS)


def allowed(constraints: GrammarConstraints, requests: list[Request]) -> list[set[int]]:
    logits = torch.zeros(len(requests), VOCAB)
    constraints.apply(logits, requests)
    return [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]


@pytest.fixture
def constraints() -> GrammarConstraints:
    return GrammarConstraints(SimpleNamespace(tokenizer=TOKENIZER, vocab_size=VOCAB))


def test_params_take_exactly_one_constraint_and_name_their_field():
    with pytest.raises(InvalidRequestError, match="exactly one.*got none") as err:
        StructuredOutputParams()
    assert err.value.field == "structured_output"
    with pytest.raises(InvalidRequestError, match="got json, regex") as err:
        StructuredOutputParams(json={}, regex="a", param="guided_regex")
    assert err.value.field == "guided_regex"
    schema = StructuredOutputParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert schema.json == '{"type":"object","properties":{"b":{},"a":{}}}' and schema.kind == "json"
    assert StructuredOutputParams(choice=["x", "y"]).choice == ("x", "y")


@pytest.mark.parametrize("fields, phrase", [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "must be an object or a boolean"),
    ({"json": {"enum": ["x" * MAX_SPEC_CHARS]}}, f"at most {MAX_SPEC_CHARS}"),
    ({"choice": []}, f"1 to {MAX_CHOICES} strings"),
    ({"choice": "yes"}, "list of 1 to"),
    ({"choice": ["a", ""]}, "every choice"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, f"at most {MAX_SPEC_CHARS}"),
    ({"grammar": ""}, "non-empty string"),
])
def test_params_limits(fields, phrase):
    with pytest.raises(InvalidRequestError, match=phrase):
        StructuredOutputParams(**fields)


def test_sampling_params_refuse_beam_search_and_min_tokens():
    spec = StructuredOutputParams(regex="a+")
    with pytest.raises(InvalidRequestError, match="beam search") as err:
        SamplingParams(structured_output=spec, use_beam_search=True, temperature=0)
    assert err.value.field == "structured_output"
    with pytest.raises(InvalidRequestError, match="min_tokens: must be 0"):
        SamplingParams(structured_output=spec, min_tokens=2)
    with pytest.raises(InvalidRequestError, match="structured_output: must be a StructuredOutputParams"):
        SamplingParams(structured_output={"regex": "a"})


@pytest.mark.parametrize("fields, phrase", [
    ({"json": {"type": "nope"}}, "invalid JSON schema: Unsupported type"),
    ({"regex": "(a"}, "invalid regex: Regex parsing error"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar: EBNF parser error"),
])
def test_invalid_specs_are_refused_naming_the_field(constraints, fields, phrase):
    with pytest.raises(InvalidRequestError, match=phrase) as err:
        constraints.compile(StructuredOutputParams(**fields, param="guided_x"))
    assert err.value.field == "guided_x" and "/project/" not in str(err.value)


def test_compiled_grammars_are_cached(constraints):
    spec = StructuredOutputParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    constraints.compile(spec)
    size = constraints._compiler.get_cache_size_bytes()
    for _ in range(3):
        constraints.compile(StructuredOutputParams(json=spec.json))
    assert constraints._compiler.get_cache_size_bytes() == size > 0


def test_choice_grammar_escapes_quotes_and_newlines(constraints):
    choices = ['say "hi"', "back\\slash", "two\nlines"]
    assert choice_grammar(choices) == r'root ::= "say \"hi\"" | "back\\slash" | "two\nlines"'
    constraints.compile(StructuredOutputParams(choice=choices))


def test_masks_follow_each_sequence_and_end_with_eos(constraints):
    spec = StructuredOutputParams(choice=["yes", "no"])
    first, second, free = request(spec, "0"), request(spec, "1"), request(None, "2")
    masks = allowed(constraints, [first, second, free])
    assert masks[0] == masks[1] == {token("y"), token("n")}
    assert masks[2] == set(range(VOCAB))   # an unconstrained row is untouched
    first.token_ids.append(token("y"))     # what the scheduler appends; the matcher catches up
    second.token_ids.append(token("n"))
    masks = allowed(constraints, [second, first])
    assert masks == [{token("o")}, {token("e")}]
    second.token_ids.append(token("o"))
    assert allowed(constraints, [second]) == [{EOS}]      # complete: only EOS may follow
    second.token_ids.append(EOS)                           # ignore_eos keeps going: still only EOS
    assert allowed(constraints, [second]) == [{EOS}]
    assert constraints.num_tracked == 2


def test_stop_token_ids_may_end_a_complete_grammar(constraints):
    stop = token("!")
    sequence = request(StructuredOutputParams(regex="ab"), stop_token_ids=[stop])
    sequence.token_ids += [token("a"), token("b")]
    assert allowed(constraints, [sequence]) == [{EOS, stop}]


def test_finished_requests_are_skipped_and_released(constraints):
    sequence = request(StructuredOutputParams(regex="[0-9]+"))
    allowed(constraints, [sequence])
    assert constraints.num_tracked == 1
    constraints.release(sequence)
    constraints.release(sequence)
    sequence.finish_reason = "abort"
    sequence.status = sequence.status.FINISHED
    assert allowed(constraints, [sequence]) == [set(range(VOCAB))]
    assert constraints.num_tracked == 0


def test_no_tokenizer_is_a_clear_error():
    constraints = GrammarConstraints(SimpleNamespace(tokenizer=None, vocab_size=10))
    with pytest.raises(InvalidRequestError, match="needs a model with a tokenizer"):
        constraints.compile(StructuredOutputParams(regex="a"))
