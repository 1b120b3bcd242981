"""`jaxinfer.request_limits`: the checks every front end shares (text, token ids, chat messages, the model)."""

from __future__ import annotations

import pickle

import pytest

from jaxinfer.request_limits import (CHAT_ROLES, MAX_STOP_TOKEN_IDS, SUPPRESS_WIDTH, MaxTokensBeyondContext,
                                     check_against_model, check_chat, check_text)
from jaxinfer.sampling_params import SamplingParams

VOCAB = 4  # a vocabulary small enough for MAX_STOP_TOKEN_IDS stop ids to cover
EOS = frozenset({0})


def test_min_tokens_with_every_token_banned_is_refused() -> None:
    every = SamplingParams(min_tokens=1, stop_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"min_tokens=1 with stop_token_ids=\[1, 2, 3\] bans every token"):
        check_against_model(every, 2, VOCAB, EOS, max_model_len=64)
    # Generation is possible when one token is left: EOS not banned (ignore_eos), no min_tokens, or fewer stop ids.
    check_against_model(SamplingParams(min_tokens=1, stop_token_ids=[1, 2, 3], ignore_eos=True), 2, VOCAB, EOS, 64)
    check_against_model(SamplingParams(stop_token_ids=[1, 2, 3]), 2, VOCAB, EOS, 64)
    check_against_model(SamplingParams(min_tokens=1, stop_token_ids=[1, 2]), 2, VOCAB, EOS, 64)
    # Ids the sampler never picks (past the tokenizer's vocabulary) need no ban for generation to be impossible.
    with pytest.raises(ValueError, match="bans every token the model can sample"):
        check_against_model(SamplingParams(min_tokens=1, stop_token_ids=[1, 2]), 2, VOCAB, EOS, 64,
                            sampled_vocab_size=3)


def test_more_banned_ids_than_the_sampler_holds_are_refused() -> None:
    eos = frozenset(range(1000, 1000 + SUPPRESS_WIDTH))  # a tokenizer with very many EOS ids
    params = SamplingParams(min_tokens=1, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(ValueError, match=rf"stop_token_ids: with min_tokens=1, .* at most {SUPPRESS_WIDTH}"):
        check_against_model(params, 2, 4096, eos, 64)
    check_against_model(SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))), 2, 4096, eos, 64)


@pytest.mark.parametrize("params, prompt_len, match", [
    (SamplingParams(stop_token_ids=[VOCAB], max_tokens=4), 2, r"stop_token_ids contains ids outside \[0, 4\): \[4\]"),
    (SamplingParams(max_tokens=15), 2, r"max_tokens=15: the prompt \(2 tokens\) leaves room for at most 14"),
    (SamplingParams(max_tokens=None, min_tokens=15), 2, r"min_tokens=15: the prompt \(2 tokens\) leaves room"),
    (SamplingParams(), 16, "does not fit the context of 16 tokens"),
    (SamplingParams(), 0, "prompt must not be empty"),
    (SamplingParams(logit_bias={1: 2.0, VOCAB: 1.0}, max_tokens=4), 2,
     r"^logit_bias contains ids outside \[0, 4\): \[4\]"),
    (SamplingParams(allowed_token_ids=[1, 9], max_tokens=4), 2,
     r"^allowed_token_ids contains ids outside \[0, 4\): \[9\]"),
    (SamplingParams(min_tokens=2, max_tokens=4, allowed_token_ids=[0, 0]), 2,
     r"^min_tokens=2 bans every one of allowed_token_ids \(they are stop or EOS ids\)"),
])
def test_requests_that_cannot_run_on_the_model_are_refused(params, prompt_len, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_against_model(params, prompt_len, VOCAB, EOS, max_model_len=16)


@pytest.mark.parametrize("messages, add, match", [
    ("hello", True, "messages must be a list of {'role', 'content'} dicts, got str"),
    ([], True, "messages must not be empty"),
    (["hi"], True, r"^messages\[0\] is a str; a message is a dict with 'role' and 'content'$"),
    ([{"role": "user", "content": "hi"}, None], True, r"^messages\[1\] is null; a message is a dict"),
    ([{"role": "user", "content": None}], True, r"messages\[0\].content must be a string, got null$"),
    ([{"role": "wizard", "content": "hi"}], True, r"messages\[0\].role='wizard' is not one of system, developer, user"),
    ([{"role": "user", "content": 5}], True, r"messages\[0\].content must be a string, got int"),
    ([{"role": "user", "content": "\ud800"}], True, r"messages\[0\].content is not valid Unicode"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}], True, "the assistant's"),
])
def test_bad_chats_are_refused_naming_the_message(messages, add, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_chat(messages, add)


@pytest.mark.parametrize("key, match", [
    ("contnet", r"messages\[0\] has an unknown key 'contnet' \(did you mean 'content'\?\); a message's keys are "
                r"role, content, name"),
    ("colour", r"messages\[0\] has an unknown key 'colour'; a message's keys are role, content, name"),
    ("tool_calls", r"messages\[0\] has the key 'tool_calls', an OpenAI message key jaxinfer does not support "
                   r"\(tool calls\); a message's keys are role, content, name"),
    ("tool_call_id", r"messages\[0\] has the key 'tool_call_id', an OpenAI message key jaxinfer does not support"),
])
def test_a_message_key_that_is_not_role_content_or_name_is_refused_naming_it(key, match) -> None:
    """Found by a hostile-user trial: a misspelt key was dropped silently (the message then had no content)."""
    with pytest.raises(ValueError, match=match):
        check_chat([{"role": "user", "content": "hi", key: "x"}])


def test_a_message_name_must_be_text() -> None:
    chat = [{"role": "user", "content": "hi", "name": "ada"}]
    assert check_chat(chat) == chat  # OpenAI's participant name: kept for the chat template
    for name, match in ((5, r"messages\[0\].name must be a string, got int"),
                        ("\ud800", r"messages\[0\].name is not valid Unicode")):
        with pytest.raises(ValueError, match=match):
            check_chat([{"role": "user", "content": "hi", "name": name}])


def test_good_chats_pass() -> None:
    for role in CHAT_ROLES:
        check_chat([{"role": role, "content": "x"}], add_generation_prompt=False)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    assert check_chat(chat, add_generation_prompt=False) == chat  # continuing without the generation prompt
    developer = [{"role": "developer", "content": "Be brief.", "name": "ops"}, {"role": "user", "content": "hi"}]
    assert check_chat(developer) == [{"role": "system", "content": "Be brief.", "name": "ops"}, developer[1]]
    assert developer[0]["role"] == "developer"  # the caller's messages are not changed


def test_check_text() -> None:
    assert check_text("f", "ok \u00e9 \U0001f600") == "ok \u00e9 \U0001f600"
    with pytest.raises(ValueError, match=r"f is not valid Unicode text: a lone surrogate '\\udfff' at index 2"):
        check_text("f", "ab\udfff")
    with pytest.raises(ValueError, match="f must be a string, got bytes"):
        check_text("f", b"ab")


def test_allowed_ids_past_what_the_sampler_picks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^allowed_token_ids allows no id the model can sample \(ids below 3\)"):
        check_against_model(SamplingParams(allowed_token_ids=[3]), 2, VOCAB, EOS, 64, sampled_vocab_size=3)
    check_against_model(SamplingParams(allowed_token_ids=[3, 2]), 2, VOCAB, EOS, 64, sampled_vocab_size=3)
    check_against_model(SamplingParams(min_tokens=2, allowed_token_ids=[0, 1]), 2, VOCAB, EOS, 64)


@pytest.mark.parametrize("prompt_len, words", [(1, "1 token"), (2, "2 tokens")])
def test_max_tokens_beyond_the_context_carries_its_numbers(prompt_len, words) -> None:
    """Found by a fresh-user trial: "the prompt (1 tokens)". The refusal is a ValueError with the numbers a front
    end needs to say it in its own words, and it survives pickling (errors cross processes)."""
    with pytest.raises(MaxTokensBeyondContext) as e:
        check_against_model(SamplingParams(max_tokens=100), prompt_len, VOCAB, EOS, max_model_len=16)
    assert isinstance(e.value, ValueError)
    assert (e.value.max_tokens, e.value.num_prompt_tokens, e.value.max_model_len, e.value.room) == \
        (100, prompt_len, 16, 16 - prompt_len)
    assert str(e.value) == (f"max_tokens=100: the prompt ({words}) leaves room for at most {16 - prompt_len} in the "
                            "context of 16 tokens (max_tokens=None generates until the context is full)")
    copy = pickle.loads(pickle.dumps(e.value))
    assert type(copy) is MaxTokensBeyondContext and str(copy) == str(e.value)
    with pytest.raises(ValueError, match=rf"^min_tokens=16: the prompt \({words}\) leaves room"):
        check_against_model(SamplingParams(max_tokens=None, min_tokens=16), prompt_len, VOCAB, EOS, 16)
