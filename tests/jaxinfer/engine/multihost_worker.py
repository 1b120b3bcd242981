"""One process of the two-process tests in `test_multihost.py`:
`python multihost_worker.py PROCESS_ID PORT OUT [pp CHECKPOINT]`.

Each process exposes 2 CPU devices; the engine's tp=4 mesh spans both. Process 0 generates and writes the tokens
and the mesh's process indices to OUT (JSON); process 1 follows the leader's steps. Then both build engines with
speculative decoding (self-drafting, whose drafting calls run on both processes, then n-gram drafts with seeded
sampling) and generate `SPEC_PROMPTS` with each. With `pp`, pipeline engines instead (`main_pipeline`), the second
on the orbax checkpoint CHECKPOINT.
"""

import json
import sys

from jaxinfer.engine import multihost

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived"]
MAX_TOKENS = [10, 4, 7]
# Then a long prompt, other traffic that evicts its cached pages to the host tier, and the long prompt again
# (brought back from the host tier): the page transfers run on both processes.
LONG = "Here is a long document about lighthouses, tides, ships and the people who keep the lights burning. " * 4
OTHERS = [f"Question {i}: explain why the sky looks blue at noon and red at sunset, in detail." * 2 for i in range(3)]
ENGINE_OPTIONS = dict(dtype="float32", warmup=False, max_num_seqs=4, max_num_batched_tokens=16,
                      kv_cache_memory_bytes=10 << 20, kv_offload_bytes=64 << 20)


SPEC_PROMPTS = ["Repeat exactly: one two three four five six seven eight nine ten.\none two three four",
                "def add(a, b):\n    return a + b\n\ndef add("]
SPEC_CONFIGS = [{"method": "self_draft", "num_speculative_tokens": 2, "num_draft_layers": 28},
                {"method": "ngram", "num_speculative_tokens": 3}]


def generate_spec(llm) -> list[list[int]]:
    """Greedy and seeded-sampling generations of SPEC_PROMPTS (the same with speculation on or off)."""
    from jaxinfer.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    return [o.outputs[0].token_ids for p in params for o in llm.generate(SPEC_PROMPTS, p)]


def generate_all(llm, host_tier: bool = True) -> list[list[int]]:
    """The token ids of every generation of the test, in order (the same calls in one or two processes); without
    `host_tier`, PROMPTS' only."""
    from jaxinfer.sampling_params import SamplingParams

    greedy = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
    for batch in ([LONG], OTHERS, [LONG]) if host_tier else ():
        out += [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(temperature=0, max_tokens=6))]
    return out


CHECKPOINT_OPTIONS = dict(dtype="float32", warmup=False, max_num_seqs=4, kv_cache_memory_bytes=1 << 20)
CHECKPOINT_PROMPTS = [{"prompt_token_ids": [1, 40, 50, 60, 70, 33, 21]}, {"prompt_token_ids": [1, 9, 8, 7]}]


def generate_checkpoint(llm) -> list[list[int]]:
    """Greedy tokens of CHECKPOINT_PROMPTS (the orbax checkpoint's engines)."""
    from jaxinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(CHECKPOINT_PROMPTS, params, use_tqdm=False)]


def main_pipeline(process_id: int, out: str, checkpoint: str) -> None:
    """pp = 2 x tp = 2: stage 0 on process 0's 2 devices, stage 1 on process 1's; process 0 writes the tokens of
    PROMPTS (`generate_all` without the host tier) and, per stage, the processes holding its layers' weights and KV
    pages. Then an engine on the orbax `checkpoint`, each process restoring its stage's layers: process 0 writes
    the tokens of CHECKPOINT_PROMPTS too."""
    from jaxinfer.llm import LLM

    llm = LLM(pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE_OPTIONS)
    if process_id != 0:
        llm.engine.follow_leader()
    else:
        tokens = generate_all(llm, host_tier=False)
        slots = llm.runner.cfg.num_layers // 2
        stages = [sorted({s.device.process_index for a in (llm.runner.weights.layers.wq, llm.runner.kv_cache.k)
                          for s in a.global_shards if s.index[0].start == stage * slots}) for stage in range(2)]
        llm.engine.shutdown()
    llm = LLM(checkpoint, pipeline_parallel_size=2, tensor_parallel_size=2, **CHECKPOINT_OPTIONS)
    if process_id != 0:
        llm.engine.follow_leader()
        return
    checkpoint_tokens = generate_checkpoint(llm)
    wq = llm.runner.weights.layers.wq  # stage s's slot on process s only
    checkpoint_stages = [sorted({s.device.process_index for s in wq.global_shards if s.index[0].start == stage})
                         for stage in range(2)]
    llm.engine.shutdown()
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "stage_processes": stages, "checkpoint_tokens": checkpoint_tokens,
                   "checkpoint_stage_processes": checkpoint_stages}, f)


def main() -> None:
    process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    multihost.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, local_device_count=2)
    if sys.argv[4:5] == ["pp"]:
        return main_pipeline(process_id, out, sys.argv[5])
    from jaxinfer.llm import LLM

    # A 16-token step budget: prompts are prefilled in chunks beside the other sequences' decodes.
    llm = LLM(tensor_parallel_size=4, **ENGINE_OPTIONS)
    if process_id != 0:
        llm.engine.follow_leader()
        for spec in SPEC_CONFIGS:
            LLM(tensor_parallel_size=4, speculative_config=spec, **ENGINE_OPTIONS).engine.follow_leader()
        return
    tokens = generate_all(llm)
    shard_processes = sorted({s.device.process_index for s in llm.runner.weights.layers.wq.global_shards})
    stats = llm.engine.stats()
    llm.engine.shutdown()
    spec_tokens, spec_accepted = [], []
    for spec in SPEC_CONFIGS:
        spec_llm = LLM(tensor_parallel_size=4, speculative_config=spec, **ENGINE_OPTIONS)
        spec_tokens.append(generate_spec(spec_llm))
        spec_accepted.append(spec_llm.engine.stats()["spec_accepted_tokens"])
        spec_llm.engine.shutdown()
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "mesh_processes": shard_processes,
                   "num_devices": int(llm.engine.mesh.devices.size),
                   "host_hits": stats["prefix_cache_host_hits"], "spec_tokens": spec_tokens,
                   "spec_accepted": spec_accepted}, f)


if __name__ == "__main__":
    main()
