"""Engine replicas on Ray behind one router (`jaxinfer serve --replicas N`, or `--prefill-replicas X
--decode-replicas Y`; the optional extra `jaxinfer[cluster]`).

The floor above `jaxinfer.serving`: the router reuses the HTTP front end, the engines are today's `AsyncEngine`.
`replica` (an engine in a Ray actor, and its role), `pool` (starting actors), `routing` (policies, no Ray),
`disagg` (when a prompt crosses to a prefill replica, and the router's counters; no Ray), `splice` (one client
stream out of several attempts; no Ray), `view` (the router's view of its replicas), `engine` (the router:
`AsyncEngine`'s interface over the replicas, disaggregation, resubmission after a fault, health), `stats` (merged
engine stats), `served` (the front end's `ServedEngine` and the router's metrics). Nothing outside this package
imports Ray.
"""
