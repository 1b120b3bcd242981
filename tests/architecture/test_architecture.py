"""The rules of the tree's layout (README "Layout"), checked on the source with `ast`.

Floors run one way: cluster -> serving -> engine -> {scheduler, models, sharding, pallas_kernels}. Each test names
the rule it guards and lists every import that breaks it.
"""

from __future__ import annotations

import pytest

from tests.architecture.import_graph import (GENERATED, REPO, Import, find_cycles, internal_edges, library_files,
                                             imports_of, library_graph, script_modules)

GRAPH = library_graph()
JAX_PACKAGES = ("jax", "jaxlib", "flax", "orbax", "ml_dtypes")


def _imports(prefix: str) -> list[Import]:
    return [imp for m, imps in GRAPH.items() if m == prefix or m.startswith(prefix + ".") for imp in imps]


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _broken(importers: str, *forbidden: str) -> list[str]:
    return [f"{imp.importer}:{imp.line} imports {imp.imported}" for imp in _imports(importers)
            if _under(imp.imported, *forbidden)]


@pytest.mark.parametrize("floor", ["models", "sharding", "pallas_kernels"])
def test_lower_floors_import_nothing_from_jaxinfer(floor):
    assert _broken(floor, "jaxinfer") == []


def test_sharding_knows_no_model():
    assert _broken("sharding", "models") == []


def test_kernels_know_no_model():
    assert _broken("pallas_kernels", "models") == []


def test_scheduler_is_host_only():
    """The scheduler runs on the host with plain Python: no jax, and nothing from the engine above it."""
    assert _broken("jaxinfer.scheduler", *JAX_PACKAGES, "jaxinfer.engine") == []


@pytest.mark.parametrize("floor", ["jaxinfer.engine", "jaxinfer.scheduler"])
def test_engine_and_scheduler_know_no_server(floor):
    assert _broken(floor, "jaxinfer.serving", "jaxinfer.cluster") == []


@pytest.mark.parametrize("package", ["jaxinfer", "models", "sharding", "pallas_kernels"])
def test_flax_is_not_a_dependency(package):
    """Pytree dataclasses come from `models.pytree` (flax's import cost 0.3 s of every start; setup.py lacks it)."""
    assert _broken(package, "flax") == []


def test_serving_knows_no_cluster():
    """The cluster layer (replicas on Ray, the router) stands on the HTTP front end, never the other way."""
    assert _broken("jaxinfer.serving", "jaxinfer.cluster") == []


def test_the_cluster_drives_engines_not_devices():
    """The router and the replicas' actors go through the engine: no jax, model, sharding or kernel of their own."""
    assert _broken("jaxinfer.cluster", *JAX_PACKAGES, "models", "sharding", "pallas_kernels") == []


def test_only_the_cluster_imports_ray():
    """Ray is an optional extra (`jaxinfer[cluster]`): nothing outside `jaxinfer.cluster` imports it, nor the cluster
    modules the command line reads before it knows it needs Ray (the package, its config, routing and disagg)."""
    outside = [f"{imp.importer}:{imp.line} imports {imp.imported}" for m, imps in GRAPH.items()
               if not _under(m, "jaxinfer.cluster") for imp in imps if _under(imp.imported, "ray")]
    assert outside == []
    for module in ("jaxinfer.cluster", "jaxinfer.cluster.config", "jaxinfer.cluster.routing",
                   "jaxinfer.cluster.disagg"):
        assert [imp.imported for imp in GRAPH[module] if _under(imp.imported, "ray")] == []


def test_no_module_imports_a_script():
    """scripts/ holds standalone tools: neither library code nor another script imports one."""
    scripts = script_modules() | {"scripts"}
    found = [imp for imps in GRAPH.values() for imp in imps]
    for path in sorted((REPO / "scripts").glob("*.py")):
        found += imports_of(path, set(scripts))
    assert [f"{imp.importer}:{imp.line} imports {imp.imported}" for imp in found
            if imp.imported.split(".")[0] in scripts] == []


def test_no_import_cycles():
    assert find_cycles(internal_edges(GRAPH)) == []


def test_the_graph_sees_known_edges():
    """The walk itself works: edges that exist on purpose are found (a walk that saw nothing would pass every rule
    above)."""
    edges = internal_edges(GRAPH)
    assert "jaxinfer.scheduler.chunk" in edges["jaxinfer.scheduler.scheduler"]
    assert "models.llama" in edges["jaxinfer.engine.runner"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_modules_stay_small():
    """No library module over 400 lines (kernels up to 600): a longer one does several jobs."""
    too_long = []
    for path in library_files():
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(GENERATED):
            continue
        limit = 600 if rel.startswith("pallas_kernels/") else 400
        lines = len(path.read_text().splitlines())
        if lines > limit:
            too_long.append(f"{rel}: {lines} lines > {limit}")
    assert too_long == []


def test_an_engine_start_imports_no_tpu_or_gpu_kernel():
    """The Pallas TPU / GPU kernels are imported when chosen (`pallas_kernels.lazy`): `jax.experimental.pallas.tpu`
    and `.triton` cost about 0.25 s of every CPU start, where they never run."""
    import subprocess
    import sys

    code = ("import sys, jaxinfer.engine.engine, jaxinfer.serving.serve; "
            "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas') "
            "or m.endswith(('.tpu', '.gpu')) and m.startswith('pallas_kernels')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
