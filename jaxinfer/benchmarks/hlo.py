"""Scans of compiled XLA computations, for benchmarks and tests: what a step materialises."""

from __future__ import annotations

import collections
import re

import jax

from models.quant import QuantizedWeight
from pallas_kernels.cpu_gemv import build

_FLOAT_BUFFER = re.compile(r"^\s*(?:ROOT )?%(\S+) = (f32|bf16|f16|f64)\[([\d,]*)\]\S* (\S+?)\(")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_CUSTOM_CALL = re.compile(r'custom_call_target="([\w.\-]+)"|stablehlo\.custom_call @([\w.\-]+)')


def materialized_weight_copies(hlo_text: str, weights) -> list[str]:
    """Full-precision copies of quantized weights in a compiled computation: the proof that none is materialized.

    Scans the optimized HLO (`jax.jit(f).lower(...).compile().as_text()`) for float buffers whose dimensions
    include all of a quantized weight's (or one layer's of a stacked weight), in any order: a converted copy, or a
    product of the weight with a few activation rows (an unfused multiply-reduce). Only instructions outside fused
    computations own buffers (a convert inside a fusion feeds its consumer directly), so those are the ones
    checked; parameters, tuples, get-tuple-element and bitcasts alias other buffers and are skipped. Activations
    with the same dimensions would be reported too, so use it on steps with few tokens (decode).

    Args:
      hlo_text: optimized HLO text.
      weights: the weight pytree whose `QuantizedWeight` leaves are looked for.

    Returns:
      One "name = dtype[dims] opcode" string per suspicious buffer (empty: no full-precision copy).
    """
    shapes = set()
    for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(leaf, QuantizedWeight):
            shape = tuple(leaf.values.shape)
            shapes.add(tuple(sorted(shape)))
            if len(shape) > 2:
                shapes.add(tuple(sorted(shape[1:])))  # one layer (or one expert) of a stacked weight
    fused = set(_CALLS.findall("\n".join(line for line in hlo_text.splitlines() if " fusion(" in line)))
    found, current = [], None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header.group(1)
            continue
        m = _FLOAT_BUFFER.match(line)
        if m is None or current in fused:
            continue
        name, dtype, dims, opcode = m.groups()
        if opcode in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            continue
        have = collections.Counter(int(d) for d in dims.split(",") if d and int(d) != 1)
        if any(not collections.Counter(d for d in s if d != 1) - have for s in shapes):
            found.append(f"{name} = {dtype}[{dims}] {opcode}")
    return found


def native_kernel_calls(hlo_text: str) -> collections.Counter:
    """The native CPU matmul kernels (`pallas_kernels.cpu_gemv`) a compiled computation calls: custom-call sites
    per kernel name, any ISA level (a call inside the layer scan's body counts once).

    Args:
      hlo_text: optimized HLO text (`compiled.as_text()`) or StableHLO (`lowered.as_text()`).

    Returns:
      {kernel name (`build.TARGETS`): call sites}; empty when the computation calls none.
    """
    targets = {build.target_name(k, level): k for k in build.TARGETS for level in build.ISA_LEVELS}
    names = [a or b for a, b in _CUSTOM_CALL.findall(hlo_text)]
    return collections.Counter(targets[t] for t in names if t in targets)
