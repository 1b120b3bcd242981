"""Smoke test of `jaxinfer bench startup`'s pieces: a `generate` start on the tiny model, cold then warm (the warm
start restores what the cold one cached: it must find compiled shapes in the cache folder it was given), and the
warm-up log line the serve row reads."""

from __future__ import annotations

import argparse
import os

from jaxinfer.benchmarks import startup
from jaxinfer.cache_dirs import COMPILATION_CACHE_VARIABLE, MODEL_CACHE_VARIABLE
from tests.jaxinfer.benchmarks.bench_runner import assert_positive_finite
from tests.jaxinfer.engine.tiny_model import make_tiny_model_dir


def test_a_cold_then_warm_generate_start(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny")  # with a tokenizer
    args = argparse.Namespace(model=str(model), dtype="float32", reps=1, timeout=300.0)
    env = {**os.environ, COMPILATION_CACHE_VARIABLE: str(tmp_path / "xla"), MODEL_CACHE_VARIABLE: str(tmp_path / "m")}
    cold = startup._generate(args, env, [])
    filled = len(list((tmp_path / "xla").iterdir()))
    warm = startup._generate(args, env, [])
    assert filled > 0 and len(list((tmp_path / "xla").iterdir())) == filled  # the warm start compiled nothing new
    for r in (cold, warm):
        assert_positive_finite(r["first_token_s"], "first_token_s")
        assert r["peak_rss_bytes"] > 100 << 20


def test_the_warmup_line_is_read_from_the_log(tmp_path):
    with open(tmp_path / "log", "w+") as log:
        assert startup._warmup_line(log) is None
        log.write("12:00:00 INFO jaxinfer.engine.warmup: compiled 28 step shapes in 4.5 s in the background (28 loaded "
                  "from the persistent compilation cache, 0 compiled and stored)\n")
        assert startup._warmup_line(log) == {"warmup_shapes": 28, "warmup_s": 4.5, "warmup_cache_hits": 28}


def test_warm_from_runs_only_warm_starts_of_the_rows_asked(tmp_path, monkeypatch):
    """`--warm-from DIR` skips the cold start and points both caches at DIR; `--rows` picks rows; bad values name
    themselves."""
    import pytest

    calls = []

    def fake(args, env, extra):
        calls.append((env[COMPILATION_CACHE_VARIABLE], env[MODEL_CACHE_VARIABLE], extra))
        return {"first_token_s": 1.0 + len(calls), "peak_rss_bytes": 1 << 30}

    monkeypatch.setattr(startup, "ROWS", [("generate", fake, []), ("serve --warmup", fake, ["--x"])])
    (tmp_path / "xla").mkdir()
    args = argparse.Namespace(model=None, dtype="float32", reps=2, timeout=1.0, rows="generate",
                              warm_from=str(tmp_path))
    report = startup.run(args)
    assert calls == [(str(tmp_path / "xla"), str(tmp_path / "models"), [])] * 2  # two warm starts, no cold one
    assert report.data["rows"] == {"generate": {"cold": None, "warm": {"first_token_s": 2.5,
                                                                       "peak_rss_bytes": 1 << 30}}}
    assert "not run (--warm-from)" in report.markdown and f"--warm-from {tmp_path}" in report.markdown
    with pytest.raises(ValueError, match="--rows 'serve': the rows are 'generate', 'serve --warmup'"):
        startup.run(argparse.Namespace(**{**vars(args), "rows": "serve"}))
    with pytest.raises(ValueError, match="no xla/ folder of compiled shapes there"):
        startup.run(argparse.Namespace(**{**vars(args), "warm_from": str(tmp_path / "empty")}))
