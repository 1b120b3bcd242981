"""`--quantization` of `jaxinfer convert`, `generate` and `serve`, run as a user runs them (subprocesses): a
checkpoint converted quantized generates the tokens of quantizing at load, and bad values exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jaxinfer.loading.multi_device_orbax_checks import make_tiny_hf_folder

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=ENV)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_convert_quantized_then_generate_from_it(tmp_path):
    src = make_tiny_hf_folder(tmp_path / "tiny", REPO / "tests" / "data" / "tiny_llama3")
    ckpt = tmp_path / "tiny_int8"
    common = ["--prompt", "hello world", "--temperature", "0", "--max-tokens", "8", "--json",
              "--kv-cache-memory-bytes", str(1 << 20)]
    at_load = _start("generate", "--model", str(src), "--quantization", "int8", *common)  # beside the conversion
    done = _finish(_start("convert", "--model", str(src), "--output", str(ckpt), "--quantization", "int8"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{ckpt}\n" and "quantized to int8" in done.stderr
    meta = json.loads((ckpt / "jaxinfer_checkpoint.json").read_text())
    assert meta["quantization"]["config"]["format"] == "int8"

    from_ckpt = _finish(_start("generate", "--model", str(ckpt), *common))
    at_load = _finish(at_load)
    assert from_ckpt.returncode == 0 and at_load.returncode == 0, from_ckpt.stderr + at_load.stderr
    assert "as stored in the checkpoint" in from_ckpt.stderr and "quantization: QuantizationConfig(" in from_ckpt.stderr
    got, want = json.loads(from_ckpt.stdout), json.loads(at_load.stdout)
    assert len(got["token_ids"]) == 8 and got["token_ids"] == want["token_ids"]
    assert got["quantization"] == want["quantization"] == {
        "format": "int8", "group_size": 0, "quantize_activations": False, "quantize_embedding": True,
        "quantize_lm_head": True, "activation_group_size": 0, "asymmetric": False, "embedding_format": None}
    assert got["weight_bytes"] == want["weight_bytes"] and got["weight_bytes"]["quantized_share"] > 0.9
    # int8 values + f32 scales: about a quarter of the float32 bytes of the quantized weights
    assert got["weight_bytes"]["quantized_bytes"] < 0.3 * 4 * got["weight_bytes"]["quantized_params"]


@pytest.mark.parametrize("command, value, message", [
    ("generate", "int3", "quantization format='int3' is not one of int8, fp8, int4"),
    ("generate", "[1,2]", "quantization '[1,2]' is neither a format name (int8, fp8, int4, mxfp8, mxfp4, nvfp4, gguf) nor "
                          "a JSON object"),
    ("generate", "8", "quantization '8' is neither a format name"),
    ("generate", '{"group_size": 128}', "needs the key(s) format"),
    ("generate", '{"format": "fp8", "group_size": -1', "quantization config is not valid JSON"),
    ("convert", '{"format": "int8", "group_size": 128}', "group_size is for fp8"),
    ("serve", '{"format": "int8", "bits": 8}', "unknown quantization config key(s) 'bits'; known:"),
])
def test_bad_quantization_exits_2_with_one_line(command, value, message, tmp_path):
    args = {"generate": ["--prompt", "x"], "convert": ["--output", str(tmp_path / "out")],
            "serve": ["--port", "0", "--http-port", "0", "--no-warmup"]}[command]
    done = _finish(_start(command, *args, "--quantization", value))
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("jaxinfer: error: --quantization: "), done.stderr
    assert message in errors[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not (tmp_path / "out").exists()


def test_generate_int4_at_load_and_convert_stores_nvfp4(tmp_path):
    src = make_tiny_hf_folder(tmp_path / "tiny", REPO / "tests" / "data" / "tiny_llama3")
    converted = _start("convert", "--model", str(src), "--output", str(tmp_path / "out"), "--quantization", "nvfp4")
    done = _finish(_start("generate", "--model", str(src), "--quantization", "int4", "--prompt", "hello world",
                          "--temperature", "0", "--max-tokens", "6", "--json", "--kv-cache-memory-bytes", str(1 << 20)))
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert len(got["token_ids"]) == 6
    assert got["quantization"] == {"format": "int4", "group_size": 32, "quantize_activations": False,
                                   "quantize_embedding": False, "quantize_lm_head": False,
                                   "activation_group_size": 0, "asymmetric": False, "embedding_format": None}
    assert got["weight_bytes"]["quantized_share"] > 0.5
    # packed codes (half a byte each) plus an f32 scale per 32 (per 16 on wo's 16-wide head axis)
    assert got["weight_bytes"]["quantized_bytes"] < 0.2 * 4 * got["weight_bytes"]["quantized_params"]
    converted = _finish(converted)  # every format is stored (tests/jaxinfer/loading/test_orbax_quant.py: restores)
    assert converted.returncode == 0 and "quantized to nvfp4" in converted.stderr, converted.stderr
    meta = json.loads((tmp_path / "out" / "jaxinfer_checkpoint.json").read_text())
    assert meta["quantization"]["config"]["format"] == "nvfp4"
    assert meta["quantization"]["weights"]["layers.wq"]["stacked_axes"] == 1  # one tensor scale per layer
