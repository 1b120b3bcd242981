"""Tests of `jaxinfer bench quality` on the tiny HF Llama: one configuration (word-level tokenizer, a text of its
words); the matrix's scores against numpy on the golden folder with the character tokenizer; and `--matrix` end to
end on the golden folder over both default texts."""

from __future__ import annotations

import argparse
import json
import math

import jax
import numpy as np
import pytest

from jaxinfer.benchmarks import quality_runs
from jaxinfer.benchmarks.quality import GPL3, SECTION
from jaxinfer.benchmarks.quality_matrix import cut_ids, evaluate, make_baseline
from jaxinfer.benchmarks.quality_runs import eval_logits, loadable, make_llm
from jaxinfer.cli import main
from jaxinfer.loading.hf import load_hf_weights
from tests.jaxinfer.benchmarks.bench_runner import TINY_LLAMA, assert_positive_finite, run_bench
from tests.jaxinfer.benchmarks.test_quality_metrics import kl_reference
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_quality")
    model = make_tiny_model_dir(root / "tiny")
    (ids,) = random_prompts(1, seed=0, min_len=40, max_len=40)
    text = root / "words.txt"
    text.write_text(" ".join(f"w{i}" for i in ids))
    return root, model, text, ids


def test_quality_one_configuration(tiny, tmp_path):
    _, model, text, ids = tiny
    out = tmp_path / "quality.json"
    assert main(["bench", "quality", "--model", str(model), "--text", str(text), "--tokens", "40", "--chunk", "16",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())["data"]
    assert data["tokens"] == 40 and data["dtype"] == "float32"
    assert_positive_finite(data["perplexity"], "perplexity")
    assert data["perplexity"] == pytest.approx(math.exp(data["mean_nll"]))
    # random weights: about as good as a uniform guess over the 128 ids, far from perfect
    assert 10 < data["perplexity"] < 1000
    cfg, weights = load_hf_weights(model, np.float32)
    assert data["weight_bytes"] == sum(a.size * 4 for a in jax.tree.leaves(weights))


def test_quality_write_needs_matrix(tiny, tmp_path, capsys):
    _, model, text, _ = tiny
    assert main(["bench", "quality", "--model", str(model), "--text", str(text), "--write",
                 str(tmp_path / "B.md")]) == 2
    assert "--write records the --matrix table; add --matrix" in capsys.readouterr().err


def test_quality_matrix_options_are_checked(tiny, tmp_path, capsys):
    _, model, text, _ = tiny
    for options, message in ((["--matrix", "--formats", "int9"], "--formats entry 'int9'"),
                             (["--matrix", "--kv-dtypes", "int4"], "--kv-dtypes: unknown or empty ['int4']"),
                             (["--matrix", "--flips", "0"], "--flips, --flip-tokens and --flip-context"),
                             (["--text", str(text)], "--text names the same file twice"),
                             (["--text", str(GPL3)], "several --text files need --matrix"),
                             (["--matrix", "--formats", ""], "--formats '': an empty list"),  # not the default matrix
                             (["--formats", "int4"], "--formats only apply with --matrix"),  # was ignored
                             (["--flips", "3", "--kv-dtypes", "int8"], "--kv-dtypes, --flips only apply with")):
        assert main(["bench", "quality", "--model", str(model), "--text", str(text), *options]) == 2
        assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """tests/data/tiny_llama3 (no tokenizer of its own) with the workload's character tokenizer."""
    return loadable(str(TINY_LLAMA), tmp_path_factory.mktemp("char") / "tiny_llama3")


def test_scores_against_the_baseline_match_numpy(char_model, tmp_path):
    args = argparse.Namespace(chunk=16, flips=3, flip_tokens=4, flip_context=8)
    base_llm = make_llm(char_model, "float32", 16, max_num_seqs=3)
    ids = cut_ids(base_llm, GPL3, 40)
    assert ids == [ord(c) for c in GPL3.read_text()[:40]]  # one id per ASCII character
    base = make_baseline(base_llm, "GPL-3", ids, args, tmp_path)
    assert base.logp.shape == (39, 128) and base.continuations.shape == (3, 4)
    same = evaluate(base_llm, "f32", "f32", base, args)  # the model against itself
    assert same["kld_mean"] == same["kld_max"] == 0 and same["flips"] == 0 and same["top1_agreement"] == 1
    assert same["delta_ppl"] == 0

    llm = make_llm(char_model, "float32", 16, "int4", None, 3)
    got = evaluate(llm, "int4", "f32", base, args)
    base_logits, logits = eval_logits(base_llm, ids, 16)[:-1], eval_logits(llm, ids, 16)[:-1]
    kl = kl_reference(base_logits, logits)
    assert got["kld_mean"] == pytest.approx(kl.mean(), rel=1e-4) and got["kld_max"] == pytest.approx(kl.max())
    assert got["kld_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-4) and got["kld_mean"] > 1e-4
    assert got["top1_agreement"] == pytest.approx(np.mean(base_logits.argmax(-1) == logits.argmax(-1)))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    nll = -np.log(probs[np.arange(39), ids[1:]] / probs.sum(-1))
    assert got["mean_nll"] == pytest.approx(nll.mean(), rel=1e-5)
    assert 0 <= got["flips"] <= 3 and got["quantized_share"] > 0.5


def test_quality_matrix_on_the_tiny_golden_model(tmp_path, monkeypatch):
    real_make_llm = quality_runs.make_llm

    def make_llm_without_fp8(model, dtype, chunk, quantization=None, *rest, **options):
        if quantization == "fp8":
            raise ValueError("no fp8 here")  # stands for a format the model cannot take
        return real_make_llm(model, dtype, chunk, quantization, *rest, **options)

    monkeypatch.setattr(quality_runs, "make_llm", make_llm_without_fp8)
    report, written = run_bench(tmp_path, "quality", "--matrix", "--model", str(TINY_LLAMA), "--dtype", "float32",
                                "--tokens", "40", "--chunk", "16", "--formats", "int8;int4;fp8", "--kv-dtypes",
                                "auto", "--flips", "2", "--flip-tokens", "4")
    data = report["data"]
    rows = data["rows"]
    assert [(r["format"], r["text"]) for r in rows] == [(f, t) for t in ("GPL-3", "textwrap.py")
                                                         for f in ("f32", "int8", "int4")]
    assert data["skipped"] == [{"format": "fp8", "kv_cache": "f32", "reason": "no fp8 here"}]
    for r in rows:
        assert r["tokens"] == 40 and r["kv_cache"] == "f32" and r["flip_prompts"] == 2
        assert_positive_finite(r["perplexity"], "perplexity")
        if r["format"] == "f32":
            assert r["kld_mean"] == 0 and r["flips"] == 0 and r["quantized_share"] == 0
        else:
            assert r["kld_mean"] > 0 and r["kld_p99"] >= r["kld_mean"] and 0 < r["top1_agreement"] <= 1
    bytes_of = {r["format"]: r["weight_bytes"] for r in rows}
    cfg, weights = load_hf_weights(TINY_LLAMA, np.float32)
    assert bytes_of["f32"] == sum(a.size * 4 for a in jax.tree.leaves(weights))
    assert max(bytes_of["int4"], bytes_of["int8"]) < bytes_of["f32"]  # int4 keeps the f32 embedding and head
    # f32 against HF transformers' f32 logits of the folder's golden.json
    assert data["golden"]["top1_agreement"] == 1 and data["golden"]["kld_max"] < 1e-5
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    assert "| format | KV cache | text | PPL | vs base | mean KLD | p99 KLD | top-1 | flips | quantized | weights |" \
        in section
    assert "| int4 | f32 | textwrap.py |" in section and "Skipped fp8 with a f32 KV cache: no fp8 here" in section
    assert "CPython 3.12.1's Lib/textwrap.py" in section and "machine: nproc" in section
    assert data["flip_context"] == 256 - 4 and "the up to 252 tokens before the point" in section  # context 256
