"""A model whose chat template refuses a system role (Gemma's do, through `raise_exception`): a chat with a system
message is a 400 in OpenAI's error shape naming `messages` over HTTP, `INVALID_ARGUMENT` over gRPC, with the
template's own words, and the server keeps serving (issue 21).

The model: the tiny random chat Llama (`make_tiny_chat_model`) with a Gemma-style template written here, served by
`BothServers` (gRPC and HTTP on one engine) in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.serving.v1 import jaxinfer_pb2 as pb
from tests.jaxinfer.benchmarks.tiny_chat_model import make_tiny_chat_model
from tests.jaxinfer.serving.http_server import BothServers

# ChatML turns (the tiny tokenizer's special tokens), refusing the system role the way Gemma's templates do.
REFUSING = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
            "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REFUSAL = "the model's chat template refuses them: System role not supported"
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def refusing_chat_model(folder: Path) -> Path:
    """The tiny chat model in `folder`, its tokenizer_config.json's template replaced by `REFUSING`."""
    make_tiny_chat_model(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = REFUSING
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    model = refusing_chat_model(tmp_path_factory.mktemp("refusal") / "tiny")
    servers = BothServers(EngineConfig.create(model=str(model), kv_cache_memory_bytes=4 << 20, max_model_len=512,
                                              max_num_seqs=4, warmup=False))
    servers.wait_serving()
    yield servers
    servers.stop()


def _chat(servers: BothServers, messages: list[dict], **body) -> httpx.Response:
    return httpx.post(servers.base_url + "/v1/chat/completions", json={"messages": messages, **body}, timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_system_message_is_a_400_naming_messages(refusing, stream):
    r = _chat(refusing, SYSTEM, max_tokens=2, stream=stream)
    assert r.status_code == 400, r.text[:400]
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages"), error
    assert error["message"] == f"messages: {REFUSAL}", error


def test_the_same_chat_without_the_system_turn_is_served(refusing):
    ok = _chat(refusing, SYSTEM[1:], max_tokens=2, ignore_eos=True)
    assert ok.status_code == 200, ok.text[:400]
    assert ok.json()["usage"]["completion_tokens"] == 2


def test_a_system_message_over_grpc_is_invalid_argument(refusing):
    chat = pb.ChatInput(messages=[pb.ChatMessage(**m) for m in SYSTEM])
    calls = {"Generate": lambda: list(refusing.stub.Generate(pb.GenerateRequest(chat=chat), timeout=60)),
             "Tokenize": lambda: refusing.stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60)}
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value.details())
        assert REFUSAL in info.value.details() and "messages" in info.value.details(), (name, info.value.details())
    user_only = pb.ChatInput(messages=[pb.ChatMessage(**SYSTEM[1])])
    assert refusing.stub.Tokenize(pb.TokenizeRequest(chat=user_only), timeout=60).token_ids
    refusing.wait_idle()
