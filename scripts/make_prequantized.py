"""Writes tiny pre-quantized HF folders, one per checkpoint layout that jaxinfer loads kept quantized
(`jaxinfer/loading/prequantized.py`), from the float weights of a tiny golden (default tests/data/tiny_llama3).

numpy, ml_dtypes and safetensors only: no torch and no quantization library, so the folders can be written again on
any machine. The quantizers are plain round-to-nearest (not GPTQ's or AWQ's calibration: only the stored layout
matters to a loader); the packing follows each format's documentation (table in jaxinfer/loading/prequantized.py's
docstring). Every projection of every layer (q, k, v, o, gate, up, down; an MoE source's experts too, e.g.
tests/data/tiny_qwen3_moe) is quantized; the embedding, a router and (except in `ct_fp8_channel`) the LM head are
stored as float16, the norms as the source's float32, and config.json is the source's plus a `quantization_config`.

| folder | quantization_config | stored per projection |
|---|---|---|
| fp8_block | fp8, weight_block_size [16, 32] | weight f8e4m3, weight_scale_inv f32 [out/16, in/32] |
| fp8_tensor | fp8, per tensor | weight f8e4m3, weight_scale f32 [] |
| ct_fp8_channel | compressed-tensors float-quantized, channel | weight f8e4m3, weight_scale bf16 [out, 1]; LM head too |
| gptq | gptq v1, sym, group 32 | qweight, qzeros (7 = zero 8 minus 1), scales f16, g_idx |
| gptq_asym | gptq v1, sym false, group 32 | the same with per-group zero points |
| awq | awq GEMM, group 32 | qweight, qzeros (interleaved), scales f16 |
| ct_w4a16 | compressed-tensors pack-quantized, group 32 | weight_packed, weight_scale bf16, weight_shape |

    .venv/bin/python scripts/make_prequantized.py --source tests/data/tiny_llama3 --out tests/data/prequantized
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

log = logging.getLogger("make_prequantized")

# The projections' names end so (HF Llama-style attention and MLP, MoE experts and shared experts), the routers' not
PROJECTIONS = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 32
BLOCK = (16, 32)  # fp8_block's [rows, cols]: not square, so swapped axes would show
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output column 8c + AWQ_ORDER[k]


def pack_nibbles(codes: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words of 4-bit codes (values 0..15) along `axis`: nibble k of word j holds element 8j + order[k]."""
    c = np.moveaxis(codes.astype(np.uint32), axis, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    words = np.zeros(c.shape[:-1], np.uint32)
    for k, element in enumerate(order):
        words |= c[..., element] << np.uint32(4 * k)
    return np.moveaxis(words.view(np.int32), -1, axis)


def fp8(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.float8_e4m3fn)


def nonzero(scale: np.ndarray) -> np.ndarray:
    return np.where(scale > 0, scale, 1.0)


# Each writer: (module name, float32 weight [out, in]) -> the tensors stored for it.


def fp8_block(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    rows, cols = BLOCK
    out, size_in = w.shape
    blocks = np.abs(w).reshape(out // rows, rows, size_in // cols, cols).max(axis=(1, 3))
    s = (nonzero(blocks) / FP8_MAX).astype(np.float32)  # [out/rows, in/cols]
    return {f"{m}.weight": fp8(w / np.repeat(np.repeat(s, rows, 0), cols, 1)), f"{m}.weight_scale_inv": s}


def fp8_tensor(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    s = np.float32(nonzero(np.abs(w).max()) / FP8_MAX)
    return {f"{m}.weight": fp8(w / s), f"{m}.weight_scale": np.array(s, np.float32)}


def ct_fp8_channel(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    s = (nonzero(np.abs(w).max(axis=1, keepdims=True)) / FP8_MAX).astype(ml_dtypes.bfloat16)  # [out, 1]
    return {f"{m}.weight": fp8(w / s.astype(np.float32)), f"{m}.weight_scale": s}


def _int4_groups(w: np.ndarray, symmetric: bool, half_range: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round-to-nearest 4-bit codes of `w` [out, in] per group of GROUP inputs: (codes [out, in] in 0..15, f16
    scales [out, G], integer zero points [out, G]); w ~ scale * (code - zero)."""
    out, size_in = w.shape
    g = w.reshape(out, size_in // GROUP, GROUP)
    if symmetric:
        scale = (nonzero(np.abs(g).max(-1)) / half_range).astype(np.float16)
        zero = np.full(scale.shape, 8, np.int64)
    else:
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = (nonzero(hi - lo) / 15).astype(np.float16)
        zero = np.clip(np.rint(-lo / scale.astype(np.float32)), 1, 15).astype(np.int64)  # >= 1: v1 stores zero - 1
    codes = np.clip(np.rint(g / scale[..., None].astype(np.float32)) + zero[..., None], 0, 15)
    return codes.reshape(out, size_in).astype(np.uint8), scale, zero


def _gptq(m: str, w: np.ndarray, symmetric: bool) -> dict[str, np.ndarray]:
    codes, scale, zero = _int4_groups(w, symmetric, 7.5)
    size_in = w.shape[1]
    return {f"{m}.qweight": pack_nibbles(codes.T, 0),  # [in/8, out]
            f"{m}.qzeros": pack_nibbles((zero - 1).T, 1),  # [in/G, out/8], v1: zero - 1
            f"{m}.scales": np.ascontiguousarray(scale.T),  # [in/G, out]
            f"{m}.g_idx": (np.arange(size_in) // GROUP).astype(np.int32)}


def gptq(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    return _gptq(m, w, symmetric=True)


def gptq_asym(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    return _gptq(m, w, symmetric=False)


def awq(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    codes, scale, zero = _int4_groups(w, False, 7.5)
    return {f"{m}.qweight": pack_nibbles(codes.T, 1, AWQ_ORDER),  # [in, out/8]
            f"{m}.qzeros": pack_nibbles(zero.T, 1, AWQ_ORDER),  # [in/G, out/8]
            f"{m}.scales": np.ascontiguousarray(scale.T)}  # [in/G, out]


def ct_w4a16(m: str, w: np.ndarray) -> dict[str, np.ndarray]:
    codes, scale, _ = _int4_groups(w, True, 7.5)  # code = q + 8, q in [-8, 7]
    return {f"{m}.weight_packed": pack_nibbles(codes, 1), f"{m}.weight_scale": scale.astype(ml_dtypes.bfloat16),
            f"{m}.weight_shape": np.array(w.shape, np.int64)}


_CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
               "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                     "dynamic": True}}},
           "ignore": []}
_CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                 "dynamic": False, "actorder": None}, "input_activations": None}},
             "ignore": ["lm_head"]}
_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
         "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01}

# folder -> (writer, quantization_config, whether the LM head is quantized too)
FOLDERS: dict[str, tuple[Callable[[str, np.ndarray], dict[str, np.ndarray]], dict, bool]] = {
    "fp8_block": (fp8_block, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head"]}, False),
    "fp8_tensor": (fp8_tensor, {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]},
                   False),
    "ct_fp8_channel": (ct_fp8_channel, _CT_FP8, True),
    "gptq": (gptq, _GPTQ, False),
    "gptq_asym": (gptq_asym, {**_GPTQ, "sym": False}, False),
    "awq": (awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": None}, False),
    "ct_w4a16": (ct_w4a16, _CT_W4A16, False),
}


def write_folder(source: Path, dst: Path, name: str) -> None:
    """Writes `dst` (config.json + model.safetensors): `source`'s tensors with its projections quantized as `name`."""
    writer, qconfig, quantize_head = FOLDERS[name]
    tensors = load_file(source / "model.safetensors")
    modules = [k.removesuffix(".weight") for k in tensors
               if k.endswith(PROJECTIONS) or (quantize_head and k == "lm_head.weight")]
    # float16 for the plain matrices (the embedding, a float LM head): half the bytes, and exact in float32
    out = {k: v.astype(np.float16) if v.ndim == 2 else v for k, v in tensors.items()
           if k.removesuffix(".weight") not in modules}
    for m in sorted(modules):
        out.update(writer(m, np.asarray(tensors[f"{m}.weight"], np.float32)))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = qconfig
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(out.items())}, dst / "model.safetensors")
    log.info("%s: %d projections quantized, %.1f KiB", dst, len(modules), (dst / "model.safetensors").stat().st_size
             / 1024)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--source", type=Path, default=Path("tests/data/tiny_llama3"), help="a float HF folder")
    ap.add_argument("--out", type=Path, default=Path("tests/data/prequantized"), help="one subfolder per layout")
    ap.add_argument("--only", choices=list(FOLDERS), action="append", default=None, help="write just this layout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in args.only or FOLDERS:
        write_folder(args.source, args.out / name, name)


if __name__ == "__main__":
    main()
