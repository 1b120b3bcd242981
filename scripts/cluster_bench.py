"""Measures the cluster router on a local Ray instance: TTFT of a multi-turn chat workload under cache-aware and
round-robin routing (one run, the same two replicas), and what a K/V handoff from a prefill replica to a decode
replica costs through Ray for a few context lengths and wire dtypes.

Two replica actors are started once. The router (`ClusterEngine`) runs in this process and is driven directly
(no HTTP): TTFT is from `generate` to the first output with a token, on the router's clock.

1. Multi-turn: `--conversations` chats of `--turns` turns run concurrently (each chat sends its next turn when the
   previous reply is done); each prompt is a shared system prompt, then the chat's user turns (random ids) and
   replies so far. The workload runs once untimed per policy (compiles), then once per policy, each run under its
   own cache salt.
2. Handoff: the same two replicas as prefill and decode (`ReplicaRole`s given by the router, every prompt crossing),
   fresh random prompts of each length, `max_tokens` 2: bytes moved (`KVHandoff.nbytes`), the router's handoff
   time (export call -> the decode replica holds the payload: export, object store, fetch) and the time between
   the first and the second token, against the same request prefilled locally on the decode replica.

    .venv/bin/python scripts/cluster_bench.py --lengths 128,512,1024
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import numpy as np

from jaxinfer import SamplingParams
from jaxinfer.cluster.config import ClusterConfig
from jaxinfer.cluster.disagg import DisaggConfig
from jaxinfer.cluster.engine import ClusterEngine
from jaxinfer.cluster.pool import ReplicaHandle, ReplicaPool
from jaxinfer.cluster.replica import ReplicaRole
from jaxinfer.cluster.routing import RoutingConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.prompt import Prompt


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _first_and_second(cluster: ClusterEngine, prompt: Prompt, params: SamplingParams) -> tuple[float, float,
                                                                                                       list[int]]:
    """(TTFT s, time from the first to the second token s, the output ids)."""
    t0 = time.perf_counter()
    times, ids = [], []
    async for out in cluster.generate(prompt, params):
        if out.outputs[0].delta_token_ids:
            times += [time.perf_counter()] * len(out.outputs[0].delta_token_ids)
        ids = out.outputs[0].token_ids
    return times[0] - t0, (times[1] - times[0]) if len(times) > 1 else float("nan"), ids


async def _multi_turn(pool: ReplicaPool, policy: str, salt: str, args, vocab: int) -> dict:
    cluster = ClusterEngine(ReplicaPool(pool.replicas, owned=False),
                            RoutingConfig(policy, max_imbalance=args.max_imbalance), owns_pool=False)
    rng = np.random.default_rng(1)
    system = rng.integers(100, vocab, args.system_tokens).tolist()
    users = [[rng.integers(100, vocab, args.user_tokens).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    before = [(await r.actor.stats.remote())[0] for r in pool.replicas]
    ttfts: list[float] = []

    async def chat(c: int) -> None:
        history = list(system)
        for turn in range(args.turns):
            history += users[c][turn]
            ttft, _, reply = await _first_and_second(cluster, Prompt(tuple(history), None, salt), params)
            ttfts.append(ttft)
            history += reply

    t0 = time.perf_counter()
    await asyncio.gather(*(chat(c) for c in range(args.conversations)))
    wall = time.perf_counter() - t0
    after = [(await r.actor.stats.remote())[0] for r in pool.replicas]
    hits = sum(a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"] for a, b in zip(after, before))
    queried = sum(a["prefix_cache_queried_tokens"] - b["prefix_cache_queried_tokens"] for a, b in zip(after, before))
    return {"policy": policy, "requests": len(ttfts), "ttft_p50_s": _percentile(ttfts, 50),
            "ttft_p99_s": _percentile(ttfts, 99), "ttft_mean_s": statistics.fmean(ttfts), "wall_s": wall,
            "hit_rate": hits / queried if queried else 0.0,
            "per_replica": [r.requests_routed for r in cluster.replicas]}


def _as(handle: ReplicaHandle, role: ReplicaRole) -> ReplicaHandle:
    return ReplicaHandle(handle.actor, dataclasses.replace(handle.info, role=role))


async def _handoffs(pool: ReplicaPool, args, vocab: int) -> list[dict]:
    first, second = pool.replicas
    local = ClusterEngine(ReplicaPool([_as(second, ReplicaRole.MIXED)], owned=False), RoutingConfig(),
                          owns_pool=False)
    rng = np.random.default_rng(2)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        for wire in args.wire.split(","):
            cluster = ClusterEngine(
                ReplicaPool([_as(first, ReplicaRole.PREFILL), _as(second, ReplicaRole.DECODE)], owned=False),
                RoutingConfig(), owns_pool=False,
                disagg=DisaggConfig(min_prefill_tokens=0, local_cached_share=1.0, wire_dtype=wire))
            samples = []
            for rep in range(args.reps + 1):  # the first compiles
                prompt = Prompt(tuple(rng.integers(100, vocab, length).tolist()))
                c = cluster.counters
                n0, b0, s0 = c.handoffs, c.handoff_bytes, c.handoff_seconds.sum
                ttft, gap, _ = await _first_and_second(cluster, prompt, params)
                fresh = Prompt(tuple(rng.integers(100, vocab, length).tolist()))
                local_ttft, local_gap, _ = await _first_and_second(local, fresh, params)
                assert c.handoffs == n0 + 1
                if rep:
                    samples.append((c.handoff_bytes - b0, c.handoff_seconds.sum - s0, ttft, gap, local_ttft,
                                    local_gap))
            med = [statistics.median(s[i] for s in samples) for i in range(6)]
            rows.append({"tokens": length, "wire": wire, "bytes": med[0], "handoff_ms": med[1] * 1e3,
                         "ttft_ms": med[2] * 1e3, "second_token_gap_ms": med[3] * 1e3,
                         "local_ttft_ms": med[4] * 1e3, "local_second_token_gap_ms": med[5] * 1e3})
            print(rows[-1], flush=True)
    return rows


async def main_async(args) -> None:
    config = EngineConfig(model=args.model, warmup=False, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    t0 = time.perf_counter()
    pool = await ReplicaPool.start(config, ClusterConfig(num_replicas=2, replica_cpus=args.replica_cpus,
                                                         ray_address=args.ray_address))
    print(f"2 replicas started in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = pool.replicas[0].info.vocab_limit
    try:
        if args.turns:
            for policy in ("cache_aware", "round_robin"):  # untimed: compiles both policies' shapes
                await _multi_turn(pool, policy, "warm-" + policy, args, vocab)
            for policy in ("cache_aware", "round_robin"):
                print(await _multi_turn(pool, policy, policy, args, vocab), flush=True)
        if args.lengths:
            await _handoffs(pool, args, vocab)
    finally:
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--ray-address", default=None)
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="0: skip the multi-turn part")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--max-imbalance", type=int, default=RoutingConfig.max_imbalance,
                        help="cache_aware's guard (--routing-max-imbalance)")
    parser.add_argument("--lengths", default="128,512,1024", help="handoff context lengths; empty: skip")
    parser.add_argument("--wire", default="float32,bfloat16,int8")
    parser.add_argument("--reps", type=int, default=3)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
