"""codi.data.answers: literal parsing, type-strict comparison, the direct target format."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codi.data.answers import (
    NOT_LITERAL,
    answers_match,
    compare_answers,
    direct_target_ids,
    literal_value,
    parse_direct,
    render_direct,
)
from codi.tracing.format import REPR_CUT
from codi.tracing.tokens import ARG_SEP


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("-3", -3), ("1.5", 1.5), ("-inf", -math.inf), ("inf", math.inf), ("True", True), ("None", None),
    ("'a'", "a"), ('"it\'s"', "it's"), (r"'a\nb\\'", "a\nb\\"), ("b'x'", b"x"), ("(1+2j)", 1 + 2j), ("-1j", -1j),
    ("[1, (2, 3)]", [1, (2, 3)]), ("{1: [2], 'k': {3}}", {1: [2], "k": {3}}), ("set()", set()),
    ("frozenset()", frozenset()), ("frozenset({1, 2})", frozenset({1, 2})), ("{frozenset({1}): ()}", {frozenset({1}): ()}),
    ("Ellipsis", NOT_LITERAL), ("...", ...), ("  [1]  ", [1]),
])
def test_literal_value(text, value):
    got = literal_value(text)
    assert got == value and type(got) is type(value)


def test_nan_parses():
    assert math.isnan(literal_value("nan")) and math.isnan(literal_value("[nan]")[0])


@pytest.mark.parametrize("text", [
    "foo", "f(1)", "1 + 1", "2 ** 10", "x.y", "[1, 2", "{[1]}", "{**a}", "set(1)", "frozenset(x=1)", "-'a'",
    "lambda: 0", "", "<Foo object>", "ValueError('x')", "[1, 2, " + REPR_CUT, "'abc" + REPR_CUT, "1" + REPR_CUT,
    "[" * 100_000, "9" * 5000,
])
def test_non_literals(text):
    assert literal_value(text) is NOT_LITERAL


@pytest.mark.parametrize("pred, truth, ok, how", [
    ("{2, 1}", "{1, 2}", True, "literal"),
    ("frozenset({3, 1})", "frozenset({1, 3})", True, "literal"),
    ("{'b': 1, 'a': 2}", "{'a': 2, 'b': 1}", True, "literal"),
    ("[2, 1]", "[1, 2]", False, "literal"),
    ("1", "1.0", False, "literal"),
    ("1", "True", False, "literal"),
    ("1.0", "True", False, "literal"),
    ("[1]", "(1,)", False, "literal"),
    ("{1}", "frozenset({1})", False, "literal"),
    ("set()", "{}", False, "literal"),
    ("nan", "nan", True, "literal"),
    ("[nan, {nan}]", "[nan, {nan}]", True, "literal"),
    ("0.0", "-0.0", True, "literal"),
    ("0.30000000000000004", "0.3", False, "literal"),
    ("1e3", "1000.0", True, "literal"),
    ('"a\'b"', "'a\\'b'", True, "literal"),  # two spellings of one string
    ("'a'", '"a"', True, "literal"),
    ("'a'", "'b'", False, "literal"),
    ("{'k': [1, {2: (3, 4.5)}]}", "{'k': [1, {2: (3, 4.5)}]}", True, "literal"),
    ("{'k': [1, {2: (3, 4.5)}]}", "{'k': [1, {2: (3, 4)}]}", False, "literal"),
    ("ValueError('x')", "ValueError('x')", True, "string"),
    ("ValueError('x')", "ValueError('y')", False, "string"),
    ("[1, 2, " + REPR_CUT, "[1, 2, " + REPR_CUT, True, "string"),
    ("[1, 2, 3]", "[1, 2, " + REPR_CUT, False, "string"),
    ("garbage((", "[1]", False, "string"),
    ("[1]", "garbage((", False, "string"),
])
def test_compare(pred, truth, ok, how):
    assert compare_answers(pred, truth) == type(compare_answers(pred, truth))(ok, how)
    assert answers_match(pred, truth) is ok


def test_none_prediction_never_matches():
    assert not answers_match(None, "None")


@settings(max_examples=60, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=5),
                    lambda kids: st.lists(kids, max_size=3) | st.tuples(kids, kids)
                    | st.dictionaries(st.text(max_size=3), kids, max_size=3)
                    | st.frozensets(st.integers() | st.text(max_size=3), max_size=3),
                    max_leaves=8))
def test_every_repr_of_a_literal_matches_itself(value):
    assert answers_match(repr(value), repr(value))
    assert literal_value(repr(value)) is not NOT_LITERAL


@pytest.mark.parametrize("value", ["6", "'AB!'", "'say \"hi\"\\n'", "{'a': [1, 2]}", "ValueError('x')",
                                   "'naïve ✓'", "[1, 2, " + REPR_CUT, ""])
def test_direct_format_round_trips(value):
    text = render_direct(value)
    assert text.startswith(ARG_SEP)
    assert parse_direct(text) == type(parse_direct(text))(value, "")


def test_direct_target_ids_round_trip_through_a_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from codi.tracing.tokens import add_trace_tokens

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["[1, 2]", "'ab'"], trainers.BpeTrainer(
        vocab_size=280, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, clean_up_tokenization_spaces=False)
    add_trace_tokens(tok)
    ids = direct_target_ids(tok, "{'a': \"b\"}")
    assert ids[0] == tok.convert_tokens_to_ids(ARG_SEP) and ids[-1] == tok.eos_token_id
    text = tok.decode(ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert parse_direct(text).answer == "{'a': \"b\"}"


@pytest.mark.parametrize("text, why", [
    ('"6"', "does not start with"), (ARG_SEP + "6", "not a JSON string"), (ARG_SEP + '"6', "not JSON"),
    (ARG_SEP + '"6" x', "not JSON"), (ARG_SEP, "not JSON"), (ARG_SEP + "[" * 5000, "nested too deep"),
])
def test_parse_direct_rejects_malformed(text, why):
    parsed = parse_direct(text)
    assert parsed.answer is None and why in parsed.error
