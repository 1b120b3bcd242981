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
