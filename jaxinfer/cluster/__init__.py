"""Engine replicas on Ray behind one router (`jaxinfer serve --replicas N`; the optional extra `jaxinfer[cluster]`).

The floor above `jaxinfer.serving`: the router reuses the HTTP front end, the engines are today's `AsyncEngine`.
`replica` (an engine in a Ray actor), `pool` (starting actors), `routing` (policies, no Ray), `engine` (the
router: `AsyncEngine`'s interface over the replicas), `stats` (merged engine stats), `served` (the front end's
`ServedEngine` and the router's metrics). Nothing outside this package imports Ray.
"""
