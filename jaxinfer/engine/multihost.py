"""Multi-host serving: one process per host, one mesh over every process's devices, process 0 in charge.

JAX runs multi-host programs SPMD: every process must launch the same jitted computation, with the same shapes,
in the same order, or the collectives inside it wait for ever. The engine keeps that invariant like this:

- **Process 0 is the leader.** It alone owns the request queue, the scheduler, the page allocator, the
  tokenizer's work and aborts. Other processes (followers) run no scheduler at all.
- **Every device call is broadcast before it runs.** `ModelRunner` on the leader turns each step into host
  arrays (tokens, `AttentionMetadata`, sampling arrays: everything the step depends on, including the sampling
  seeds), sends them to all followers with `jax.experimental.multihost_utils.broadcast_one_to_all`, then calls
  the step; `PagedKVCache` does the same for every page move. Followers sit in `follow`, receive the same arrays
  and make the same call. The plan is
  therefore broadcast, not re-derived: a follower's copy of the scheduler could drift (wall-clock deadlines,
  abort timing, memory-based budgets), and a drift would deadlock the pod instead of failing one request.
- **Outputs are replicated**, so every process holds the sampled tokens; the leader alone reports them.
- **Shapes that depend on the host are agreed once**: the leader's KV page count is broadcast at start-up.
- The leader sends `STOP` when it shuts down (`release_followers`, also registered with `atexit`), and the
  followers return from `follow`.

A broadcast is two collectives: a fixed-size header (operation, payload length), then the pickled payload padded
to a power of two so that only a few broadcast shapes are ever compiled. Pickle is safe here: the peers are
processes of the same job, started by the same user, talking over JAX's own collectives.

On CPU the collectives run over gloo (JAX's default for CPU multi-process), so two local processes with 2 CPU
devices each form a 4-device mesh: that is how the tests exercise this path.
"""

from __future__ import annotations

import enum
import logging
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxinfer.engine.runner import ModelRunner

logger = logging.getLogger(__name__)


class Op(enum.IntEnum):
    """What the leader asks the followers to do next."""

    STOP = 0
    STEP = 1  # payload: the step's host arrays
    LOGITS = 2  # payload: compute_logits' host arrays
    CLEAR_PAGES = 3  # payload: padded page ids
    VALUE = 4  # payload: one picklable value agreed at start-up
    COPY_PAGES = 5  # payload: (src pages, dst pages), copy-on-write
    OFFLOAD_PAGES = 6  # payload: (device pages, host page ids); every process keeps its own host copy
    LOAD_PAGES = 7  # payload: (host page ids, device pages)
    DROP_PAGES = 8  # payload: host page ids
    PROPOSE = 9  # payload: the drafting call's host arrays (speculative decoding)
    VERIFY = 10  # payload: the verify step's host arrays and which rows of the last proposal's probabilities


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_count: int | None = None) -> None:
    """Joins a multi-process JAX job (`jax.distributed.initialize`); call before any other JAX use.

    Args:
      coordinator_address: "host:port" of process 0's coordination service.
      num_processes: processes in the job (one per host).
      process_id: this process's index in [0, num_processes).
      local_device_count: on CPU, how many CPU devices this process exposes (default: what XLA_FLAGS gives).

    Raises:
      ValueError: a process id outside [0, num_processes) or a malformed address.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive integer")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id!r} must be in [0, {num_processes})")
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator_address={coordinator_address!r} must be host:port")
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    logger.info("process %d of %d: %d local / %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_multi_process() -> bool:
    """True when this JAX job has more than one process."""
    return jax.process_count() > 1


def is_leader() -> bool:
    """True on process 0 (and in every single-process run)."""
    return jax.process_index() == 0


def _broadcast_array(x: np.ndarray) -> np.ndarray:
    from jax.experimental.multihost_utils import broadcast_one_to_all

    return np.asarray(broadcast_one_to_all(x))


def send(op: Op, payload: Any = None) -> None:
    """Leader: broadcasts one operation and its payload to every follower (no-op in a single process, and on a
    follower, which replays the operation it received)."""
    if not is_multi_process() or not is_leader():
        return
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL) if payload is not None else b""
    size = 1 << max(len(data) - 1, 0).bit_length()
    _broadcast_array(np.array([int(op), len(data), size], np.int64))
    if data:
        buf = np.zeros(size, np.uint8)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        _broadcast_array(buf)


def receive() -> tuple[Op, Any]:
    """Follower: waits for the leader's next operation; returns (op, payload)."""
    op, length, size = (int(v) for v in _broadcast_array(np.zeros(3, np.int64)))
    if not length:
        return Op(op), None
    buf = _broadcast_array(np.zeros(size, np.uint8))
    return Op(op), pickle.loads(buf[:length].tobytes())


def agree(value: Any) -> Any:
    """Every process gets the leader's `value` (e.g. a KV page count computed from local free memory)."""
    if not is_multi_process():
        return value
    if is_leader():
        send(Op.VALUE, value)
        return value
    op, payload = receive()
    if op is not Op.VALUE:
        raise RuntimeError(f"follower expected the leader's start-up value, got {op.name}")
    return payload


def global_inputs(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """Host arrays as jax arrays replicated over the mesh when the mesh spans several processes (a multi-process
    program takes no host-local numpy inputs); the tree unchanged otherwise."""
    if mesh is None or not is_multi_process():
        return tree
    from sharding.placement import put_sharded

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return put_sharded(tree, jax.tree.map(lambda _: replicated, tree))


def _replays(runner: ModelRunner) -> dict[Op, Callable[[Any], Any]]:
    """Per operation, the follower's call of it: the same runner or KV cache method the leader called."""
    kv = runner.kv
    return {
        Op.STEP: lambda p: jax.block_until_ready(runner.run_step(*p)),
        Op.LOGITS: lambda p: runner.run_logits(*p),
        Op.CLEAR_PAGES: kv.clear_pages,
        Op.COPY_PAGES: lambda p: kv.copy_pages(*p),
        Op.OFFLOAD_PAGES: lambda p: kv.offload_pages(*p),
        Op.LOAD_PAGES: lambda p: kv.load_pages(*p),
        Op.DROP_PAGES: kv.drop_host_pages,
        Op.PROPOSE: lambda p: jax.block_until_ready(runner.run_propose(*p)),
        Op.VERIFY: lambda p: jax.block_until_ready(runner.run_verify(*p)),
    }


def follow(runner: ModelRunner) -> None:
    """Follower processes: replays the leader's device calls on `runner` until the leader sends STOP.

    A call that fails here is logged and skipped (the leader, running the same call, reports the failure to its
    request). On a follower `send` is a no-op, so the replayed methods broadcast nothing.
    """
    replays = _replays(runner)
    while True:
        op, payload = receive()
        if op is Op.STOP:
            return
        try:
            if op not in replays:
                raise RuntimeError(f"unexpected operation {op.name} from the leader")
            replays[op](payload)
        except Exception:  # noqa: BLE001 - the leader sees the same failure and fails the request
            logger.exception("follower: %s failed", op.name)


def release_followers() -> None:
    """Leader of a multi-host run: tells the followers to return from `follow` (no-op elsewhere). Call it once per
    runner the followers follow (`Engine.shutdown` does): they may go on to follow the leader's next engine."""
    if is_multi_process() and is_leader():
        send(Op.STOP)
