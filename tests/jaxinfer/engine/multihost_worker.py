"""One process of the two-process test in `test_multihost.py`: `python multihost_worker.py PROCESS_ID PORT OUT`.

Each process exposes 2 CPU devices; the engine's tp=4 mesh spans both. Process 0 generates and writes the tokens
and the mesh's process indices to OUT (JSON); process 1 follows the leader's steps.
"""

import json
import sys

from jaxinfer.engine import multihost

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived"]
MAX_TOKENS = [10, 4, 7]


def main() -> None:
    process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    multihost.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, local_device_count=2)
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    # A 16-token step budget: prompts are prefilled in chunks beside the other sequences' decodes.
    llm = LLM(tensor_parallel_size=4, warmup=False, max_num_seqs=4, max_num_batched_tokens=16)
    if process_id != 0:
        llm.engine.follow_leader()
        return
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS])
    shard_processes = sorted({s.device.process_index for s in llm.runner.weights.layers.wq.global_shards})
    llm.engine.shutdown()
    with open(out, "w") as f:
        json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "mesh_processes": shard_processes,
                   "num_devices": int(llm.engine.mesh.devices.size)}, f)


if __name__ == "__main__":
    main()
