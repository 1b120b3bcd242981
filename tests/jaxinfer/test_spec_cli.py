"""`--speculative-config` of `jaxinfer generate` / `serve`, run as a user runs them (subprocesses): greedy text is
the same with speculation as without, and bad configs exit 2 with one line naming the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer import LLM, SamplingParams
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir

NGRAM_2 = '{"method": "ngram", "num_speculative_tokens": 2}'


def _jaxinfer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("spec_cli") / "tiny")


def test_generate_with_ngram_gives_the_greedy_text_of_plain_decoding(tiny_model: Path):
    # The tiny random model's greedy continuation of this prompt repeats itself in stretches, so the n-gram
    # proposer's drafts are accepted some steps and rejected in others (rollbacks).
    common = ("generate", "--model", str(tiny_model), "--prompt", " ".join(["w29"] * 8), "--temperature", "0",
              "--max-tokens", "32", "--kv-cache-memory-bytes", str(8 << 20))
    plain = _jaxinfer(*common, "--json")
    spec = _jaxinfer(*common, "--json", "--speculative-config", NGRAM_2)
    assert plain.returncode == 0, plain.stderr
    assert spec.returncode == 0, spec.stderr
    want, got = json.loads(plain.stdout), json.loads(spec.stdout)
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) == 32
    assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
    assert "speculative" not in want
    stats = got["speculative"]
    assert stats["draft_tokens"] > 0 and 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(stats["accepted_tokens"] / stats["draft_tokens"])
    assert stats["tokens_per_decode_step"] > 1.0

    streamed = _jaxinfer(*common, "--speculative-config", NGRAM_2)  # streaming mode: same text, stats on stderr
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == want["text"] + "\n"
    assert "speculative (ngram, k=2, at most 2 per step alone" in streamed.stderr and "drafts accepted" in streamed.stderr


@pytest.mark.parametrize("config, message", [
    ('{"method": "ngram", "num_speculative_tokens": 2', "--speculative-config: speculative config is not valid JSON"),
    ("ngram", "not valid JSON"),
    ("", "not valid JSON"),
    ('["ngram", 2]', "must be a JSON object / dict, got list"),
    ('{"method": "ngram", "num_spec_tokens": 2}', "unknown speculative config key(s) 'num_spec_tokens'; known:"),
    ('{"method": "medusa"}', "method='medusa' is not one of ngram, draft_model, self_draft"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens=0 must be an integer in [1, 16]"),
    ('{"method": "ngram", "model": "x.gguf"}', "'model' is only for method 'draft_model'"),
    ('{"method": "draft_model"}', "'draft_model' needs 'model'"),
    ('{"method": "draft_model", "model": "/no/such/draft.gguf"}', "draft model /no/such/draft.gguf: no such file"),
])
def test_bad_speculative_config_exits_2_with_one_line(config: str, message: str):
    done = _jaxinfer("generate", "--prompt", "x", "--speculative-config", config, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("jaxinfer: error: --speculative-config: "), done.stderr
    assert message in errors[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_serve_rejects_a_bad_speculative_config_before_starting():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "serve", "--port", "0", "--http-port", "0",
                           "--no-warmup", "--speculative-config", '{"method": "ngram", "k": 2}'],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxinfer: error: --speculative-config: unknown speculative config key(s) 'k'"), done.stderr
    assert "Traceback" not in done.stderr and "serving gRPC" not in done.stdout


@pytest.mark.slow
def test_generate_smollm2_copy_text_with_ngram_matches_the_api(smollm2_llm: LLM):
    prompt = ("Repeat the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes.\n"
              "Repeat: apples, pears,")
    expected = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    done = _jaxinfer("generate", "--prompt", prompt, "--dtype", "float32", "--temperature", "0", "--max-tokens", "24",
                     "--json", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["token_ids"] == expected.token_ids and got["text"] == expected.text
    assert got["speculative"]["accepted_tokens"] > 0  # copy text: the drafts pay
