"""`convert`: a GGUF file or HF folder (or an unquantized jaxinfer checkpoint) into a jaxinfer orbax checkpoint
(`jaxinfer.loading.orbax_format`), in float32 or bfloat16, optionally quantized (`models.quant`) on the way.

Errors are `ValueError`s (see `convert`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxinfer.loading.loader import default_model_path, load_model, stored_quantization
from jaxinfer.loading.orbax import check_output_dir, save
from jaxinfer.loading.orbax_format import checked_dtype, checkpoint_quantization, is_orbax_checkpoint
from models import quant
from models.quant import QuantizationConfig

logger = logging.getLogger(__name__)


def convert(src: str | os.PathLike | None, output_dir: str | os.PathLike, dtype: str = "float32",
            quantization: QuantizationConfig | Mapping[str, Any] | str | None = None) -> Path:
    """Converts a GGUF file or HF folder (or another jaxinfer checkpoint) into a jaxinfer orbax checkpoint.

    Args:
      src: a `.gguf` file, an HF folder, an unquantized checkpoint folder, or None for the default SmolLM2 GGUF.
      output_dir: a folder that does not exist yet or is empty.
      dtype: "float32" or "bfloat16": the dtype the weights are stored in (with `quantization`: the weights left
        unquantized, which is also the activation dtype `models.quant.quantize_weights` casts them to).
      quantization: None, a format name (`models.quant.FORMATS`), or a `models.quant.QuantizationConfig` / dict / JSON
        object of its fields: the weights are read in float32 and quantized as `EngineConfig.quantization` would
        quantize them at load (the same computation, so the same values and scales), then stored quantized.

    Returns:
      The checkpoint folder as an absolute `Path`.

    Raises:
      ValueError: a bad dtype or quantization, an output folder that exists and is not empty, a source that is
        already quantized, or any `load_model` error (missing source, not a model, a tensor that does not fit the
        config).
    """
    dt = checked_dtype(dtype)
    qcfg = QuantizationConfig.from_value(quantization)
    if qcfg is not None and qcfg.format == "gguf":
        raise ValueError("quantization gguf is not stored in checkpoints yet; use it at load instead "
                         "(--quantization gguf on generate / serve)")
    out = Path(output_dir).resolve()
    check_output_dir(out)  # before the slow load
    source = default_model_path() if src is None else Path(src)
    if is_orbax_checkpoint(source) and checkpoint_quantization(source) is not None:
        raise ValueError(f"{str(source)!r} is a quantized checkpoint already; convert from the original model")
    if not is_orbax_checkpoint(source) and stored_quantization(source) is not None:
        raise ValueError(f"{str(source)!r} is a pre-quantized HF folder ({stored_quantization(source).format}); "
                         "load it directly (--model FOLDER), or convert from the original model")
    logger.info("loading %s as %s", source, dt.name if qcfg is None else "float32, to quantize")
    t0 = time.perf_counter()
    cfg, weights, tokenizer = load_model(source, dt if qcfg is None else np.dtype(np.float32))
    logger.info("loaded %s in %.1f s", cfg.name or source, time.perf_counter() - t0)
    if qcfg is not None:
        t0 = time.perf_counter()
        weights = jax.device_get(jax.jit(functools.partial(quant.quantize_weights, cfg=cfg, qcfg=qcfg,
                                                           dtype=dt))(weights))
        share = quant.weight_bytes(weights)["quantized_share"]
        logger.info("quantized to %s (%.0f%% of parameters) in %.1f s: %s", qcfg.format, 100 * share,
                    time.perf_counter() - t0, qcfg.resolved())
    return save(out, cfg, weights, tokenizer, source=str(source.resolve()) if source.exists() else str(source),
                quantization=qcfg)
