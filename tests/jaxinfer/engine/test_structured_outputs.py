"""Structured output through the Python API: JSON schema, any JSON object, regex, choice and grammar constraints
on SmolLM2, checked against independent references (`jsonschema`, `re`), invalid constraints refused naming the
field, and unconstrained rows of the same batch unchanged."""

from __future__ import annotations

import json
import dataclasses
import re

import jsonschema
import pytest

from jaxinfer import SamplingParams
from jaxinfer.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"], "additionalProperties": False}
PROMPT = "Describe a person as JSON with a name, an age and a favourite colour:"


def _chat(llm, content: str, so: dict, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 64), structured_outputs=so, **kw)
    return llm.chat([{"role": "user", "content": content}], params)[0].outputs[0]


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_json_schema_output_parses_and_validates(smollm2_llm, kw):
    out = _chat(smollm2_llm, PROMPT, {"json": SCHEMA}, max_tokens=80, **kw)
    assert out.finish_reason == "stop", out  # the constraint completed and the model ended with EOS
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_choice_and_grammar(smollm2_llm):
    obj = _chat(smollm2_llm, "Give me a JSON object about cats.", {"json_object": True}, temperature=0, max_tokens=60)
    # A free object may run past max_tokens; whole or cut, it is an object's text.
    assert obj.text.lstrip().startswith("{") and (obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict))
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    regex = _chat(smollm2_llm, "Write a US phone number.", {"regex": phone}, temperature=0.8, seed=3)
    assert re.fullmatch(phone, regex.text), regex.text
    choices = ["positive", "negative", "neutral"]
    for text in ("I love this film!", "This was a terrible day."):
        choice = _chat(smollm2_llm, f"Sentiment of: {text}", {"choice": choices}, temperature=0)
        assert choice.text in choices and choice.finish_reason == "stop"
    grammar = 'start: "The answer is " number "."\nnumber: /[0-9]{1,3}/'
    g = _chat(smollm2_llm, "What is 6 times 7?", {"grammar": grammar}, temperature=0)
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", g.text), g.text
    gbnf = 'root ::= "yes" | "no"'  # llama.cpp's format, converted
    assert _chat(smollm2_llm, "Is the sky blue?", {"grammar": gbnf}, temperature=0).text in ("yes", "no")


def test_constrained_and_unconstrained_rows_in_one_batch(smollm2_llm):
    """An unconstrained request's greedy tokens are the same alone and beside constrained ones; every sample of
    a constrained request with n > 1 obeys the constraint."""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = smollm2_llm.generate("The three primary colours are", plain)[0].outputs[0].token_ids
    so = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=12, structured_outputs={"regex": "[a-z]{3,8}"})
    outs = smollm2_llm.generate(["The three primary colours are", "A word:"], [plain, so])
    assert outs[0].outputs[0].token_ids == alone
    assert len(outs[1].outputs) == 3
    for c in outs[1].outputs:
        assert re.fullmatch("[a-z]{3,8}", c.text), c.text


@pytest.mark.parametrize(("so", "match"), [
    ({"json": {"type": "objec"}}, r"structured_outputs\.json is not valid"),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"regex": "("}, r"structured_outputs\.regex is not valid"),
    ({"grammar": "start: undefined_rule"}, r"structured_outputs\.grammar is not valid"),
    ({"choice": []}, r"structured_outputs\.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, r"structured_outputs\.choice\[1\] must be a string"),
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of .* got regex, choice"),
    ({"jsn": {}}, "unknown key 'jsn' \\(did you mean 'json'\\?\\)"),
    ({"regex": "\ud800"}, r"structured_outputs\.regex is not valid Unicode"),
    ("json", "must be a StructuredOutputsParams or a dict"),
])
def test_invalid_constraints_are_refused_naming_the_field(so, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=so)


@pytest.mark.parametrize("regex", ["a{1000000}", "((a{100}){100}){100}"])
def test_a_grammar_that_fails_on_its_first_token_is_refused_at_admission(smollm2_llm, regex):
    """llguidance builds these regexes and fails only when a token is consumed ("too many expressions"): the
    engine probes a copy at admission, so the request is refused naming the field, with a short message, and
    nothing is queued; the next request runs."""
    params = SamplingParams(max_tokens=4, structured_outputs={"regex": regex})  # passes the build-time check
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex cannot be used: lexer error") as e:
        smollm2_llm.generate("hi", params)
    assert len(str(e.value)) <= 400 and "<state>" not in str(e.value)
    assert not smollm2_llm.engine.has_unfinished_requests()
    ok = smollm2_llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]{1,3}"}))
    assert re.fullmatch("[0-9]{1,3}", ok[0].outputs[0].text)


def test_min_tokens_past_a_completed_constraint_fails_that_request_naming_min_tokens(smollm2_llm):
    """The choice completes after one token and then allows only EOS, which min_tokens bans: the request fails
    naming min_tokens (it emitted hidden <|endoftext|> tokens before: an all-banned row sampled id 0, user trial);
    another request of the same batch is untouched."""
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = smollm2_llm.generate("The sky is", plain)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, structured_outputs={"choice": ["no", "yes"]})
    bad, good = smollm2_llm.generate(["Is the sky green?", "The sky is"], [forced, plain])
    (c,) = bad.outputs
    assert c.finish_reason == "error" and c.error.startswith("min_tokens:"), (c.finish_reason, c.error, c.token_ids)
    assert c.error_kind == "request"  # the request's own values: an HTTP 400, not a 500
    assert good.outputs[0].token_ids == alone
    ok = smollm2_llm.generate("Is the sky green?", dataclasses.replace(forced, min_tokens=0))[0].outputs[0]
    assert ok.text in ("no", "yes") and ok.finish_reason == "stop"


def test_params_are_hashable_and_equal_by_value():
    a = SamplingParams(structured_outputs={"json": {"b": 1, "type": "object"}})
    b = SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "object", "b": 1}'))
    assert a == b and hash(a) == hash(b) and a.structured_outputs.kind == "json"


def test_masks_computed_together_equal_those_computed_one_by_one(smollm2_llm):
    """`Grammars.allowed_many` (one parallel llguidance call) gives each matcher the mask `allowed` gives it alone,
    with the matchers in different states, and leaves unconstrained sequence ids out."""
    import numpy as np

    grammars = smollm2_llm.engine.grammars
    ids = list(range(10**9, 10**9 + 6))  # ids no engine sequence has
    regex = SamplingParams(structured_outputs={"regex": "[a-z ]{1,40}"})
    schema = SamplingParams(structured_outputs={"json": SCHEMA})
    rng = np.random.default_rng(0)
    try:
        for i, seq_id in enumerate(ids):
            grammars.add([seq_id], regex if i % 2 else schema)
            for _ in range(i):  # i tokens in: six different states
                mask = grammars.allowed(seq_id)
                allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
                assert grammars.consume(seq_id, int(rng.choice(allowed))) is None
        together = grammars.allowed_many(ids + [-1])
        assert set(together) == set(ids)
        masks = [grammars.allowed(seq_id) for seq_id in ids]
        assert len({m.tobytes() for m in masks}) > 1  # the states differ: the comparison has teeth
        for seq_id, mask in zip(ids, masks):
            np.testing.assert_array_equal(together[seq_id], mask)
    finally:
        for seq_id in ids:
            grammars.forget(seq_id)


# --- with n-gram speculative decoding ---------------------------------------------------------------------------

SPEC_PROMPT = "abcabcabcabcabcabcabcabc"  # n-gram drafts pay on its continuations
CHOICES = ["abcabcabcabcabc", "abcabcxyz", "cab"]


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory):
    """The tiny random chat model (one id per character) with a decoder llguidance reads: an engine without and
    one with n-gram speculation."""
    import tokenizers

    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.engine.engine import Engine
    from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model

    folder = make_tiny_chat_model(tmp_path_factory.mktemp("structured_spec") / "tiny")
    tk = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tk.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()])
    tk.save(str(folder / "tokenizer.json"))
    config = dict(model=str(folder), warmup=False, max_num_seqs=4, max_model_len=512, kv_cache_memory_bytes=4 << 20)
    return (Engine(EngineConfig.create(**config)),
            Engine(EngineConfig.create(**config, speculative_config={"method": "ngram", "num_speculative_tokens": 4})))


def test_constrained_requests_do_not_speculate_and_keep_their_constraint_beside_rows_that_do(tiny_engines):
    """README: speculative decoding is off for constrained requests, the others of the batch still speculate.
    Alone, constrained requests (a regex, greedy; a choice, seeded) verify no drafts; beside an unconstrained
    request whose drafts are verified, they ride in its verify steps and still satisfy their constraints, every
    request with the tokens of an engine without speculation. (Found here: a constrained row's token in a verify
    step was not consumed by its matcher, so the mask fell behind and the output broke the regex.)"""
    from tests.jaxinfer.engine.test_engine import Req, assert_idle, run

    plain, spec = tiny_engines
    stats = spec.spec_policy.stats
    constrained = [Req("regex", SPEC_PROMPT, SamplingParams(temperature=0, max_tokens=40,
                                                            structured_outputs={"regex": "(abc){8}"})),
                   Req("choice", SPEC_PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                                             structured_outputs={"choice": CHOICES}))]
    free = Req("free", SPEC_PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    drafts = stats.num_draft_tokens
    alone = run(spec, constrained).tokens()
    assert stats.num_draft_tokens == drafts  # no drafts for constrained requests
    mixed = run(spec, [free, *constrained])
    assert stats.num_draft_tokens > drafts  # the unconstrained one speculated, in the same steps
    assert_idle(spec)
    assert re.fullmatch("(abc){8}", mixed.final["regex"].outputs[0].text), mixed.final["regex"].outputs[0].text
    assert mixed.final["choice"].outputs[0].text in CHOICES
    assert all(mixed.final[r].outputs[0].finish_reason == "stop" for r in ("regex", "choice"))
    reference = run(plain, [free, *constrained]).tokens()
    assert mixed.tokens() == reference and alone == {r: reference[r] for r in ("regex", "choice")}
