"""`EngineReplica`: one engine replica, the body of a Ray actor (`jaxinfer.cluster.pool` makes it one).

1. The actor owns its devices (Ray gives it its CPUs, and on GPUs its own GPU through `CUDA_VISIBLE_DEVICES`).
2. `start()` builds one `Engine`, run by today's `AsyncEngine` (its engine thread steps it), and answers what the
   router needs to tokenize, check and route requests itself (`ReplicaInfo`: the tokenizer, the model's config
   and context, the page size and KV pages).
3. `generate` is an async generator: Ray streams each `RequestOutput` to the router as the engine produces it
   (`num_returns="streaming"`). A router that stops reading cancels the task (`ray.cancel`): the generator is
   closed and `AsyncEngine` aborts the request, freeing its pages; `abort(request_id)` does the same by name.
4. `stats()` is the engine's `Engine.stats()` and step histogram: the router's health check and metrics.

Nothing here imports Ray: the class is a plain class, and runs in-process too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from models.config import ModelConfig


class ReplicaRole(enum.Enum):
    """What a replica does with the requests routed to it. Only `MIXED` (prefill and decode its own requests)
    exists so far; disaggregated serving adds prefill-only and decode-only roles (issue 25, part 3)."""

    MIXED = "mixed"


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica tells the router (picklable).

    Attributes:
      name: the replica's name (unique in its pool; a metrics label).
      role: its `ReplicaRole`.
      tokenizer: the model's tokenizer.
      model_config: the model's config as trained.
      config: the engine's options as it resolved them (dtype "auto" resolved).
      max_model_len: the context limit, tokens.
      vocab_limit: prompt ids must lie in [0, vocab_limit) (`Engine.make_prompt`).
      page_size: tokens per KV page.
      kv_pages_total: the replica's usable KV pages (the capacity of the router's index of it).
      prefix_caching: whether the replica caches prefixes (without it, routing by cache is moot).
    """

    name: str
    role: ReplicaRole
    tokenizer: Tokenizer
    model_config: ModelConfig
    config: EngineConfig
    max_model_len: int
    vocab_limit: int
    page_size: int
    kv_pages_total: int
    prefix_caching: bool


class EngineReplica:
    """One engine and its `AsyncEngine` loop: the body of a replica actor.

    Args:
      config: the engine's options (every replica of a pool gets the same).
      name: the replica's name.
      role: what it does with requests.
    """

    def __init__(self, config: EngineConfig, name: str, role: ReplicaRole = ReplicaRole.MIXED) -> None:
        self.name, self.role, self.config = name, role, config
        self.async_engine: AsyncEngine | None = None

    def start(self) -> ReplicaInfo:
        """Builds the engine (once; in a method, not the constructor, so that its errors reach the caller as
        themselves) and returns the replica's `ReplicaInfo`.

        Raises:
          ValueError: as `Engine` (a bad configuration or model).
        """
        if self.async_engine is None:
            self.async_engine = AsyncEngine(Engine(self.config))
        engine = self.async_engine.engine
        return ReplicaInfo(name=self.name, role=self.role, tokenizer=engine.tokenizer,
                           model_config=engine.model_config, config=engine.config,
                           max_model_len=engine.max_model_len, vocab_limit=engine.runner.vocab_limit,
                           page_size=engine.page_size, kv_pages_total=engine.page_allocator.num_usable_pages,
                           prefix_caching=engine.prefix_cache is not None)

    async def generate(self, prompt: Prompt, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs, as `AsyncEngine.generate` (its errors too).

        Args:
          prompt: the tokenized prompt (the router tokenized it).
          params: sampling parameters, or None for the defaults.
          request_id: a name unique on this replica (the router's).
        """
        async for out in self.async_engine.generate(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Aborts a request (a no-op for one that finished or never came)."""
        self.async_engine.abort(request_id)

    def stats(self) -> tuple[dict[str, float | int], dict[int, int]]:
        """(`Engine.stats()`, a copy of the step histogram `EngineMetrics.steps_by_num_tokens`).

        Raises:
          RuntimeError: the engine loop is not started or stopped (the router then counts the replica as down).
        """
        if self.async_engine is None or not self.async_engine.is_alive():
            cause = "not started" if self.async_engine is None else f"stopped: {self.async_engine.error}"
            raise RuntimeError(f"replica {self.name}: the engine loop has {cause}")
        engine = self.async_engine.engine
        return engine.stats(), engine.metrics.steps_by_num_tokens.copy()

    def shutdown(self) -> None:
        """Stops the engine loop (requests in flight get `EngineStoppedError`)."""
        if self.async_engine is not None:
            self.async_engine.shutdown()
