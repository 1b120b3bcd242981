"""Smoke test of `jaxinfer bench quant` on the tiny HF Llama: bf16 and int8 (w8a8) weights at batch 1 (each more
batch is one more compile per format), one timed call each; the byte counts are checked against the config's
arithmetic."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

from jaxinfer.benchmarks import peers
from jaxinfer.benchmarks.quant import CONTEXT, SECTION
from pallas_kernels import cpu_features
from jaxinfer.loading.hf import load_hf_weights
from tests.jaxinfer.benchmarks.bench_runner import STUB_PEER, assert_positive_finite, run_bench
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_quant_report(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")
    report, written = run_bench(tmp_path, "quant", "--model", str(model), "--formats", "bf16;int8 (w8a8)",
                                "--batches", "1", "--reps", "1", "--max-model-len", "256", "--bw-gib", "0.016",
                                "--bw-reps", "1", "--burst", "3")
    data = report["data"]
    rows = {(r["format"], r["batch"]): r for r in data["rows"]}
    assert list(rows) == [("bf16", 1), ("int8 (w8a8)", 1)]
    for r in data["rows"]:
        for key in ("ms", "tok_s", "roofline_tok_s", "of_roofline", "step_bytes"):
            assert_positive_finite(r[key], key)
        assert r["roofline_tok_s"] == pytest.approx(r["batch"] * data["roofline_gb_s"] * 1e9 / r["step_bytes"])
    cfg, weights = load_hf_weights(model, np.float32)
    bf16_bytes = sum(a.size * 2 for a in jax.tree.leaves(weights))
    assert rows[("bf16", 1)]["weight_bytes"] == bf16_bytes
    assert rows[("int8 (w8a8)", 1)]["weight_bytes"] < bf16_bytes
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    embed = weights.embed.size * 2  # untied: the gather reads `batch` rows of the table
    assert rows[("bf16", 1)]["step_bytes"] == pytest.approx(
        bf16_bytes - embed + embed / cfg.vocab_size + CONTEXT * kv_per_token)
    assert rows[("bf16", 1)]["copies"] == [] and rows[("int8 (w8a8)", 1)]["copies"] == []
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    w8a8 = rows[("int8 (w8a8)", 1)]  # native (at the CPU's highest ISA level) where the kernels run, else XLA
    assert (w8a8["matmuls"], w8a8["isa"]) in [("native", cpu_features.supported_levels()[-1]), ("XLA", None)]
    cell = w8a8["matmuls"] + (f" ({w8a8['isa']})" if w8a8["isa"] else "")
    assert f"| int8 (w8a8) | {cell} | 1 |" in section and "2 in a row a round per engine after one untimed step" in section and "- Batch 1: int8 (w8a8)" in section
    assert "steps chained as the engine's decode loop runs them" in section


@pytest.mark.parametrize("options, message", [
    (("--gemv", "--gemv-rows", "0,4"), "--gemv-rows '0,4': expected comma-separated integers in [1, 32]"),
    (("--gemv", "--gemv-rows", "33"), "--gemv-rows '33': expected comma-separated integers in [1, 32]"),
    (("--gemv", "--gemv-mib", "0"), "--gemv-mib must be > 0 (got 0.0)"),
    (("--gemv", "--gemv-rows", "1,x"), "--gemv-rows '1,x': expected comma-separated integers in [1, 32]"),
    (("--gemv-rows", "33"), "--gemv-rows '33': expected comma-separated integers in [1, 32]"),  # without --gemv
    (("--peer-steps", "0"), "--peer-steps 0: must be >= 1"),
    (("--burst", "0", "--reps", "-1"), "--reps -1, --burst 0: must be >= 1"),
    (("--bw-reps", "0"), "--bw-reps 0: must be >= 1"),
    (("--bw-gib", "0"), "--bw-gib 0.0 must be > 0"),
    (("--bw-gib", "nan"), "--bw-gib nan must be > 0"),
    (("--batches", "2,0"), "--batches '2,0': expected comma-separated integers >= 1"),
    (("--batches", "1,,2"), "--batches '1,,2': expected comma-separated integers >= 1"),
    (("--peer-rounds", "0"), "--peer-rounds 0 must be in [1, --reps 15]"),
    (("--reps", "2", "--peer-rounds", "3", "--llamacpp-python", sys.executable),
     "--peer-rounds 3 must be in [1, --reps 2]"),
    (("--peer-rounds", "2"), "--peer-rounds 2 must be in [1, --reps 15] (1 without a peer)"),
    (("--llamacpp-types", "Q4_0,Q5_K"), "--llamacpp-types 'Q4_0,Q5_K': unknown Q5_K"),
    (("--llamacpp-python", "/nonexistent/python"), "--llamacpp-python /nonexistent/python: no such interpreter"),
    (("--formats", " ; "), "--formats ' ; ': an empty item; expected ';'-separated names"),
    (("--formats", "bf16;;f32"), "--formats 'bf16;;f32': an empty item"),  # was dropped silently
    (("--isa", "avx2,,avx512_vnni"), "--isa 'avx2,,avx512_vnni': an empty item"),
    (("--formats", "bf16;int9"), "--formats: unknown ['int9']"),
    (("--isa", "avx2,sse9"), "--isa: ['sse9'] not among the levels this CPU runs"),
    (("--isa", "AVX2", "--native", "off"), "--isa 'AVX2' picks the native engines' ISA levels; --native off runs"),
])
def test_quant_bad_options_name_the_problem(options, message, capsys):
    from jaxinfer.cli import main

    assert main(["bench", "quant", *options]) == 2
    assert message in capsys.readouterr().err


def test_quant_native_both_needs_the_kernels(monkeypatch, capsys):
    """`--native both` with the kernels turned off is refused before any measuring, naming the variable."""
    from jaxinfer.cli import main

    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert main(["bench", "quant", "--native", "both"]) == 2
    assert "--native both: the native CPU matmul kernels are not available here (JAXINFER_NATIVE_KERNELS=0" in (
        capsys.readouterr().err)


def test_native_kernel_calls_counts_the_kernels_custom_calls():
    """A jitted native call shows up once by kernel name, in optimized HLO and in StableHLO; XLA's dot not at all."""
    import jax.numpy as jnp

    from jaxinfer.benchmarks.hlo import native_kernel_calls
    from pallas_kernels import cpu_gemv

    if not cpu_gemv.active():
        pytest.skip("the native CPU kernels are not available here")
    x, w = jnp.ones((2, 64), jnp.float32), jnp.ones((64, 16), jnp.bfloat16)
    both = jax.jit(lambda x, w: cpu_gemv.float_matmul(x, w, input_major=True) + jnp.dot(x, w.astype(x.dtype)))
    lowered = both.lower(x, w)
    assert native_kernel_calls(lowered.as_text()) == {"float_matmul": 1}
    assert native_kernel_calls(lowered.compile().as_text()) == {"float_matmul": 1}
    assert native_kernel_calls(jax.jit(jnp.dot).lower(x, w).compile().as_text()) == {}


@pytest.mark.parametrize("kind", ["bf16", "int8 weight-only", "int8 (w8a8)", "int4 g32"])
def test_gemv_weights_their_bytes_and_both_paths_agree(kind):
    """The micro-benchmark's weight has the bytes its layout implies (values + f32 scales), and its native call
    computes XLA's product (w8a8: the int32 dot, before the scales XLA's path applies)."""
    import jax.numpy as jnp

    from jaxinfer.benchmarks import gemv_stream
    from models import quant4
    from pallas_kernels import cpu_gemv

    if not cpu_gemv.active():
        pytest.skip("the native CPU kernels are not available here")
    w = gemv_stream.make_weight(kind, 0.25)
    k = gemv_stream.K
    per_row = {"bf16": 2 * k, "int4 g32": k // 2 + 4 * (k // 32)}.get(kind, k + 4)
    n = int(0.25 * 2**20) // ({"bf16": 2 * k, "int4 g32": k // 2}.get(kind, k)) // 8 * 8
    assert gemv_stream.weight_bytes(w) == n * per_row
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, k)), jnp.bfloat16)
    fn, arg = gemv_stream.native_call(kind, w, x)
    got = np.asarray(fn(arg, w), np.float64)
    if kind == "bf16":
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    elif kind == "int4 g32":  # reference: the dequantized weight, independent of both paths
        codes = np.asarray(quant4.unpack(np.asarray(w.values)), np.float64).reshape(n, k // 32, 32)
        dense = ((codes - 8) * np.asarray(w.scale)[..., None]).reshape(n, k)
        want = np.asarray(x, np.float64) @ dense.T
    elif kind == "int8 (w8a8)":
        want = np.asarray(arg, np.float64) @ np.asarray(w.values, np.float64).T
    else:
        want = np.asarray(x, np.float64) @ (np.asarray(w.values, np.float64) * np.asarray(w.scale)).T
    tol = 1e-4 if kind in ("int4 g32", "int8 weight-only") else 1e-5  # weight-only: the activations' int16 rounding
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    if kind != "int8 (w8a8)":
        xla = np.asarray(gemv_stream.xla_call(x, w), np.float64)
        assert np.abs(xla - want).max() <= 2e-2 * np.abs(want).max()


def test_gemv_weight_checks():
    from jaxinfer.benchmarks import gemv_stream

    with pytest.raises(ValueError, match="unknown micro-benchmark weight 'fp8'"):
        gemv_stream.make_weight("fp8", 1)
    with pytest.raises(ValueError, match="fewer than 8 output channels"):
        gemv_stream.make_weight("bf16", 0.01)


def test_quant_native_both_peers_and_gemv(tmp_path):
    """One run of every new part on the tiny HF Llama: weight-only int8 with the native kernels (at every ISA level
    this CPU runs, `--isa all`) and with XLA, the stub peers, and a 0.25 MiB micro-benchmark; the kernels are in
    the native steps' HLO and not in XLA's, and the peers' rooflines follow from their bytes."""
    from pallas_kernels import cpu_gemv

    if not cpu_gemv.active():
        pytest.skip("the native CPU kernels are not available here")
    model = make_tiny_model_dir(tmp_path / "tiny")
    stub = ["--peer-python", sys.executable, "--peer-script", str(STUB_PEER), "--llamacpp-python", sys.executable,
            "--llamacpp-script", str(STUB_PEER), "--llamacpp-cache", str(tmp_path / "cache")]
    report, written = run_bench(tmp_path, "quant", "--model", str(model), "--formats", "int8 weight-only",
                                "--batches", "1", "--reps", "2", "--peer-rounds", "2", "--max-model-len", "256",
                                "--bw-gib", "0.016",
                                "--bw-reps", "1", "--native", "both", "--gemv", "--gemv-mib", "0.25",
                                "--gemv-rows", "1,8", "--gemv-reps", "1", "--peer-steps", "2", "--isa", "all", *stub)
    data = report["data"]
    levels = cpu_features.supported_levels()
    rows = {(r["matmuls"], r["isa"]): r for r in data["rows"]}
    assert set(rows) == {("native", level) for level in levels} | {("XLA", None)}
    for level in levels:
        native = rows[("native", level)]
        assert native["weight_bytes"] == rows[("XLA", None)]["weight_bytes"]
        assert native["native_calls"].get("weight_only_matmul", 0) >= 1
        assert f"| int8 weight-only | native ({level}) | 1 |" in written
    assert rows[("XLA", None)]["native_calls"] == {}
    cfg, _ = load_hf_weights(model, np.float32)
    kv_f16 = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    peer_rows = {(p["peer"], p["weights"]): p for p in data["peer_rows"]}
    assert set(peer_rows) == {("llama.cpp", t) for t in ("Q4_0", "Q8_0", "BF16")} | {("HF transformers", "bfloat16")}
    q4 = peer_rows[("llama.cpp", "Q4_0")]
    assert q4["tok_s"] == 20.0 and q4["runs"] == [20.0, 20.0]  # the stub's 50 ms step, run after each round
    assert data["peer_runs"] == 2
    assert q4["roofline_tok_s"] == pytest.approx(data["roofline_gb_s"] * 1e9 / (70e6 + kv_f16 * q4["context"]))
    assert peer_rows[("HF transformers", "bfloat16")]["roofline_tok_s"] is None  # no bf16 row to take bytes from
    assert [(g["isa"], g["kind"], g["rows"]) for g in data["gemv"]] == [
        (level, k, m) for level in levels for k in ("bf16", "int8 weight-only", "int8 (w8a8)", "int4 g32")
        for m in (1, 8)]
    for g in data["gemv"]:
        for key in ("native_gb_s", "xla_gb_s"):
            assert_positive_finite(g[key], key)
        assert g["native_gb_s"] == pytest.approx(g["bytes"] / g["native_ms"] / 1e6)
    begin, end = SECTION
    section = written[written.index(begin):written.index(end)]
    for expected in ("| int8 weight-only | XLA | 1 |",
                     "| llama.cpp | Q4_0 | ", "| 20.0 (20.0-20.0, 2 runs) |", "Kernel micro-benchmark", "| int4 g32 (avx2) | 8 | [128, 4096] | 0 |",
                     "- Batch 1, native kernels over XLA (tok/s): int8 weight-only ",
                     "- Goal: >= 70% of the weight-read roofline"):
        assert expected in section, expected


@pytest.mark.parametrize("before", [None, "1", "0"])
def test_native_kernels_sets_the_users_switch_and_puts_it_back(monkeypatch, before):
    """XLA rows run as a user turns the kernels off (the variable, which the runner's padding reads too), native
    rows with the user's setting (kernels the user turned off stay off), an ISA level only when one is given;
    whatever was set before is restored."""
    import os

    from jaxinfer.benchmarks.quant import NATIVE_VARIABLE, native_kernels
    from pallas_kernels import cpu_gemv

    if before is None:
        monkeypatch.delenv(NATIVE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(NATIVE_VARIABLE, before)
    monkeypatch.delenv("JAXINFER_NATIVE_ISA", raising=False)
    with native_kernels(False):
        assert os.environ[NATIVE_VARIABLE] == "0" and not cpu_gemv.active()
    with native_kernels(True):
        assert os.environ.get(NATIVE_VARIABLE) == before
    with native_kernels(True, "avx2"):
        assert os.environ["JAXINFER_NATIVE_ISA"] == "avx2" and os.environ.get(NATIVE_VARIABLE) == before
    assert os.environ.get(NATIVE_VARIABLE) == before and "JAXINFER_NATIVE_ISA" not in os.environ


def test_merge_runs_takes_each_peers_median_run():
    run = lambda tok_s: {"results": {"Q4_0": {"decode_tok_s": tok_s, "model_bytes": 7}}}  # noqa: E731
    merged = peers.merge_runs([run(200.0), None, {"error": "peer exited with 1"}, run(100.0), run(250.0)])
    assert merged["results"]["Q4_0"] == {"decode_tok_s": 200.0, "decode_tok_s_runs": [200.0, 100.0, 250.0],
                                         "model_bytes": 7}
    assert peers.merge_runs([None, {"error": "no model"}]) == {"error": "no model"}
    assert peers.merge_runs([None]) is None


def test_chained_bursts_never_time_the_rounds_first_step(monkeypatch):
    """With `--burst B`, a round's first step runs after the other engines' calls (cold caches); chained, the first
    call only dispatches it, so it must be read before the timed calls start, or one of them waits for it."""
    import argparse

    from jaxinfer.benchmarks import quant
    from jaxinfer.benchmarks.decode_timing import ChainedSteps

    reads: list[int] = []  # steps in the order read
    firsts: list[int] = []  # each round's first step
    windows: list[list[int]] = []  # the steps read inside each timed_calls (its last: the untimed flush)

    class Runner:
        steps = 0

        def submit(self, chunks, rows, fed_from=None):
            Runner.steps += 1
            n = Runner.steps
            if chain.pending is None:
                firsts.append(n)
            return type("Step", (), {"result": lambda self: reads.append(n)})()

    chain = ChainedSteps(Runner(), [], [])
    row = {"batch": 1, "times": [], "matmuls": "native", "isa": None}
    monkeypatch.setattr(quant, "_setup", lambda *a: ([(chain, row)], None))
    timed_calls = quant.timed_calls

    def timed(fn, n):
        start = len(reads)
        try:
            return timed_calls(fn, n)
        finally:
            windows.append(reads[start:])

    monkeypatch.setattr(quant, "timed_calls", timed)
    quant.measure(argparse.Namespace(native="on", reps=3, burst=4, async_scheduling=True), ["f"], [1])
    assert reads == list(range(1, len(reads) + 1))  # every step read once, in order
    assert len(firsts) == len(windows) == 3 and all(len(w) == 4 for w in windows)  # burst - 1 timed + the flush
    for first, window in zip(firsts, windows):
        assert first not in window[:-1], (first, window)


def test_quant_batches_past_the_kv_cache_name_the_option(tmp_path, capsys):
    """A batch whose sequences do not fit the benchmark's KV cache is refused naming `--batches`, not with the page
    allocator's own words."""
    from jaxinfer.cli import main

    model = make_tiny_model_dir(tmp_path / "tiny")
    assert main(["bench", "quant", "--model", str(model), "--formats", "bf16", "--batches", "100000", "--reps", "1",
                 "--max-model-len", "256", "--bw-gib", "0.016", "--bw-reps", "1"]) == 2
    assert "--batches 100000: needs 900000 KV pages (context 128); the cache holds" in capsys.readouterr().err
