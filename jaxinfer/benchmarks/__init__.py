"""Benchmarks of the engine and its peers: `jaxinfer bench <workload>` (see `jaxinfer.benchmarks.cli`).

One module per workload, each with `SECTION` (its BENCHMARKS.md markers), `add_arguments(parser)` and
`run(args) -> Report`: `step` (prefill, decode, roofline, step breakdown, peers), `breakdown` (the parts of a
batch-1 and batch-32 decode step and a prefill), `serving`, `attention`,
`checkpoint`, `prefix`, `spec`, `quant`, `quality` (perplexity; with `--matrix` KL divergence, top-1 and greedy
flips per quantization format: `quality_matrix`, `quality_runs`, `quality_metrics`), `sharding`, `load` (the gRPC load test),
`soak` (the gRPC soak test that checks every answer), `frontends` (the same load over gRPC and the OpenAI HTTP API), `structured` (what structured output costs per step),
`startup` (cold and warm starts of generate and serve),
`longctx` (TTFT and peak memory vs context length up to 128K; its children: `longctx_worker`),
`kv_handoff` (bytes and milliseconds per token of context of a KV handoff between engines),
`pipeline` (the pipeline bubble per stage from recorded execution events; its child: `pipeline_worker`).
Shared pieces: `report` (the report type, sections of BENCHMARKS.md, the machine line), `probe` (the bandwidth
probe every roofline divides by, and timing helpers), `peers` (running a peer script in its own interpreter),
`hlo` (scans of compiled steps), `model_setup` (a model's weights on the host, cast, and their byte counts),
`decode_timing` (timed `ModelRunner.execute` decode steps), `dense_matmuls` (a forward's dense matmuls alone).
"""

WORKLOADS = ("step", "breakdown", "serving", "attention", "checkpoint", "prefix", "spec", "quant", "quality", "sharding",
             "load", "soak", "frontends", "structured", "startup",
             "longctx", "kv_handoff", "pipeline")
