"""Smoke test of `jaxinfer bench step` on the tiny HF Llama: one repetition of every section at tiny sizes (the
breakdown and int8 weights included), the stub peer in place of HF transformers and of llama.cpp; the report's
fields and byte counts are checked against the model config's arithmetic."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

from jaxinfer.benchmarks.step import SECTION
from jaxinfer.benchmarks.step_breakdown import PARTS
from jaxinfer.loading.hf import load_hf_weights
from tests.jaxinfer.benchmarks.bench_runner import STUB_PEER, TINY_LLAMA, assert_positive_finite, run_bench

OPTIONS = ("--model", str(TINY_LLAMA), "--dtypes", "float32", "--modes", "scan", "--prefill-len", "24",
           "--prefill-reps", "1", "--decode-prompt-len", "4", "--decode-steps", "1", "--warmup-steps", "1",
           "--batches", "", "--bw-gib", "0.016", "--bw-reps", "1", "--kv-batch", "2", "--kv-context", "16",
           "--kv-reps", "1", "--peer-python", sys.executable, "--peer-script", str(STUB_PEER),
           "--llamacpp-python", sys.executable, "--llamacpp-script", str(STUB_PEER), "--llamacpp-types", "Q4_0,BF16")


@pytest.fixture(scope="module")
def step_report(tmp_path_factory):
    return run_bench(tmp_path_factory.mktemp("bench_step"), "step", *OPTIONS)


def test_step_report_holds_every_section(step_report):
    report, written = step_report
    data = report["data"]
    assert_positive_finite(data["roofline_gb_s"], "roofline_gb_s")
    assert data["roofline_gb_s"] == max(data["bandwidth"]["sum"]["gb_s"], data["bandwidth_end"]["sum"]["gb_s"])
    (mode,) = data["modes"]
    for key in ("prefill_ms", "prefill_tok_s"):
        assert_positive_finite(mode[key], key)
    for row in data["decode_rows"]:
        for key in ("step_ms", "tok_s", "roofline_tok_s", "of_roofline"):
            assert_positive_finite(row[key], key)
    assert [r["context"] for r in data["decode_rows"]] == [[6, 6], [24, 24]]
    assert set(data["breakdown"]["float32"]) == set(PARTS) | {"logit_rows"}
    for part in PARTS:
        assert_positive_finite(data["breakdown"]["float32"][part], part)
    (kv,) = data["kv_layout"]
    assert kv["max_abs_diff"] < 1e-5
    assert_positive_finite(kv["ours_ms"], "ours_ms")
    assert data["peer"]["results"]["float32"]["decode_tok_s"] == 20.0  # the stub's 50 ms step
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    for heading in ("Memory read bandwidth", "Decode roofline", "Where a batch-1 decode step goes", "KV layout",
                    "Peers", "2 layers, hidden 64, MLP 128, 4 query / 2 KV heads of dim 16, vocab 128"):
        assert heading in section


def test_step_byte_counts_follow_the_config(step_report):
    data = step_report[0]["data"]
    cfg, weights = load_hf_weights(TINY_LLAMA, np.float32)
    assert data["model"]["num_layers"] == cfg.num_layers == 2
    assert data["weight_bytes"]["float32"] == sum(a.size * 4 for a in jax.tree.leaves(weights))
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert data["kv_bytes_per_token"]["float32"] == per_token
    for row in data["decode_rows"]:
        assert row["kv_bytes"] == row["batch"] * per_token * row["mean_context"]
        assert row["roofline_tok_s"] == pytest.approx(
            row["batch"] * data["roofline_gb_s"] * 1e9 / (row["weight_bytes"] + row["kv_bytes"]))
    assert data["kv_layout"][0]["kv_bytes"] == 2 * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4


def _decode(batch: int, context: tuple[int, int], step_ms: float) -> dict:
    return {"batch": batch, "context": list(context), "mean_context": sum(context) / 2, "step_ms": step_ms,
            "tok_s": batch * 1e3 / step_ms, "compile_s": 1.0}


def test_step_report_renders_both_dtypes_modes_and_failures():
    """The render and its observations with every branch the smoke run (one dtype, scan only) leaves out: scan vs
    unrolled, bf16 vs f32, a failed batch, the peer's table."""
    from jaxinfer.benchmarks.step import roofline_rows
    from jaxinfer.benchmarks.step_report import render
    from models.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, name="toy")
    dtypes = ["float32", "bfloat16"]
    probe = {"sum": {"label": "sum", "bytes": 2**20, "ms": 1.0, "gb_s": 10.0, "threads": 2}}
    modes = [{"dtype": dt, "layers": layers, "prefill_tokens": 48, "prefill_ms": 10.0 * k, "prefill_tok_s": 4.8e3 / k,
              "prefill_compile_s": 2.0, "decode_short": _decode(1, (18, 19), 2.0 * k),
              "decode_long": _decode(1, (47, 48), 2.5 * k)}
             for dt in dtypes for layers, k in (("scan", 1), ("unrolled", 3))]
    data = {"dtypes": dtypes, "prefill_len": 48, "decode_prompt_len": 16, "prefill_reps": 1, "decode_steps": 2,
            "bw_reps": 1, "kv_batch": 2, "kv_context": 32, "kv_reps": 1, "page_size": 16, "model_path": "toy",
            "bandwidth": probe, "bandwidth_end": probe, "roofline_gb_s": 10.0, "elapsed_s": 60.0, "modes": modes,
            "batch_decodes": [{"dtype": "float32", "layers": "scan", **_decode(2, (18, 19), 3.0)},
                              {"dtype": "bfloat16", "layers": "scan", "batch": 2, "error": "XlaRuntimeError: boom"}],
            "weight_bytes": {"float32": 40000, "bfloat16": 20000},
            "kv_bytes_per_token": {"float32": 512, "bfloat16": 256},
            "breakdown": {dt: {**{p: 1.0 + i for i, p in enumerate(PARTS)}, "logit_rows": 2} for dt in dtypes},
            "kv_layout": [{"dtype": dt, "kv_bytes": 8192, "ours_ms": 0.1, "alt_ms": 0.2, "max_abs_diff": 0.0}
                          for dt in dtypes],
            "peer": {"torch": "t", "transformers": "x", "threads": 2,
                     "results": {dt: {"prefill_tok_s": 1000.0, "decode_tok_s": 100.0} for dt in dtypes}}}
    data["decode_rows"] = roofline_rows(data)
    assert len(data["decode_rows"]) == 10 and data["decode_rows"][-1]["error"] == "XlaRuntimeError: boom"
    text = render(data, cfg, "jaxinfer bench step", "today")
    for expected in ("**Scan vs unrolled.**", "**bf16 vs f32.**", "**Failures.** bfloat16 batch 2",
                     "[^err]: failed with `XlaRuntimeError: boom`", "| bfloat16 | decode b1 ctx~16 tok/s | 500.0 |",
                     "The tied [128, 64] embedding table is counted once", "| float32 | scan | 2 | 18-19 |"):
        assert expected in text, expected


@pytest.mark.parametrize("options, message", [
    (("--dtypes", "float16"), "unknown dtype 'float16' in --dtypes"),
    (("--modes", "scan,loop"), "--modes 'scan,loop': give scan and/or unrolled"),
    (("--prefill-len", "32"), "--prefill-len 32 is too short for the decode runs"),
    (("--llamacpp-types", "Q4_0,Q3_K"), "--llamacpp-types 'Q4_0,Q3_K': unknown Q3_K (known: F32, BF16, Q8_0"),
    (("--llamacpp-python", "/nonexistent/python"), "--llamacpp-python /nonexistent/python: no such interpreter"),
    (("--llamacpp-python", sys.executable, "--model", str(TINY_LLAMA)),
     "the llama.cpp peer reads GGUF files only"),
])
def test_step_bad_options_name_the_problem(options, message, capsys):
    from jaxinfer.cli import main

    assert main(["bench", "step", *options]) == 2
    assert message in capsys.readouterr().err


def test_step_int8_and_the_llamacpp_peer(step_report):
    """The int8 (w8a8) run beside f32, its roofline rows, and the llama.cpp stub's numbers in the comparison."""
    report, written = step_report
    data = report["data"]
    q = data["int8"]
    assert q["format"] == "int8 (w8a8)"
    assert_positive_finite(q["mode"]["prefill_tok_s"], "int8 prefill_tok_s")
    assert 0 < q["weight_bytes"] < data["weight_bytes"]["float32"] / 2  # 1-byte values + scales, bf16 norms
    assert q["kv_bytes_per_token"] == data["kv_bytes_per_token"]["float32"] // 2  # bf16 KV cache
    assert [r["context"] for r in q["decode_rows"]] == [[6, 6], [24, 24]]
    for row in q["decode_rows"]:
        assert row["roofline_tok_s"] == pytest.approx(
            data["roofline_gb_s"] * 1e9 / (q["weight_bytes"] + q["kv_bytes_per_token"] * row["mean_context"]))
        assert row["of_roofline"] == pytest.approx(row["tok_s"] / row["roofline_tok_s"])
    assert set(data["llamacpp"]["results"]) == {"Q4_0", "BF16"}
    assert data["llamacpp"]["results"]["Q4_0"]["decode_tok_s"] == 20.0  # the stub's 50 ms step
    b1 = q["mode"]["decode_short"]["tok_s"]
    for expected in ("#### jaxinfer float32", "#### jaxinfer int8 (w8a8)", "llama.cpp Q4_0", "HF transformers (-)",
                     f"| int8 | decode b1 ctx~4 tok/s | {b1:.1f} | - | - | 20.0 | {b1 / 20:.2f} |",
                     "#### llama.cpp by weight type", "| Q4_0 | stub Q4_0 | 70 |"):
        assert expected in written, expected


def test_step_peer_comparison_renders_batches_types_and_failures():
    """The comparison tables on made-up numbers: HF and llama.cpp at batch 1 and 8, the llama.cpp type matched to
    each format, a failed jaxinfer batch, and llama.cpp's own roofline."""
    from jaxinfer.benchmarks import step_peers_report
    from models.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, name="toy")
    mode = {"prefill_tok_s": 3000.0, "decode_short": _decode(1, (18, 19), 10.0)}
    roof = {"layers": "scan", "batch": 1, "context": [18, 19], "roofline_tok_s": 400.0, "of_roofline": 0.25}
    peer_row = {"prefill_tok_s": 1500.0, "decode_tok_s": 50.0,
                "batch_decodes": [{"batch": 8, "tok_s": 200.0, "context": [18, 19]}]}
    data = {"dtypes": ["bfloat16"], "prefill_len": 48, "decode_prompt_len": 16, "batches": [8],
            "roofline_gb_s": 10.0, "modes": [{"dtype": "bfloat16", "layers": "scan", **mode}],
            "batch_decodes": [{"dtype": "bfloat16", "layers": "scan", **_decode(8, (18, 19), 20.0)}],
            "decode_rows": [{"dtype": "bfloat16", **roof}],
            "int8": {"format": "int8 (w8a8)", "mode": mode,
                     "batch_decodes": [{"batch": 8, "error": "XlaRuntimeError: boom"}],
                     "decode_rows": [{"dtype": "int8", **roof}]},
            "peer": {"torch": "t", "transformers": "x", "threads": 2, "results": {"bfloat16": peer_row}},
            "llamacpp": {"llama_cpp": "v", "threads": 2, "flash_attn": False, "n_ctx": 1024, "kv_type": "f16",
                         "results": {t: {**peer_row, "desc": f"toy {t}", "model_bytes": 1_000_000,
                                         "decode_context": [18, 19]} for t in ("BF16", "Q4_0", "Q4_1")}}}
    text = "\n".join(step_peers_report.section(data, cfg))
    for expected in ("| format | metric | jaxinfer | HF transformers | ours / HF | llama.cpp BF16 |",
                     "| bfloat16 | prefill 48 tok/s | 3000 | 1500.0 | 2.00 | 1500.0 | 2.00 | - | - |",
                     "| bfloat16 | decode b1 ctx~16 tok/s | 100.0 | 50.0 | 2.00 | 50.0 | 2.00 | 400 | 25% |",
                     "| bfloat16 | decode b8 ctx~16 tok/s | 400.0 | 200.0 | 2.00 | 200.0 | 2.00 | - | - |",
                     "HF transformers (-) | ours / HF | llama.cpp Q4_0 |",
                     "| int8 | decode b8 ctx~16 tok/s | fails [^err] |",
                     # llama.cpp's own roofline at batch 1: 10 GB/s / (1 MB + 256 B x 18.5 tokens of f16 KV)
                     f"| Q4_1 | toy Q4_1 | 1 | 1500 | 50.0 ({100 * 50 / (1e10 / (1e6 + 256 * 18.5)):.0f}%) |"):
        assert expected in text, expected
    notes = step_peers_report.observations(data)
    assert notes[1] == ("**Peer llama.cpp.** jaxinfer (scan) relative to it: bfloat16 vs BF16: prefill 2.00x, "
                        "decode batch 1 2.00x, batch 8 2.00x; int8 vs Q4_0: prefill 2.00x, decode batch 1 2.00x.")


def test_unrolled_mode_without_a_long_context_decode():
    """Unrolled runs prefill and the short-context decode only: no long-context roofline row, dashes in its table."""
    from jaxinfer.benchmarks.step import roofline_rows
    from jaxinfer.benchmarks.step_report import _speeds

    unrolled = {"dtype": "float32", "layers": "unrolled", "prefill_tokens": 48, "prefill_ms": 30.0,
                "prefill_tok_s": 1600.0, "prefill_compile_s": 2.0, "decode_short": _decode(1, (18, 19), 6.0)}
    data = {"dtypes": ["float32"], "prefill_len": 48, "decode_prompt_len": 16, "modes": [unrolled],
            "batch_decodes": [], "weight_bytes": {"float32": 40000}, "kv_bytes_per_token": {"float32": 512},
            "roofline_gb_s": 10.0}
    assert [(r["layers"], r["context"]) for r in roofline_rows(data)] == [("unrolled", [18, 19])]
    assert "| float32 | unrolled | 1600 | 30 | 166.7 | 6.0 | - | - | 2.0 / 1.0 / - |" in "\n".join(_speeds(data))
