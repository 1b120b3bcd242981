"""The import graph of the source tree, read with `ast` (nothing is imported): which module imports which.

An import under `if TYPE_CHECKING:` is not an edge (it never runs). Imports inside functions are edges: a lazy
import still ties the two modules together. `from pkg import name` is an edge to `pkg.name` when that is a module
of the tree, else to `pkg` (its `__init__`).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY_ROOTS = ("jaxinfer", "models", "sharding", "pallas_kernels")
GENERATED = ("jaxinfer/serving/v1/",)  # gRPC stubs written by grpcio-tools (scripts/gen_protos.sh)


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement: the importing module, the imported name (absolute, dotted), and where it is."""

    importer: str
    imported: str
    line: int


def module_name(path: Path, root: Path = REPO) -> str:
    """`jaxinfer/engine/runner.py` -> "jaxinfer.engine.runner"; a package's `__init__.py` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_files(root: Path = REPO) -> list[Path]:
    """Every Python file of the library packages (generated gRPC stubs included: they import too)."""
    return sorted(p for r in LIBRARY_ROOTS for p in (root / r).rglob("*.py"))


def script_modules(root: Path = REPO) -> set[str]:
    """Names a script in scripts/ can be imported by (scripts/ on sys.path): the file stems."""
    return {p.stem for p in (root / "scripts").glob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST):
    """Every node under `node`, skipping the bodies of `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield sub
                yield from _walk(sub)
            continue
        yield child
        yield from _walk(child)


def imports_of(path: Path, known: set[str], root: Path = REPO) -> list[Import]:
    """The imports of one file, resolved to absolute names (relative imports included).

    Args:
      path: a .py file under `root`.
      known: module names of the tree, to tell `from pkg import module` from `from pkg import name`.
    """
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [Import(me, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append(Import(me, full if full in known else base, node.lineno))
    return out


def library_graph(root: Path = REPO) -> dict[str, list[Import]]:
    """module -> its imports, for every library module."""
    files = library_files(root)
    known = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, known, root) for p in files}


def internal_edges(graph: dict[str, list[Import]]) -> dict[str, set[str]]:
    """module -> the library modules it imports (an import of `a.b.c` also runs `a` and `a.b`'s `__init__`, but
    those are the package's own business, so only the named module counts)."""
    modules = set(graph)
    edges: dict[str, set[str]] = {m: set() for m in graph}
    for m, imps in graph.items():
        for imp in imps:
            name = imp.imported
            while name and name not in modules:  # `pkg.mod.attr` -> `pkg.mod`
                name = name.rpartition(".")[0]
            if name and name != m:
                edges[m].add(name)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles
