"""Speculative decoding: a proposer drafts k tokens per sequence and the target model verifies them in one step.

- `config.py`: `SpeculativeConfig` (method, k, draft model, policy knobs), as vLLM's `speculative_config`.
- `ngram.py`: prompt-lookup drafting, no model (Saxena 2023).
- `draft.py`: model drafting on device: a separate draft model with its own paged KV cache on the target's page
  table, or self-drafting with the target's first layers over the target's own cache.
- `proposer.py`: one engine step's drafts (n-gram on the host, or the draft model through the model runner).
- `verify.py`: greedy acceptance and the lossless rejection sampling of Leviathan et al. 2023 / Chen et al. 2023.
- `policy.py`: per step and per sequence, how many drafts (off when the step is compute-bound or acceptance is
  too low), and the acceptance counters.

The engine wiring (draft slots in the scheduler, the verify step in the runner) is described in
`jaxinfer.engine.engine` and `jaxinfer.scheduler.scheduler`.
"""
