"""Benchmarks of the engine and its peers (`jaxinfer bench <workload>`)."""
