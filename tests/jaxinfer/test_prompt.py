"""`Prompt`: frozen, its token ids a tuple of ints, its fields checked at construction."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxinfer.prompt import Prompt, make_prompt


def test_prompt_is_immutable_and_holds_a_tuple():
    prompt = Prompt([5, 17, 99], text="hi", cache_salt="tenant-a")
    assert prompt.token_ids == (5, 17, 99) and isinstance(prompt.token_ids, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.token_ids = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompt.cache_salt = None
    with pytest.raises(AttributeError):
        prompt.token_ids.append(1)  # a tuple: the ids cannot change in place either
    assert prompt == Prompt((5, 17, 99), text="hi", cache_salt="tenant-a") and hash(prompt) == hash(
        Prompt((5, 17, 99), text="hi", cache_salt="tenant-a"))


@pytest.mark.parametrize("kw, match", [
    (dict(token_ids="abc"), "token_ids must be a list of token ids, got str"),
    (dict(token_ids=(1, 2.0)), "token_ids must hold integer token ids; got 2.0"),
    (dict(token_ids=(1, True)), "token_ids must hold integer token ids; got True"),
    (dict(token_ids=(1, -3)), r"token_ids contains ids outside \[0, vocab size\): \[-3\]"),
    (dict(token_ids=np.array([1.5])), "token_ids must be a 1-D integer array"),
    (dict(token_ids=(1,), text=b"x"), "text must be a string, got bytes"),
    (dict(token_ids=(1,), text="a\udc80"), "text is not valid Unicode text: a lone surrogate"),
    (dict(token_ids=(1,), cache_salt=""), "cache_salt"),
    (dict(token_ids=(1,), cache_salt=7), "cache_salt"),
])
def test_bad_prompt_fields_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        Prompt(**kw)


def test_numpy_integer_token_ids_are_accepted():
    """Ids from numpy (scalars or a 1-D array of any integer dtype) are token ids, stored as Python ints."""
    for ids in ((np.int64(5), np.int32(7)), np.array([5, 7], np.int64), np.array([5, 7], np.uint16)):
        prompt = Prompt(ids)
        assert prompt.token_ids == (5, 7) and all(type(t) is int for t in prompt.token_ids)
        assert make_prompt(ids, encode=None, vocab_size=8).token_ids == (5, 7)
        assert make_prompt({"prompt_token_ids": ids}, encode=None, vocab_size=8).token_ids == (5, 7)


def _encode(text: str) -> list[int]:
    return [len(word) for word in text.split()]


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [1], "promt": "typo"}, r"prompt dict has unknown key\(s\) 'promt'; the keys are prompt"),
    ({"prompt": "hi", "multi_modal_data": {}}, r"unknown key\(s\) 'multi_modal_data'"),
    ({"prompt": 5}, r"needs 'prompt_token_ids' or a text 'prompt' \(its 'prompt' is of type int\)"),
    ({"prompt_token_ids": [1], "prompt": "x"}, r"^a dict prompt has both 'prompt' and 'prompt_token_ids'; give one "
                                                r"of them"),
    ({"prompt_token_ids": [1], "prompt": 5}, "has both 'prompt' and 'prompt_token_ids'"),
    ({"prompt": 5, "cache_salt": "t"}, r"\(its 'prompt' is of type int\)"),
    ({"prompt_token_ids": "1 2"}, r"prompt_token_ids must be a list of token ids, got str"),
    ({"prompt": "a\ud800b"}, r"prompt\['prompt'\] is not valid Unicode text: a lone surrogate '\\ud800' at index 1"),
    ("a\ud800b", r"prompt is not valid Unicode text: a lone surrogate"),
    ("", "prompt must not be empty"),
    ({"prompt": "hi", "cache_salt": "\ud800"}, "cache_salt is not valid Unicode text"),
    ([1, 9], r"prompt_token_ids contains ids outside \[0, 8\): \[9\]"),
    # text whose tokenizer gives ids past the model's vocabulary (a user trial: NaN logits, not an error, before)
    ("ab abcdefghij", r"prompt tokenizes to 1 id\(s\) outside the model's vocabulary \[0, 8\), e.g. 10"),
    ({"prompt": "abcdefghi"}, r"outside the model's vocabulary \[0, 8\), e.g. 9"),
])
def test_make_prompt_refuses_naming_the_field(prompt, match):
    with pytest.raises(ValueError, match=match):
        make_prompt(prompt, _encode, vocab_size=8)


def test_make_prompt_accepts_vllm_prompt_dicts():
    assert make_prompt({"prompt": "ab c", "cache_salt": "t"}, _encode, 8) == Prompt((2, 1), "ab c", "t")
    assert make_prompt({"prompt_token_ids": [3], "cache_salt": "t"}, _encode, 8) == Prompt((3,), None, "t")
