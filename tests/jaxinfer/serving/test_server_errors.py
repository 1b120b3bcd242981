"""Every RPC answers bad input with `INVALID_ARGUMENT` naming the problem, and an unexpected failure inside it with
`INTERNAL` naming the exception, never `UNKNOWN` (a tiny random Llama with a ChatML template, served in this
process by `ServerThread`)."""

from __future__ import annotations

import grpc
import pytest

from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from tests.jaxinfer.serving.test_server import ServerThread, serve_tiny_chat

ENGINE = dict(kv_cache_memory_bytes=4 << 20, max_model_len=512, max_num_seqs=4, warmup=False)


@pytest.fixture(scope="module")
def served_tiny(tmp_path_factory):
    st = serve_tiny_chat(tmp_path_factory.mktemp("errors"), **ENGINE)
    yield st
    st.stop()


def _raw_call(st: ServerThread, method: str, data: bytes):
    """Calls `method` with request bytes as they are (no client-side serialization)."""
    kind = st.channel.unary_stream if method == "Generate" else st.channel.unary_unary
    call = kind(f"/jaxinfer.v1.JaxInfer/{method}", request_serializer=None, response_deserializer=None)
    return list(call(data, timeout=60)) if method == "Generate" else call(data, timeout=60)


def _still_serving(st: ServerThread) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8, 9]),
                                 sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
    assert sum(len(r.token_ids) for r in st.stub.Generate(request, timeout=60)) == 2


# A chat message with field 9 (a misspelt or newer client's key; this server's ChatMessage has 1-3) set to "x".
_MESSAGE = pb.ChatMessage(role="user", content="hi").SerializeToString() + bytes([9 << 3 | 2, 1]) + b"x"
_CHAT = bytes([1 << 3 | 2, len(_MESSAGE)]) + _MESSAGE


@pytest.mark.parametrize("method, data", [
    ("Generate", bytes([3 << 3 | 2, len(_CHAT)]) + _CHAT),  # GenerateRequest.chat is field 3
    ("Tokenize", bytes([2 << 3 | 2, len(_CHAT)]) + _CHAT),  # TokenizeRequest.chat is field 2
], ids=["Generate", "Tokenize"])
def test_a_chat_message_field_the_server_lacks_gets_invalid_argument_naming_it(served_tiny, method, data):
    """Found by a hostile-user trial: {"role", "content", "contnet"}-style extra keys were dropped silently."""
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(served_tiny, method, data)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("chat.messages[0] has a field jaxinfer.v1.ChatMessage does not have "
                                           "(field number 9"), info.value.details()
    assert info.value.details().endswith("its fields are role, content, name")
    _still_serving(served_tiny)


def test_a_chat_message_name_reaches_the_template(served_tiny, monkeypatch):
    tokenizer = served_tiny.engine.tokenizer
    seen = []
    render = tokenizer.apply_chat_template

    def recording(messages, **kw):
        seen.append(messages)
        return render(messages, **kw)

    monkeypatch.setattr(tokenizer, "apply_chat_template", recording)
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                  pb.ChatMessage(role="user", content="hi", name="ada")])
    ids = list(served_tiny.stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60).token_ids)
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ada"}]
    assert seen == [expected] and ids == render(expected, add_generation_prompt=True)


def _break(monkeypatch, obj, name: str, error: Exception) -> None:
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(obj, name, fail)


CHAT = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")])
# (what to break on the engine's tokenizer, the call that reaches it)
BROKEN = {
    "Tokenize-text": ("encode", lambda stub: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=60)),
    "Tokenize-chat": ("apply_chat_template", lambda stub: stub.Tokenize(pb.TokenizeRequest(chat=CHAT), timeout=60)),
    "Detokenize": ("decode", lambda stub: stub.Detokenize(pb.DetokenizeRequest(token_ids=[7, 8]), timeout=60)),
    "Generate": ("encode", lambda stub: list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=60))),
}


@pytest.mark.parametrize("case", list(BROKEN))
@pytest.mark.parametrize("error", [RuntimeError("injected tokenizer failure"), KeyError("injected")],
                         ids=["RuntimeError", "KeyError"])
def test_an_unexpected_exception_in_any_rpc_gets_internal_naming_it(served_tiny, monkeypatch, caplog, case, error):
    """Found by a hostile-user trial: Tokenize and Detokenize answered UNKNOWN ("Unexpected <class ...>") when the
    tokenizer raised something other than ValueError; the traceback went nowhere useful."""
    method, call = BROKEN[case]
    _break(monkeypatch, served_tiny.engine.tokenizer, method, error)
    with pytest.raises(grpc.RpcError) as info:
        call(served_tiny.stub)
    assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    assert info.value.details() == f"internal error: {type(error).__name__}: {error}"
    assert any(r.exc_info and r.exc_info[1] is error for r in caplog.records), "no traceback logged"
    monkeypatch.undo()
    _still_serving(served_tiny)


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_value_error_in_any_rpc_gets_invalid_argument_with_its_message(served_tiny, monkeypatch, case):
    method, call = BROKEN[case]
    _break(monkeypatch, served_tiny.engine.tokenizer, method, ValueError("injected: the input is wrong"))
    with pytest.raises(grpc.RpcError) as info:
        call(served_tiny.stub)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "injected: the input is wrong"


def test_model_info_failing_gets_internal(served_tiny, monkeypatch):
    monkeypatch.setattr(type(served_tiny.engine.tokenizer), "vocab_size",
                        property(lambda self: (_ for _ in ()).throw(AttributeError("injected"))))
    with pytest.raises(grpc.RpcError) as info:
        served_tiny.stub.ModelInfo(pb.ModelInfoRequest(), timeout=60)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error: AttributeError: injected"


def test_detokenize_names_an_id_outside_the_vocabulary(served_tiny):
    vocab = served_tiny.engine.tokenizer.vocab_size
    with pytest.raises(grpc.RpcError) as info:
        served_tiny.stub.Detokenize(pb.DetokenizeRequest(token_ids=[3, vocab]), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"token_ids contains ids outside [0, {vocab})"), info.value.details()


def test_a_prompt_id_past_the_tokenizer_but_inside_the_embedding_names_the_field(served_tiny):
    """Found by the gRPC fuzz: the tiny model's embedding has 128 rows, its tokenizer 101 ids; a prompt id in
    between passed the check against the model's vocabulary and failed in the detokenizer, naming no field."""
    vocab, rows = served_tiny.engine.tokenizer.vocab_size, served_tiny.engine.model_config.vocab_size
    assert vocab < rows
    with pytest.raises(grpc.RpcError) as info:
        list(served_tiny.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, rows - 3])), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"prompt_token_ids contains ids outside [0, {vocab})"), \
        info.value.details()
    _still_serving(served_tiny)


def test_generate_outcomes_are_counted_once_by_status(served_tiny, monkeypatch):
    count = lambda status: served_tiny.server.metrics.sample(  # noqa: E731
        "jaxinfer:grpc_requests_total", {"status": status}) or 0
    before = {s: count(s) for s in ("OK", "INVALID_ARGUMENT", "INTERNAL")}
    _still_serving(served_tiny)
    with pytest.raises(grpc.RpcError):
        list(served_tiny.stub.Generate(pb.GenerateRequest(text=""), timeout=60))  # "text must not be empty"
    _break(monkeypatch, served_tiny.engine.tokenizer, "encode", RuntimeError("injected"))
    with pytest.raises(grpc.RpcError):
        list(served_tiny.stub.Generate(pb.GenerateRequest(text="hi"), timeout=60))
    assert {s: count(s) - before[s] for s in before} == {"OK": 1, "INVALID_ARGUMENT": 1, "INTERNAL": 1}


@pytest.mark.parametrize("error, kind", [(ValueError("min_tokens: injected"), "request"),
                                         (RuntimeError("injected device failure"), "engine")],
                         ids=["request", "engine"])
def test_a_request_failing_after_admission_is_told_why_and_whose_fault(served_tiny, monkeypatch, error, kind):
    """The last response of a completion the engine failed carries finish_reason "error", its message and its kind
    (it carried no message before); the server goes on serving."""
    runner = served_tiny.engine.runner
    real = runner.submit  # every engine step's device call (`execute` is submit + result)
    marker = 11  # the first prompt id of the failing request only

    def failing(chunks, *args, **kwargs):
        if any(c.token_ids and c.token_ids[0] == marker and c.num_computed_tokens == 0 for c in chunks):
            raise error
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(runner, "submit", failing)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[marker, 12, 13]),
                                 sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
    responses = list(served_tiny.stub.Generate(request, timeout=60))
    assert responses[-1].finish_reason == "error", responses
    assert responses[-1].error_kind == kind
    expected = str(error) if kind == "request" else f"engine step failed: RuntimeError: {error}"
    assert responses[-1].error == expected
    monkeypatch.undo()
    _still_serving(served_tiny)
