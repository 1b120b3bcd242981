"""`allowed_token_ids` and `bad_words` (vLLM's semantics): the host bitmasks of `jaxinfer.engine.token_rules`
against set references, vLLM's tokenization of bad words, and the engine's outputs on the tiny random Llama
(word-level tokenizer: "w5 w6" is two tokens), with and without n-gram speculative decoding; `logit_bias` through
the engine too."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.token_rules import TokenRules, bad_words_token_ids
from jaxinfer.tokenizer import Tokenizer
from tests.jaxinfer.engine.test_engine import Req, assert_idle, run
from tests.jaxinfer.engine.tiny_model import VOCAB_SIZE, make_tiny_model_dir, random_prompts

WORDS = (VOCAB_SIZE + 31) // 32
PROMPTS = random_prompts(4, seed=1, max_len=20)  # + 40 tokens fit max_model_len 64
MAX_TOKENS = 24


def _bits(mask: np.ndarray) -> set[int]:
    """The token ids a packed bitmask allows (numpy reference unpacking, llguidance's layout)."""
    words = mask.view(np.uint32)
    return {32 * w + j for w in range(len(words)) for j in range(32) if (int(words[w]) >> j) & 1}


class _FakeTokenizer:
    """encode() from a table, to pin vLLM's rule for the leading-space variant."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        assert add_bos is False
        return self.table[text]


def test_bad_words_are_tokenized_with_and_without_a_leading_space_as_vllm_does() -> None:
    tok = _FakeTokenizer({"Paris": [10], " Paris": [11],  # another first token, as many tokens: both
                          "New York": [20, 21], " New York": [22, 21],
                          "ab": [30, 31], " ab": [32, 33, 31],  # more tokens with the space: only the plain one
                          "w5": [5], " w5": [5],  # the same first token: once
                          "": [], " ": [40]})
    assert bad_words_token_ids(tok, ["Paris", " New York", "ab", "w5"]) == [[10], [11], [20, 21], [22, 21], [30, 31],
                                                                           [5]]
    assert bad_words_token_ids(tok, ["  Paris"]) == [[10], [11]]  # leading spaces are stripped first


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("rules") / "tiny")


@pytest.fixture(scope="module")
def compile_rules(tiny_dir):
    """(**SamplingParams fields) -> (TokenRules over the tiny tokenizer, the compiled rules of those params)."""
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)

    def make(**kw) -> tuple[TokenRules, object]:
        rules = TokenRules(tokenizer, VOCAB_SIZE, VOCAB_SIZE)
        return rules, rules.compile(SamplingParams(**kw))

    return make


def test_allowed_ids_and_bad_words_make_the_reference_bitmask(compile_rules) -> None:
    rules, compiled = compile_rules(allowed_token_ids=[3, 5, 6, 7, 40, 127], bad_words=["w5", "w6 w7", "w40 w3 w127"])
    rules.add([0, 1], compiled)
    assert not rules.speculates(0) and rules.speculates(2)
    allowed = {3, 6, 7, 40, 127}  # w5 is banned outright
    assert _bits(rules.allowed(0, [], None)) == allowed
    assert _bits(rules.allowed(0, [9, 6], None)) == allowed - {7}  # the output ends with w6: w7 is banned
    assert _bits(rules.allowed(0, [6, 9], None)) == allowed
    assert _bits(rules.allowed(1, [40, 3], None)) == allowed - {127}
    assert _bits(rules.allowed(1, [3], None)) == allowed  # "w40 w3" does not end it
    grammar = np.zeros(WORDS, np.int32)
    grammar[0] = (1 << 3) | (1 << 7) | (1 << 9)
    assert _bits(rules.allowed(0, [6], grammar)) == {3}  # ANDed with the grammar's mask
    assert rules.allowed(2, [6], None) is None and rules.allowed(2, [], grammar) is grammar  # no rules
    rules.forget(0)
    assert rules.allowed(0, [6], None) is None


def test_only_bad_words_allow_everything_else(compile_rules) -> None:
    rules, compiled = compile_rules(bad_words=["w9", "nothing-in-the-vocab"])  # the second is <unk>, id 0
    rules.add([0], compiled)
    assert _bits(rules.allowed(0, [], None)) == set(range(VOCAB_SIZE)) - {9, 0} and rules.speculates(0)
    assert compile_rules()[1] is None


def test_rules_that_leave_no_token_are_refused_naming_the_field(compile_rules) -> None:
    with pytest.raises(ValueError, match=r"^allowed_token_ids with bad_words: the bad words ban every token"):
        compile_rules(allowed_token_ids=[5, 6], bad_words=["w5", "w6"])


def test_a_step_with_no_token_left_raises_naming_the_fields(compile_rules) -> None:
    rules, compiled = compile_rules(allowed_token_ids=[5, 9], bad_words=["w5 w5", "w5 w9"])
    rules.add([0], compiled)
    assert _bits(rules.allowed(0, [9], None)) == {5, 9}
    with pytest.raises(ValueError, match=r"^bad_words leave no token that allowed_token_ids or structured_outputs"):
        rules.allowed(0, [9, 5], None)
    grammar = np.zeros(WORDS, np.int32)
    grammar[0] = 1 << 6
    with pytest.raises(ValueError, match=r"^allowed_token_ids and structured_outputs allow no common token"):
        rules.allowed(0, [], grammar)


# --- through the engine -----------------------------------------------------------------------------------------


def _engine(tiny_dir, spec: dict | None = None) -> Engine:
    return Engine(EngineConfig.create(model=str(tiny_dir), warmup=False, page_size=8, max_num_seqs=4,
                                      max_model_len=64, kv_cache_memory_bytes=1 << 20, speculative_config=spec))


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Engine:
    return _engine(tiny_dir)


@pytest.fixture(scope="module")
def tiny_ngram(tiny_dir) -> Engine:
    return _engine(tiny_dir, {"method": "ngram", "num_speculative_tokens": 4})


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})


def _outputs(engine: Engine, reqs: list[Req]) -> dict[str, list[list[int]]]:
    r = run(engine, reqs)
    assert_idle(engine)
    return r.tokens()


def _pairs(ids: list[int]) -> set[tuple[int, int]]:
    return set(zip(ids, ids[1:]))


@pytest.fixture(scope="module")
def baseline(tiny: Engine) -> dict[str, list[int]]:
    out = _outputs(tiny, [Req(f"p{i}", p, _greedy()) for i, p in enumerate(PROMPTS)])
    return {rid: ids[0] for rid, ids in out.items()}


def _word(baseline: dict[str, list[int]]) -> tuple[int, int]:
    """(i, t): the first word token t (no special id) that greedy decoding of PROMPTS[0] emits at i >= 3."""
    return next((i, t) for i, t in enumerate(baseline["p0"]) if i >= 3 and t >= 3)


def _cases(baseline: dict[str, list[int]]) -> list[tuple[Req, str]]:
    """Requests whose unrestricted greedy output breaks the rule they set (so each check can fail)."""
    _, word = _word(baseline)
    i = 4
    a, b = baseline["p1"][i], baseline["p1"][i + 1]  # a pair greedy decoding emits
    allowed = sorted(set(baseline["p2"][:3]) | {7, 8, 9})
    return [(Req("single", PROMPTS[0], _greedy(bad_words=[f"w{word}"])), "single"),
            (Req("multi", PROMPTS[1], _greedy(bad_words=[f"w{a} w{b}"])), "multi"),
            (Req("allowed", PROMPTS[2], SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=40, ignore_eos=True,
                                                        allowed_token_ids=allowed)), "allowed"),
            (Req("forced", PROMPTS[3], _greedy(logit_bias={77: 100.0})), "forced"),
            (Req("never", PROMPTS[0], _greedy(logit_bias={word: -100.0})), "never")]


def _check(out: dict[str, list[list[int]]], baseline: dict[str, list[int]], texts: dict[str, str] | None = None
           ) -> None:
    at, word = _word(baseline)
    assert word not in out["single"][0] and out["single"][0][:at] == baseline["p0"][:at]
    i = 4
    a, b = baseline["p1"][i], baseline["p1"][i + 1]
    assert (a, b) not in _pairs(out["multi"][0])
    assert out["multi"][0][:i + 1] == baseline["p1"][:i + 1] and out["multi"][0][i + 1] != b  # w{a} itself is fine
    allowed = set(baseline["p2"][:3]) | {7, 8, 9}
    assert all(len(c) == 40 and set(c) <= allowed for c in out["allowed"]) and out["allowed"][0] != out["allowed"][1]
    assert out["forced"][0] == [77] * MAX_TOKENS
    assert word not in out["never"][0]


@pytest.fixture(scope="module")
def restricted(tiny: Engine, baseline: dict[str, list[int]]) -> dict[str, list[list[int]]]:
    return _outputs(tiny, [req for req, _ in _cases(baseline)])


def test_the_engine_honours_the_rules(tiny: Engine, baseline: dict[str, list[int]], restricted) -> None:
    assert baseline["p3"] != [77] * MAX_TOKENS and len(set(baseline["p2"][:3]) | {7, 8, 9}) > 3
    _check(restricted, baseline)
    # An unrestricted sampled run of the allowed request leaves the set (so that check can fail too).
    free = _outputs(tiny, [Req("free", PROMPTS[2], SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=40,
                                                                  ignore_eos=True))])["free"]
    assert not set(free[0]) <= set(baseline["p2"][:3]) | {7, 8, 9}


def test_a_request_left_without_a_token_fails_alone(tiny: Engine) -> None:
    failing = SamplingParams(allowed_token_ids=[5], bad_words=["w5 w5"], max_tokens=4)
    r = run(tiny, [Req("stuck", PROMPTS[0], failing), Req("fine", PROMPTS[1], _greedy(max_tokens=4))])
    stuck = r.final["stuck"].outputs[0]
    assert stuck.finish_reason == "error" and stuck.token_ids == [5] and "bad_words leave no token" in stuck.error
    assert stuck.error_kind == "request" and stuck.error.startswith("bad_words")  # no "ValueError:" prefix
    assert r.final["fine"].outputs[0].finish_reason == "length" and len(r.final["fine"].outputs[0].token_ids) == 4
    assert_idle(tiny)


def test_the_bad_word_never_appears_in_the_text(tiny: Engine, baseline: dict[str, list[int]]) -> None:
    word = f"w{_word(baseline)[1]}"
    base = tiny.tokenizer.decode(baseline["p0"])
    assert word in base.split()
    text = run(tiny, [Req("text", PROMPTS[0], _greedy(bad_words=[word]))]).final["text"].outputs[0].text
    assert word not in text.split() and text != base
    a, b = baseline["p1"][4:6]
    pair = f" w{a} w{b} "
    assert pair in f" {tiny.tokenizer.decode(baseline['p1'])} "
    text = run(tiny, [Req("pair", PROMPTS[1], _greedy(bad_words=[pair.strip()]))]).final["pair"].outputs[0].text
    assert pair not in f" {text} "


@pytest.mark.parametrize("word", ["Elwes", "wise old", "wizard"])
def test_bad_words_of_several_bpe_tokens_never_appear_in_smollm2_text(smollm2_llm, word: str) -> None:
    """A real BPE vocabulary: the word (3, 2 and 2 tokens, each with and without a leading space) is in the
    greedy text, and not with it banned."""
    prompt = "Once upon a time, in a small village,"
    variants = bad_words_token_ids(smollm2_llm.engine.tokenizer, [word])
    assert len(variants) == 2 and all(len(v) >= 2 for v in variants)
    free = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    banned = smollm2_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, bad_words=[word]))
    assert word in free and word not in banned[0].outputs[0].text


def test_speculative_decoding_gives_the_same_tokens_and_honours_the_rules(tiny_ngram: Engine,
                                                                          baseline: dict[str, list[int]],
                                                                          restricted) -> None:
    """n-gram drafts are verified with the masks and bias (lossless: the same tokens as without speculation);
    sequences with a bad word of several tokens are left out of speculation."""
    cases = _cases(baseline)
    stats = tiny_ngram.spec_policy.stats
    drafts = stats.num_draft_tokens
    out = _outputs(tiny_ngram, [req for req, _ in cases if req.rid != "multi"])
    assert stats.num_draft_tokens > drafts  # drafts were verified
    drafts = stats.num_draft_tokens
    out |= _outputs(tiny_ngram, [req for req, _ in cases if req.rid == "multi"])
    assert stats.num_draft_tokens == drafts  # no drafts for the multi-token bad word
    assert out == restricted
    _check(out, baseline)
