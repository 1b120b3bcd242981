"""Engine start-up: load the model, quantize it, shard it onto the mesh, load a draft model, size the KV cache and
build the model runner (`start`); the prefix cache (`make_prefix_cache`); JAX's compilation cache.

KV cache sizing: `jaxinfer.engine.kv_budget` (the work, max_num_seqs sequences of max_model_len tokens, capped by
memory). A page must fit the context (page_size <= max_model_len) and the budget; a given budget must fit the free
memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import multihost
from jaxinfer.engine.auto_dtype import resolve_dtype
from jaxinfer.engine.compilation_cache import enable_compilation_cache
from jaxinfer.engine.config import DEFAULT_OFFLOAD_MIN_PAGES, DTYPES, KV_CACHE_DTYPES, EngineConfig
from jaxinfer.engine.kv_budget import (KVSizing, budget_bytes, check_page_fits, check_page_size, kv_page_bytes,
                                       memory_cap, min_page_bytes, size_kv_cache, weight_bytes_bound)
from jaxinfer.engine.kv_cache import PagedKVCache
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.spec_decode import draft as draft_lib
from jaxinfer.loading import is_gguf, load_model, not_a_gguf_error, read_model_config, stored_quantization
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.scheduler.prefix_cache import PrefixCache
from jaxinfer.tokenizer import Tokenizer
from models import quant, quant4
from models.config import ModelConfig
from models.llama import Weights, unstack_layers
from models.partition import shard_model
from models.pipeline import check_pipeline, pad_layers, staged_config
from models.quant import QuantizationConfig
from models.quant_sharding import quantize_sharded
from pallas_kernels.dispatch import select_attention
from sharding.mesh import make_mesh

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Started:
    """What start-up hands the engine.

    Attributes:
      model_config: the model's config as trained (the runner holds the TP-padded one).
      tokenizer: the model's tokenizer.
      quantization: the effective weight quantization, or None (`resolve_quantization`).
      weight_bytes: `models.quant.weight_bytes` of the device weights.
      mesh: the device mesh, or None for one device.
      max_model_len: the context limit in tokens.
      page_bytes: bytes of one KV page (target plus a draft's own cache; per device on accelerators with a mesh).
      runner: the model runner, its KV cache allocated.
    """

    model_config: ModelConfig
    tokenizer: Tokenizer
    quantization: QuantizationConfig | None
    weight_bytes: dict
    mesh: jax.sharding.Mesh | None
    max_model_len: int
    page_bytes: int
    runner: ModelRunner


def _quantize(weights, cfg, qcfg: QuantizationConfig, dtype) -> Weights:
    """Quantizes one device's weights in a single compiled computation (no op-by-op dispatch)."""
    return jax.jit(functools.partial(quant.quantize_weights, cfg=cfg, qcfg=qcfg, dtype=dtype))(weights)


def resolve_quantization(config: EngineConfig) -> tuple[QuantizationConfig | None, bool]:
    """(the effective quantization, resolved, or None; whether the weights are quantized at load).

    A quantized checkpoint's own quantization (a `jaxinfer convert --quantization` checkpoint, or a pre-quantized
    HF folder: `jaxinfer.loading.stored_quantization`) wins: `config.quantization` None takes it, an equal one is
    accepted, one that differs only in int4's `quantize_activations` (w4a8 runs the same stored weights; see
    `_int4_activations`) is taken, any other is refused. "gguf" keeps a GGUF file's quantized tensors as stored.

    Raises:
      ValueError: `config.quantization` differs from the checkpoint's (both named), "gguf" for a model that is not
        a GGUF file, or a malformed checkpoint.
    """
    wanted = None if config.quantization is None else config.quantization.resolved()
    if wanted is not None and wanted.format == "gguf":
        if not is_gguf(config.model):
            raise not_a_gguf_error(config.model)
        return wanted, False
    stored = stored_quantization(config.model)
    if stored is None:
        return wanted, wanted is not None
    if wanted is not None and stored.format == "int4" and dataclasses.replace(
            wanted, quantize_activations=stored.quantize_activations) == stored:
        return wanted, False  # w4a8 or not: how the int4 matmuls run, not what is stored
    if wanted is not None and wanted != stored:
        fields = [f.name for f in dataclasses.fields(QuantizationConfig)]
        differ = ", ".join(f"{f} {getattr(wanted, f)!r} (stored: {getattr(stored, f)!r})" for f in fields
                           if getattr(wanted, f) != getattr(stored, f))
        raise ValueError(f"the quantization asked for differs from the one the checkpoint {config.model!r} is "
                         f"stored with in {differ}; leave out the quantization (quantization=None, no "
                         f"--quantization) to use the checkpoint's, or load (or convert) the original, unquantized "
                         f"model")
    return stored, False


def _int4_activations(weights, qcfg: QuantizationConfig | None):
    """A restored int4 checkpoint's weights run as `qcfg` asks: the int4 weights that can take activation
    quantization (symmetric groups of 32) get `qcfg.activations` (w4a8 or weight-only), as quantizing at load
    would have recorded it; other weights are left as they are."""
    if qcfg is None or qcfg.format != "int4":
        return weights
    on = qcfg.activations

    def switch(w):
        if (isinstance(w, quant.QuantizedWeight) and w.format == "int4"
                and quant4.takes_int8_activations(w.group_size, w.min is not None)):
            return w.replace(quantize_activations=on, activation_group_size=quant4.W4A8_GROUP if on else 0)
        return w

    return jax.tree.map(switch, weights, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))


def _load_target(config: EngineConfig, mesh, qcfg: QuantizationConfig | None, quantize_at_load: bool):
    """(config as trained, config as run, device weights, tokenizer): loaded, sharded and quantized."""
    dtype = DTYPES[config.dtype]
    load_dtype = np.float32 if quantize_at_load else np.dtype(dtype)  # quantized from f32
    # numpy weights; for an orbax checkpoint and a mesh, arrays restored straight onto the mesh (with pipeline
    # stages, their layers in the stage layout already)
    cfg, loaded, tokenizer = load_model(config.model, load_dtype, mesh=mesh,
                                        gguf_quantized=qcfg is not None and qcfg.format == "gguf")
    if not quantize_at_load:
        loaded = _int4_activations(loaded, qcfg)
    if mesh is None:
        run_cfg, weights = cfg, jax.device_put(loaded)  # one batched call: 2x faster than an asarray a leaf
        if quantize_at_load:
            weights = _quantize(weights, cfg, qcfg, dtype)
        return cfg, run_cfg, weights, tokenizer
    pp = config.pipeline_parallel_size
    layout = check_pipeline(cfg, pp)
    staged = staged_config(cfg, layout) if pp > 1 else cfg  # the layer stack padded to whole stages
    on_mesh = any(isinstance(x, jax.Array) for x in jax.tree.leaves(loaded))
    # a quantized checkpoint's weights padded as stored
    sharded = shard_model(staged, pad_layers(loaded, layout) if pp > 1 and not on_mesh else loaded, mesh)
    run_cfg, weights = sharded.cfg, sharded.weights
    if quantize_at_load:
        weights = quantize_sharded(weights, run_cfg, qcfg, dtype)
    padded = "" if sharded.layout.heads_identity else \
        f" (padded from {cfg.num_heads} / {cfg.num_kv_heads}: KV heads replicated, so a KV page holds " \
        f"{run_cfg.num_kv_heads / cfg.num_kv_heads:.2g}x the bytes)"
    logger.info("sharded over tp=%d x ep=%d devices: %d query heads, %d KV heads%s", config.tensor_parallel_size,
                config.expert_parallel_size, run_cfg.num_heads, run_cfg.num_kv_heads, padded)
    if pp > 1:
        logger.info("pipeline: %d stages of %s layers (%d slots each, padded with no-op layers)", pp,
                    "/".join(map(str, layout.counts)), layout.layers_per_stage)
    return cfg, run_cfg, weights, tokenizer


def load_draft(config: EngineConfig, run_cfg: ModelConfig, weights: Weights, qcfg: QuantizationConfig | None,
               target_vocab: int) -> draft_lib.DraftModel | None:
    """The draft model of "self_draft" / "draft_model" (None for "ngram" or without speculative decoding).

    Raises:
      ValueError: for "draft_model" in a multi-process run, or a draft model whose vocabulary differs from the
        target's.
    """
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "self_draft":
        return draft_lib.self_draft(run_cfg, weights, spec.num_draft_layers)
    if spec.method != "draft_model":
        return None
    if multihost.is_multi_process():
        raise ValueError("speculative method 'draft_model' runs in one process; use 'ngram' or 'self_draft'")
    dtype = DTYPES[config.dtype]
    try:
        # a quantized draft checkpoint is used as stored; with "gguf", a GGUF draft keeps its quantized tensors;
        # other drafts are quantized like the target
        as_stored = qcfg is not None and qcfg.format == "gguf"
        draft_qcfg = None if as_stored or stored_quantization(spec.model) is not None else qcfg
        draft_cfg, draft_weights, draft_tokenizer = load_model(
            spec.model, np.float32 if draft_qcfg is not None else np.dtype(dtype),
            gguf_quantized=as_stored and is_gguf(spec.model))
    except ValueError as e:
        raise ValueError(f"speculative draft model: {e}") from None
    draft_lib.check_draft_model(draft_cfg, run_cfg, draft_tokenizer.vocab_size, target_vocab)
    logger.info("draft model %s: %d layers", draft_cfg.name, draft_cfg.num_layers)
    draft_weights = jax.tree.map(jnp.asarray, draft_weights)
    if draft_qcfg is not None:
        draft_weights = _quantize(draft_weights, draft_cfg, draft_qcfg, dtype)
    return draft_lib.DraftModel(cfg=draft_cfg, weights=draft_weights, shares_target_cache=False)


def _early_kv_cache(config: EngineConfig) -> tuple[tuple, KVSizing, PagedKVCache] | None:
    """The KV cache sized from the model's config file and allocated before the weights load (its zero fill runs in
    a background thread meanwhile: `PagedKVCache`), with the facts it was sized on (layers, KV heads, head dim,
    max_model_len, page bytes: a draft's own cache would add to them) for `start` to check against the loaded
    model. Only where the size cannot depend on memory the weights will take: on CPU, without
    `kv_cache_memory_bytes` (checked against the free memory after the load), and when the default cap is the
    share of total memory even with the weights' memory (`kv_budget.weight_bytes_bound`) counted out of what is
    available. None otherwise (sized after the load, as always): on accelerators (a share of the free memory after
    the weights), on a mesh, in a multi-process run, with a draft model of its own, or when the config cannot be
    read before the load.
    """
    spec = config.speculative_config
    if (jax.default_backend() != "cpu" or config.kv_cache_memory_bytes is not None or config.num_devices > 1
            or multihost.is_multi_process() or (spec is not None and spec.method == "draft_model")):
        return None
    try:
        cfg = read_model_config(config.model)
    except ValueError:
        return None
    if memory_cap(config, reserved_bytes=weight_bytes_bound(cfg)).by_available:
        return None  # memory is short: size the cache once the weights are in
    max_model_len = cfg.max_position_embeddings if config.max_model_len is None else config.max_model_len
    page_bytes = kv_page_bytes(config, cfg, None, None)
    sizing = size_kv_cache(config, page_bytes, max_model_len)
    kv_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, DTYPES[config.dtype])
    kv = PagedKVCache(cfg, num_pages=sizing.num_pages, page_size=config.page_size, kv_dtype=kv_dtype)
    return (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_model_len, page_bytes), sizing, kv


def check_before_load(config: EngineConfig) -> None:
    """The options checked against the model's config alone, before the weights load (seconds to minutes): so
    that a bad option fails at once. `start` checks them again with what only the load tells (the TP-padded
    heads, a draft model's cache). A config that cannot be read here is left to the load to report.

    Raises:
      ValueError: more pipeline stages than layers or a model the pipeline does not run (`check_pipeline`), a
        max_model_len beyond the model's context, a page_size beyond the context, a self-draft's
        num_draft_layers out of range, or a KV budget / nonzero kv_offload_bytes smaller than one KV page.
    """
    try:
        cfg = read_model_config(config.model)
    except ValueError as e:
        logger.debug("model config not read before the load: %s", e)
        return
    config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.model))  # the page bytes' dtype
    if config.max_model_len is not None and not 1 <= config.max_model_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} must be in [1, {cfg.max_position_embeddings}]")
    check_page_size(config, config.max_model_len or cfg.max_position_embeddings)
    check_pipeline(cfg, config.pipeline_parallel_size)
    spec = config.speculative_config
    if spec is not None and spec.method == "self_draft":
        draft_lib.self_draft_layers(cfg.num_layers, spec.num_draft_layers)
    page_bytes = min_page_bytes(config, cfg)
    check_page_fits(config, budget_bytes(config), page_bytes)
    if 0 < config.kv_offload_bytes < page_bytes:
        raise ValueError(f"kv_offload_bytes={config.kv_offload_bytes} is smaller than one KV page ({page_bytes} "
                         "bytes)")


def start(config: EngineConfig) -> Started:
    """Loads everything the engine runs on (see the module docstring).

    Raises:
      ValueError: a draft model path that does not exist and the `check_before_load` checks (before the target
        loads), from the model loader or `resolve_quantization`, a max_model_len or page_size beyond the model's
        context, a KV budget too small for one page, or a kv_cache_memory_bytes beyond the free memory.
    """
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model" and not Path(spec.model).exists():
        raise ValueError(f"speculative draft model path {spec.model!r} does not exist")  # before loading the target
    check_before_load(config)
    enable_compilation_cache(config.compilation_cache_dir)
    t0 = time.perf_counter()
    tp, ep, pp = config.tensor_parallel_size, config.expert_parallel_size, config.pipeline_parallel_size
    mesh = make_mesh(tp=tp, ep=ep, pp=pp) if config.num_devices > 1 else None
    qcfg, quantize_at_load = resolve_quantization(config)
    early = _early_kv_cache(config)  # its zero fill (seconds for GiBs of fresh memory) overlaps the load
    cfg, run_cfg, weights, tokenizer = _load_target(config, mesh, qcfg, quantize_at_load)
    weight_bytes = quant.weight_bytes(weights)
    logger.info("loaded %s (%s%s) in %.1f s: %.1f MiB of weights", cfg.name, config.dtype,
                "" if qcfg is None else f", {qcfg.format} weights ({weight_bytes['quantized_share']:.2%} of "
                f"parameters quantized{'' if quantize_at_load else ', as stored in the checkpoint'})",
                time.perf_counter() - t0, weight_bytes["bytes"] / 2**20)
    if qcfg is not None:
        logger.info("quantization: %s", qcfg)
    max_model_len = cfg.max_position_embeddings if config.max_model_len is None else config.max_model_len
    if not 1 <= max_model_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} must be in [1, {cfg.max_position_embeddings}]")
    check_page_size(config, max_model_len)
    if not config.scan_layers:  # per-layer arrays before a self-draft shares them (one copy of the weights)
        weights = unstack_layers(weights)
    draft = load_draft(config, run_cfg, weights, qcfg, tokenizer.vocab_size)
    page_bytes = kv_page_bytes(config, run_cfg, draft, mesh)
    kv_dtype = KV_CACHE_DTYPES.get(config.kv_cache_dtype, DTYPES[config.dtype])
    kv = None
    if early is not None and early[0] == (run_cfg.num_layers, run_cfg.num_kv_heads, run_cfg.head_dim, max_model_len,
                                          page_bytes):
        _, sizing, kv = early
    else:
        sizing = size_kv_cache(config, page_bytes, max_model_len)
    del early  # a cache the load proved wrong is dropped
    num_pages = sizing.num_pages
    runner = ModelRunner(run_cfg, weights, num_pages=num_pages, page_size=config.page_size, kv_dtype=kv_dtype,
                         scan_layers=config.scan_layers, attention=select_attention(config.attention_backend),
                         vocab_limit=min(cfg.vocab_size, tokenizer.vocab_size),
                         max_pages_per_seq=-(-max_model_len // config.page_size), mesh=mesh,
                         output_vocab=cfg.vocab_size, draft=draft, kv=kv,
                         pipeline_microbatches=config.pipeline_microbatches or pp)
    logger.info("KV cache: %d tokens (%d pages of %d, %s), %s of max_model_len=%d tokens; %s",
                sizing.tokens, num_pages - 1, config.page_size, jnp.dtype(kv_dtype).name, sizing.sequences_text(),
                max_model_len, sizing.reason)
    return Started(model_config=cfg, tokenizer=tokenizer, quantization=qcfg, weight_bytes=weight_bytes, mesh=mesh,
                   max_model_len=max_model_len, page_bytes=page_bytes, runner=runner)


def make_prefix_cache(config: EngineConfig, page_allocator: PageAllocator, page_bytes: int) -> PrefixCache | None:
    """The prefix cache over the allocator's pages (None when `enable_prefix_caching` is off), with a host tier of
    `kv_offload_bytes` // page_bytes pages.

    Raises:
      ValueError: a nonzero kv_offload_bytes smaller than one page.
    """
    if not config.enable_prefix_caching:
        return None
    min_pages = config.kv_offload_min_pages or DEFAULT_OFFLOAD_MIN_PAGES.get(jax.default_backend(), 1)
    if 0 < config.kv_offload_bytes < page_bytes:
        raise ValueError(f"kv_offload_bytes={config.kv_offload_bytes} is smaller than one KV page "
                         f"({page_bytes} bytes)")
    return PrefixCache(page_allocator, config.page_size, host_capacity_pages=config.kv_offload_bytes // page_bytes,
                       host_min_pages=min_pages)
