"""`Prompt`: frozen, its token ids a tuple of ints, its fields checked at construction."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.prompt import Prompt


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
    (dict(token_ids="abc"), "token_ids must be a tuple"),
    (dict(token_ids=(1, 2.0)), "token_ids must all be ints"),
    (dict(token_ids=(1, True)), "token_ids must all be ints"),
    (dict(token_ids=(1,), text=b"x"), "text must be a string or None"),
    (dict(token_ids=(1,), cache_salt=""), "cache_salt"),
    (dict(token_ids=(1,), cache_salt=7), "cache_salt"),
])
def test_bad_prompt_fields_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        Prompt(**kw)
