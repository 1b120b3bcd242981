"""`jaxinfer tune`: sizes the engine for a traffic profile by sweeping engine options within a budget of runs.

`profile` (traffic from a JSONL of requests or length histograms with an arrival rate), `drive` (a profile through
an Engine-shaped server on a clock, stopping a run once a p99 latency target is certainly missed), `simulate` (the
real scheduler with a step-cost model on a virtual clock), `engine_run` (real runs, one `Engine` per
configuration), `sweep` (the configurations within the budget, their runs, the best), `report` (the table, the
throughput-vs-latency plot with its Pareto front, the BENCHMARKS.md section). The command is
`jaxinfer.commands.tune`; the best configuration is a config file (`jaxinfer.engine.config_file`).
"""
