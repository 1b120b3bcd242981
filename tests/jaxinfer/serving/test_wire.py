"""`jaxinfer.serving.wire`: request bytes that do not parse name the field to blame."""

from __future__ import annotations

import pytest

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from jaxinfer.serving.wire import MalformedRequest, malformed_field, tolerant_parser

BAD_UTF8 = b"\xed\xa0\x80"  # a lone surrogate (U+D800) as CESU-style bytes: not UTF-8


def _corrupt(msg, placeholder: str = "QQQ") -> bytes:
    """`msg` serialized, with the placeholder's bytes replaced by invalid UTF-8 of the same length."""
    data = msg.SerializeToString()
    assert data.count(placeholder.encode()) == 1
    return data.replace(placeholder.encode(), BAD_UTF8)


CASES = {
    "text": pb.GenerateRequest(text="QQQ"),
    "sampling.stop[1]": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["a", "QQQ"], max_tokens=3)),
    "chat.messages[1].content": pb.GenerateRequest(chat=pb.ChatInput(messages=[
        pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="user", content="QQQ")])),
    "chat.messages[0].role": pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="QQQ")])),
    "request_id": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), request_id="QQQ"),
    "cache_salt": pb.GenerateRequest(text="x", cache_salt="QQQ"),
    "sampling.bad_words[1]": pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
        bad_words=["a", "QQQ"], logit_bias={3: 1.0}, allowed_token_ids=[3, 4])),
}


@pytest.mark.parametrize("field", list(CASES))
def test_invalid_utf8_is_named_by_field(field: str) -> None:
    data = _corrupt(CASES[field])
    assert malformed_field(data, pb.GenerateRequest.DESCRIPTOR) == field
    parsed = tolerant_parser(pb.GenerateRequest)(data)
    assert isinstance(parsed, MalformedRequest) and parsed.error.startswith(f"{field} is not valid UTF-8")


def test_other_messages_and_good_bytes() -> None:
    data = _corrupt(pb.TokenizeRequest(text="QQQ"))
    assert tolerant_parser(pb.TokenizeRequest)(data).error.startswith("text is not valid UTF-8")
    good = pb.GenerateRequest(text="héllo \U0001f600", sampling=pb.SamplingParams(stop=["é"]))
    assert tolerant_parser(pb.GenerateRequest)(good.SerializeToString()) == good
    truncated = good.SerializeToString()[:-3]
    error = tolerant_parser(pb.GenerateRequest)(truncated).error
    assert error == "the request is not a valid jaxinfer.v1.GenerateRequest message"


def _with_field(msg, number: int, payload: bytes = b"x") -> bytes:
    """`msg` serialized plus a length-delimited field `number` (one the message may not have) holding `payload`."""
    assert number < 16 and len(payload) < 128
    return msg.SerializeToString() + bytes([number << 3 | 2, len(payload)]) + payload


def _chat(*messages: bytes) -> bytes:
    """A GenerateRequest's bytes whose chat holds the serialized `messages`."""
    chat = b"".join(bytes([1 << 3 | 2, len(m)]) + m for m in messages)
    return bytes([3 << 3 | 2, len(chat)]) + chat


@pytest.mark.parametrize("data, path, message_type", [
    (_chat(pb.ChatMessage(role="user", content="hi").SerializeToString(),
           _with_field(pb.ChatMessage(role="user", content="hi"), 9)), "chat.messages[1]", "ChatMessage"),
    (_with_field(pb.GenerateRequest(text="hi"), 15), "request", "GenerateRequest"),
    # sampling (field 4) holding varint field 30 = 1: tag 30 << 3 = 240 is the varint bytes F0 01
    (pb.GenerateRequest(text="hi").SerializeToString() + bytes([4 << 3 | 2, 3, 0xF0, 0x01, 1]),
     "sampling", "SamplingParams"),
], ids=["chat_message", "request", "sampling"])
def test_a_field_the_server_does_not_know_is_refused_naming_where(data, path, message_type) -> None:
    """Found by a hostile-user trial: fields this server's .proto lacks (a misspelt or newer client's) were
    dropped silently."""
    parsed = tolerant_parser(pb.GenerateRequest)(data)
    assert isinstance(parsed, MalformedRequest)
    fields = ", ".join(f.name for f in getattr(pb, message_type).DESCRIPTOR.fields)
    assert parsed.error.startswith(f"{path} has a field jaxinfer.v1.{message_type} does not have (field number "), \
        parsed.error
    assert parsed.error.endswith(f"); its fields are {fields}")


def test_a_chat_message_may_carry_a_name() -> None:
    good = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi", name="ada")]))
    assert tolerant_parser(pb.GenerateRequest)(good.SerializeToString()) == good


def test_a_logit_bias_map_parses_and_unknown_fields_beside_it_are_still_found() -> None:
    """Found by this change: `unknown_field` walked a map of scalars as if its keys were messages (TypeError)."""
    good = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logit_bias={5: 1.5, 7: -100.0}, bad_words=["x"],
                                                                    allowed_token_ids=[5, 7]))
    assert tolerant_parser(pb.GenerateRequest)(good.SerializeToString()) == good
    # sampling (field 4): the good sampling's bytes plus varint field 30 = 1 (F0 01 01)
    sampling = good.sampling.SerializeToString() + bytes([0xF0, 0x01, 1])
    data = pb.GenerateRequest(text="hi").SerializeToString() + bytes([4 << 3 | 2, len(sampling)]) + sampling
    parsed = tolerant_parser(pb.GenerateRequest)(data)
    assert isinstance(parsed, MalformedRequest) and parsed.error.startswith(
        "sampling has a field jaxinfer.v1.SamplingParams does not have (field number 30")
