"""`EngineReplica`: one engine replica, the body of a Ray actor (`jaxinfer.cluster.pool` makes it one).

1. The actor owns its devices (Ray gives it its CPUs, and on GPUs its own GPU through `CUDA_VISIBLE_DEVICES`).
2. `start()` builds one `Engine`, run by today's `AsyncEngine` (its engine thread steps it), and answers what the
   router needs to tokenize, check and route requests itself (`ReplicaInfo`: the tokenizer, the model's config
   and context, the page size and KV pages).
3. `generate` is an async generator: Ray streams each `RequestOutput` to the router as the engine produces it
   (`num_returns="streaming"`). A router that stops reading cancels the task (`ray.cancel`): the generator is
   closed and `AsyncEngine` aborts the request, freeing its pages; `abort(request_id)` does the same by name.
   `output_token_ids` resumes a request another replica was streaming when it died.
4. Disaggregated prefill/decode (`jaxinfer.cluster.disagg`): on a prefill replica, `prefill` runs a prefill-only
   request and returns its first token; `export_kv` then returns its K/V as a `KVHandoff` (the router never
   fetches it: Ray keeps it in the object store, and the router passes its reference on). On a decode replica,
   `generate_from_handoff` fetches the payload itself (the reference comes inside a list, which Ray does not
   resolve before the call), reports `Fetched`, writes the K/V into its own pages and streams the rest.
5. `stats()` is the engine's `Engine.stats()` and step histogram: the router's health check and metrics. An actor
   that Ray restarted after it died has no engine until `start()` runs again: `stats()` raises
   `ReplicaNotStarted`, which tells the router to call it.

Nothing here imports Ray: the class is a plain class, and runs in-process too.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING

from jaxinfer.engine.async_engine import AsyncEngine
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxinfer.engine.kv_handoff import KVHandoff
    from models.config import ModelConfig


class ReplicaRole(enum.Enum):
    """What the router sends a replica: `MIXED` prefills and decodes its requests; `PREFILL` computes prompts' K/V
    and first tokens for decode replicas; `DECODE` continues requests from handed-over K/V, and prefills locally
    the prompts not worth a handoff (`jaxinfer.cluster.disagg`). Every role runs the same engine: a request
    resubmitted after a fault may go to any replica that is up."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class ReplicaNotStarted(RuntimeError):
    """The replica's engine is not built: `start()` has not run in this actor (Ray restarted it)."""


class HandoffLost(RuntimeError):
    """A decode replica could not fetch a handoff's payload (its export failed, or the prefill replica died with
    it); the request can go on from its output so far."""


@dataclasses.dataclass(frozen=True)
class Fetched:
    """The first item of `EngineReplica.generate_from_handoff`: the payload arrived (its K/V bytes)."""

    nbytes: int


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


def check_compatible(infos: Sequence[ReplicaInfo]) -> None:
    """Checks that one router can serve these replicas together: the same tokens (vocabulary, context limit), the
    same page size (the unit of the router's page keys) and, for K/V handoffs, the same layers, KV heads and head
    dim. Engine options may differ otherwise (a TP degree, a KV dtype, the batch limits of one role).

    Raises:
      ValueError: naming the first value that differs and the replicas.
    """
    def shape(info: ReplicaInfo) -> dict[str, object]:
        m = info.model_config
        return {"page_size": info.page_size, "max_model_len": info.max_model_len, "vocab_limit": info.vocab_limit,
                "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim}

    first = shape(infos[0])
    for info in infos[1:]:
        for key, value in shape(info).items():
            if value != first[key]:
                raise ValueError(f"replicas {infos[0].name} and {info.name} differ in {key} ({first[key]} vs "
                                 f"{value}); one router serves replicas of one model, page size and context limit")


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

    async def generate(self, prompt: Prompt, params: SamplingParams | None, request_id: str,
                       output_token_ids: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs, as `AsyncEngine.generate` (its errors too).

        Args:
          prompt: the tokenized prompt (the router tokenized it).
          params: sampling parameters, or None for the defaults.
          request_id: a name unique on this replica (the router's).
          output_token_ids: tokens another replica streamed before it died (`Engine.add_request`'s resume).
        """
        async for out in self._engine().generate(prompt, params, request_id, output_token_ids=output_token_ids):
            yield out

    async def prefill(self, prompt: Prompt, params: SamplingParams, request_id: str) -> RequestOutput:
        """Prefills a prompt and samples its first token, keeping its K/V for `export_kv`
        (`AsyncEngine.generate(prefill_only=True)`).

        Returns:
          The request's last output: finish_reason "handoff" (then call `export_kv`), or a finished one when the
          first token ended the request (EOS, max_tokens 1, an error).

        Raises:
          as `AsyncEngine.generate`.
        """
        last = None
        async for last in self._engine().generate(prompt, params, request_id, prefill_only=True):
            pass
        return last

    async def export_kv(self, request_id: str, wire_dtype: str | None) -> KVHandoff:
        """The K/V of a request `prefill` left with finish_reason "handoff" (`AsyncEngine.export_kv`); its pages are
        freed (full ones stay in the prefix cache).

        Raises:
          ValueError: as `Engine.export_kv` (no such request, an unknown wire dtype).
        """
        return await self._engine().export_kv(request_id, wire_dtype)

    async def generate_from_handoff(self, payload: Sequence[Awaitable[KVHandoff]], params: SamplingParams,
                                    request_id: str) -> AsyncIterator[Fetched | RequestOutput]:
        """Fetches a handoff, then streams the request from it (`AsyncEngine.generate_from_handoff`).

        Args:
          payload: one awaitable of the `KVHandoff` (a Ray ObjectRef of a prefill replica's `export_kv`).
          params: the request's sampling parameters, as the prefill replica had them.
          request_id: as `generate`.

        Yields:
          `Fetched` once the payload is here, then the request's outputs after its first token.

        Raises:
          HandoffLost: fetching the payload failed (naming why).
          ValueError: a payload this engine cannot take (`Engine.import_kv`).
        """
        (ref,) = payload
        try:
            handoff = await ref
        except Exception as e:  # noqa: BLE001 - whatever failed upstream, this replica can go on without it
            raise HandoffLost(f"the K/V handoff did not arrive: {type(e).__name__}: {e}") from None
        yield Fetched(handoff.nbytes)
        async for out in self._engine().generate_from_handoff(handoff, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Aborts a request, or frees the K/V it holds for a handoff (a no-op for one that finished or never came)."""
        if self.async_engine is not None:
            self.async_engine.abort(request_id)

    def stats(self) -> tuple[dict[str, float | int], dict[int, int]]:
        """(`Engine.stats()`, a copy of the step histogram `EngineMetrics.steps_by_num_tokens`).

        Raises:
          ReplicaNotStarted: `start()` has not run (Ray restarted the actor).
          RuntimeError: the engine loop stopped (the router then counts the replica as down).
        """
        engine = self._engine()
        if not engine.is_alive():
            raise RuntimeError(f"replica {self.name}: the engine loop has stopped: {engine.error}")
        return engine.engine.stats(), engine.engine.metrics.steps_by_num_tokens.copy()

    def _engine(self) -> AsyncEngine:
        if self.async_engine is None:
            raise ReplicaNotStarted(f"replica {self.name}: the engine is not started")
        return self.async_engine

    def shutdown(self) -> None:
        """Stops the engine loop (requests in flight get `EngineStoppedError`)."""
        if self.async_engine is not None:
            self.async_engine.shutdown()
