"""Which weights are quantized and how: `QuantizationConfig` and the format names (`models.quant` holds the
quantized weight type and the quantizers; it re-exports these names, so `from models.quant import
QuantizationConfig` keeps working)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from models import mxfp, quant4
from models.config import options_from_value

FORMATS = ("int8", "fp8", "int4", *mxfp.FORMATS)
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32  # GGUF Q4_0/Q4_1 and MX blocks; the quality bar is for group 32
GROUP_FALLBACK_FORMATS = ("int4", *mxfp.FORMATS)  # a group that does not divide a weight's axis: gcd (else per channel)


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Which weights are quantized, and how.

    Attributes:
      format: "int8" (symmetric, per output channel), "fp8" (e4m3), "int4" (`models.quant4`, weight-only), or the
        microscaling formats "mxfp8", "mxfp4", "nvfp4" (`models.mxfp`; mxfp4 and nvfp4 weight-only); or "gguf": a
        GGUF file's Q8_0 / Q4_0 / Q4_1 tensors kept as stored (`jaxinfer.loading.gguf_quant`), no other field set.
      group_size: fp8: input channels per scale (e.g. 128), 0 for per output channel. A weight whose last
        contracted axis it does not divide keeps per-channel scales (`quantize_weights` logs none; see
        `weight_bytes`). int4: 32, 64 or 128 (0 means 32); a weight whose last contracted axis it does not divide
        takes the largest group dividing both (a 16-wide head axis: 16). mxfp8 / mxfp4 / nvfp4: the format's block
        (32 / 32 / 16; 0 means it, nothing else is accepted), with the same gcd fallback per weight.
      quantize_activations: dynamic per-token activation quantization with the native low-precision dot (w8a8);
        None or False: weight-only (the default: quality first). w8a8 is the fast int8 path on CPU (XLA:CPU's
        int8 x int8 -> int32 dot, and no full-precision weight copy), at a quality cost measured in
        BENCHMARKS.md. mxfp8: activations quantized per token to MXFP8 blocks (the weight's blocks along the
        contracted axes), one e4m3 x e4m3 dot per block. int4 (w4a8; symmetric groups of 32 only): activations
        quantized to int8 per token per block of 32 inputs, one exact int32 dot per block (GGUF Q4_0 x Q8_0,
        llama.cpp's CPU arithmetic), the same int4 weights as without it; a weight whose input axis 32 does not
        divide stays weight-only. mxfp4 and nvfp4 are weight-only.
      quantize_embedding: the embedding gather reads a quantized table; None: yes for int8, no for fp8 (int4 and
        the microscaling formats: no, and true is refused: the gather takes no grouped table).
      quantize_lm_head: the output projection is quantized (with tied embeddings and an unquantized gather, an
        extra quantized copy of the table serves the head); None: yes for int8, no for the others (as vLLM's fp8
        and NVFP4 keep the head in full precision). On SmolLM2, fp8's perplexity is +3.4% over bf16 with them
        quantized and +1.5% without; int8's barely moves (BENCHMARKS.md).
      activation_group_size: with activation quantization, one activation scale per token per this many input
        channels instead of one per token: closer to the unquantized model, slower on CPU (BENCHMARKS.md). int8 and
        fp8 only (mxfp8's activation blocks are its weight blocks).
      asymmetric: int4 only: a min per group too (w = scale * q + min, GGUF Q4_1's and zero-point GPTQ/AWQ's form;
        `models.quant4`) instead of symmetric codes (w = scale * (q - 8)); 4 more bytes per group. On SmolLM2, whose
        weights come from a Q4_1 file, asymmetric groups of 32 land on the file's own grid (BENCHMARKS.md).
      embedding_format: int4 only: "int8" quantizes the embedding table and the LM head to int8 (per vocabulary
        row, as format "int8" does; with tied embeddings one table serves both) while the layers stay int4:
        llama.cpp's Q4_0 files keep their token embedding in Q8_0 the same way. Both are then quantized unless
        quantize_embedding / quantize_lm_head say otherwise. None: the embedding and head follow `format`.
    """

    format: str = "int8"
    group_size: int = 0
    quantize_activations: bool | None = None
    quantize_embedding: bool | None = None
    quantize_lm_head: bool | None = None
    activation_group_size: int = 0
    asymmetric: bool = False
    embedding_format: str | None = None

    def __post_init__(self) -> None:
        if self.format not in (*FORMATS, "gguf"):
            raise ValueError(f"quantization format={self.format!r} is not one of {', '.join(FORMATS)}, gguf")
        if self.embedding_format is not None and self.embedding_format != "int8":
            raise ValueError(f"embedding_format={self.embedding_format!r} must be \"int8\" or unset")
        if self.embedding_format is not None and self.format != "int4":
            raise ValueError(f"embedding_format applies only to format int4 (got format {self.format})")
        if self.embedding_format is not None and self.quantize_embedding is False and self.quantize_lm_head is False:
            raise ValueError("embedding_format=\"int8\" quantizes nothing with quantize_embedding and quantize_lm_head "
                             "both false: leave it out")
        if self.format == "gguf" and (self.activation_group_size or self.asymmetric or any(
                getattr(self, f) is not None for f in ("quantize_activations", "quantize_embedding", "quantize_lm_head"))):
            raise ValueError(f"quantization gguf keeps the GGUF file's own types: set no other field ({self})")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0:
            raise ValueError(f"quantization group_size={self.group_size!r} must be an integer >= 0")
        if self.group_size and self.format in ("int8", "gguf"):
            raise ValueError(f"quantization group_size is for fp8, int4 and the microscaling formats; {self.format} "
                             "sets its own scales")
        if self.format == "int4":
            object.__setattr__(self, "group_size", self.group_size or DEFAULT_INT4_GROUP_SIZE)
            quant4.check_config(self.group_size, INT4_GROUP_SIZES, self.quantize_activations,
                                self.quantize_embedding and self.embedding_format is None, self.asymmetric,
                                self.activation_group_size)
        if (not isinstance(self.activation_group_size, int) or isinstance(self.activation_group_size, bool)
                or self.activation_group_size < 0):
            raise ValueError(f"activation_group_size={self.activation_group_size!r} must be an integer >= 0")
        if self.format in mxfp.FORMATS:
            object.__setattr__(self, "group_size", self.group_size or mxfp.BLOCK[self.format])
            mxfp.check_config(self.format, self.group_size, self.quantize_activations, self.quantize_embedding,
                              self.activation_group_size)
        if self.group_size and self.quantize_activations and self.format not in ("mxfp8", "int4"):
            raise ValueError("activation quantization needs per-channel scales (group_size 0)")
        for name in ("quantize_activations", "quantize_embedding", "quantize_lm_head"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true, false or null")
        if not isinstance(self.asymmetric, bool):
            raise ValueError(f"asymmetric={self.asymmetric!r} must be true or false")
        if self.asymmetric and self.format != "int4":
            raise ValueError(f"asymmetric=true applies only to format int4 (got format {self.format})")

    @staticmethod
    def from_value(value: QuantizationConfig | Mapping[str, Any] | str | None) -> QuantizationConfig | None:
        """A config from a format name (`FORMATS`), a dict of the fields, a JSON object string, an
        instance, or None (no quantization).

        Raises:
          ValueError: for an unknown format, JSON that does not parse or is not an object, unknown keys (named),
            or bad values.
        """
        if isinstance(value, str) and not value.lstrip().startswith("{"):
            if value.strip() not in FORMATS and value.strip()[:1] in ('[', '"', "-", *"0123456789"):
                raise ValueError(f"quantization {value!r} is neither a format name ({', '.join(FORMATS)}, gguf) nor a JSON "
                                 'object of QuantizationConfig fields (e.g. {"format": "int8"})')
            return QuantizationConfig(format=value)
        if value is not None and not isinstance(value, (str, Mapping, QuantizationConfig)):
            raise ValueError(f"quantization must be None, a format name, or a dict / JSON object, "
                             f"got {type(value).__name__}")
        return options_from_value(QuantizationConfig, value, "quantization config", required=("format",))

    @property
    def activations(self) -> bool:
        return bool(self.quantize_activations)

    @property
    def embedding(self) -> bool:
        default = self.format == "int8" or self.embedding_format is not None
        return default if self.quantize_embedding is None else self.quantize_embedding

    @property
    def lm_head(self) -> bool:
        default = self.format == "int8" or self.embedding_format is not None
        return default if self.quantize_lm_head is None else self.quantize_lm_head

    def format_of(self, path: tuple[str, ...]) -> str:
        """The format of the weight at `path` (a `Weights` field path, e.g. ("embed",) or ("layers", "wq")):
        `embedding_format` for the embedding table and the LM head where set, `format` otherwise."""
        return self.embedding_format if self.embedding_format and path[0] in ("embed", "lm_head") else self.format

    def resolved(self) -> QuantizationConfig:
        """This config with every None default decided (activations, embedding, LM head): two configs that
        quantize the same way compare equal once resolved. "gguf" (the file decides) stays as it is."""
        return self if self.format == "gguf" else dataclasses.replace(
            self, quantize_activations=self.activations, quantize_embedding=self.embedding, quantize_lm_head=self.lm_head)

