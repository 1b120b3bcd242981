"""The engine with the Pallas kernels (TPU kernels in generic interpret mode on CPU) against the reference path.

Property: greedy decoding is a function of the model, not of the attention implementation, so SmolLM2 must
produce the same tokens either way over a few steps of a batch that mixes fresh prompts (flash attention),
chunked-prefill continuations (paged attention with q_len > 1) and decodes (paged attention with q_len 1).
With speculative decoding the kernels also run verify blocks (q_len 1 + drafts, beside q_len-1 rows) and, for
self-drafting, the draft's decode steps over the target's own cache.
"""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from pallas_kernels.dispatch import select_attention

PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    # Longer than the 32-token step budget below: its prefill is split into chunks that run beside decodes.
    "Write a short story about a robot who learns to paint. It lives in a small town by the sea and every "
    "morning it watches the fishing boats leave the harbour.",
]


# Copy-heavy: n-gram drafts of these are accepted, so verify blocks of several tokens run through the kernels.
SPEC_PROMPTS = ["one two three four five six seven eight. one two three four five six seven eight. one two"]


@pytest.fixture(scope="module")
def outputs_by_backend():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    runs = {"reference": ("reference", None), "pallas": ("pallas", None),
            "pallas_ngram": ("pallas", {"method": "ngram", "num_speculative_tokens": 3}),
            "pallas_self_draft": ("pallas", {"method": "self_draft", "num_speculative_tokens": 2,
                                             "num_draft_layers": 28})}
    for name, (backend, spec) in runs.items():
        llm = LLM(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=4, max_num_batched_tokens=32,
                  warmup=False, attention_backend=backend, speculative_config=spec)
        out[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + SPEC_PROMPTS, params)]
        out[name + "_ops"] = llm.engine.runner.attention.name
        out[name + "_stats"] = llm.engine.stats()
    return out


def test_pallas_backend_really_runs_the_kernels(outputs_by_backend):
    assert outputs_by_backend["reference_ops"] == "reference"
    assert outputs_by_backend["pallas_ops"] == "pallas-tpu-interpret"


def test_greedy_tokens_match_reference(outputs_by_backend):
    assert all(len(t) == 6 for t in outputs_by_backend["reference"])
    assert outputs_by_backend["pallas"] == outputs_by_backend["reference"]


@pytest.mark.parametrize("run", ["pallas_ngram", "pallas_self_draft"])
def test_speculative_decoding_on_the_kernels_matches_reference(outputs_by_backend, run):
    assert outputs_by_backend[run + "_ops"] == "pallas-tpu-interpret"
    assert outputs_by_backend[run + "_stats"]["spec_draft_tokens"] > 0
    assert outputs_by_backend[run] == outputs_by_backend["reference"]


def test_ngram_drafts_were_accepted_on_the_kernels(outputs_by_backend):
    assert outputs_by_backend["pallas_ngram_stats"]["spec_accepted_tokens"] > 0


def test_auto_picks_the_cpu_ops_on_cpu_and_kernels_elsewhere():
    assert select_attention("auto", "cpu").name == "cpu"  # native decode attention, reference otherwise
    assert select_attention("auto", "gpu").name == "pallas-gpu"
    assert select_attention("auto", "cuda").name == "pallas-gpu"
    assert select_attention("auto", "tpu").name == "pallas-tpu"
    assert select_attention("reference", "tpu").name == "reference"
    assert select_attention("pallas", "cpu").flash is not None


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        select_attention("triton")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(attention_backend="fast", warmup=False)
