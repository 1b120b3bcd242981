"""The quant workload's BENCHMARKS.md section: decode speed per format (native kernels and XLA), the peers at
batch 1, the kernel micro-benchmark, and the findings against the goals of the native kernels' issue."""

from __future__ import annotations

import argparse
import statistics

from jaxinfer.benchmarks.probe import roofline_gb_s
from jaxinfer.benchmarks.report import machine_line, table
from jaxinfer.benchmarks.step_peers_report import peer_lines

ROOFLINE_GOAL = 0.70  # share of the weight-read roofline the int8 and int4 kernels should reach at batch 1
INT4_FORMATS = ("int4 g32 (embedding + LM head bf16)",
                "int4 g32, embedding + LM head int8 (llama.cpp Q4_0's layout)",
                "int4 g32 w4a8, embedding + LM head int8 (llama.cpp Q4_0's layout and arithmetic)",
                "gguf (Q4_1 / Q8_0 kept as stored)")
GOAL_FORMATS = ("int8 weight-only", "int8 (w8a8)", *INT4_FORMATS)


def _key(r: dict) -> tuple[str, int]:
    return r["format"], r["batch"]


def _with_isa(name: str, r: dict) -> str:
    """`name` with the row's ISA level in brackets, for rows of the native kernels."""
    return name + (f" ({r['isa']})" if r.get("isa") else "")


def _xla_rows(rows: list[dict]) -> dict:
    return {_key(r): r for r in rows if r["matmuls"] == "XLA"}


def _native_cell(r: dict) -> str:
    calls = r.get("native_calls")
    if calls is None:
        return ""
    return ", ".join(f"{n} {k}" for k, n in sorted(calls.items())) or "none"


def _format_rows(rows: list[dict]) -> list[list[str]]:
    xla = _xla_rows(rows)
    body = []
    for r in rows:
        base = xla.get(_key(r)) if r["matmuls"] == "native" else None
        copies = r.get("copies")
        body.append([r["format"], _with_isa(r["matmuls"], r), str(r["batch"]), f"{r['weight_mib']:.0f}",
                     f"{r['quantized_share'] * 100:.1f}%", f"{r['ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})",
                     f"{r['tok_s']:.1f}", f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "",
                     f"{r['roofline_tok_s']:.0f}", f"{r['of_roofline'] * 100:.0f}%",
                     "" if copies is None else f"{r['temp_mib']:.1f} MiB, {len(copies)} copies",
                     _native_cell(r)])
    return body


def peer_rows(data: dict) -> list[dict]:
    """The peers' batch-1 decodes with the bytes a step of theirs reads and the roofline at the run's probe.

    llama.cpp: its tensors (`model_bytes`) + an f16 KV cache of the mean decode context; HF transformers (bf16):
    the jaxinfer bf16 batch-1 row's weight bytes + the same KV (no roofline when bf16 was not measured).

    Returns:
      dicts of "peer", "weights", "context" (mean tokens), "tok_s" (the median of its runs), "runs" (each run's
      tok/s), "bytes" (or None), "roofline_tok_s" and "of_roofline" (None without bytes).
    """
    out = []
    kv = data["kv_bytes_per_token_f16"]
    bf16 = next((r for r in data["rows"] if r["format"] == "bf16" and r["batch"] == 1), None)
    for peer, result in (("llama.cpp", data.get("llamacpp")), ("HF transformers", data.get("peer"))):
        for weights, res in ((result or {}).get("results") or {}).items():
            context = statistics.mean(res["decode_context"])
            if "model_bytes" in res:
                nbytes = res["model_bytes"] + kv * context
            else:
                nbytes = None if bf16 is None else bf16["step_bytes"] - bf16["kv_bytes"] + kv * context
            roof = None if nbytes is None else data["roofline_gb_s"] * 1e9 / nbytes
            out.append({"peer": peer, "weights": weights, "context": context, "tok_s": res["decode_tok_s"],
                        "runs": res.get("decode_tok_s_runs", [res["decode_tok_s"]]),
                        "bytes": nbytes, "roofline_tok_s": roof,
                        "of_roofline": None if roof is None else res["decode_tok_s"] / roof})
    return out


def _peer_table(prows: list[dict]) -> list[str]:
    if not prows:
        return []
    body = [[p["peer"], p["weights"], f"{p['context']:.0f}", "-" if p["bytes"] is None else f"{p['bytes'] / 1e6:.0f}",
             f"{p['tok_s']:.1f}" + (f" ({min(p['runs']):.1f}-{max(p['runs']):.1f}, {len(p['runs'])} runs)"
                                    if len(p["runs"]) > 1 else ""),
             "-" if p["roofline_tok_s"] is None else f"{p['roofline_tok_s']:.0f}",
             "-" if p["of_roofline"] is None else f"{p['of_roofline'] * 100:.0f}%"] for p in prows]
    return ["", "Peers at batch 1 (same GGUF file; decode after a 128-token prompt, median of the timed steps; with "
                "several runs, the median run and the range):", "",
            table(["peer", "weights", "mean context", "MB per step", "tok/s", "roofline tok/s", "of roofline"],
                  body)]


def _gemv_table(gemv: list[dict], gb_s: float) -> list[str]:
    if not gemv:
        return []
    body = []
    for g in gemv:
        nat = g["native_gb_s"]
        body.append([_with_isa(g["kind"], g), str(g["rows"]), f"[{g['n']}, {g['k']}]", f"{g['bytes'] / 2**20:.0f}",
                     "-" if nat is None else f"{g['native_ms']:.2f}", "-" if nat is None else f"{nat:.1f}",
                     "-" if nat is None else f"{nat / gb_s * 100:.0f}%", f"{g['xla_ms']:.2f}",
                     f"{g['xla_gb_s']:.2f}", "-" if nat is None else f"{nat / g['xla_gb_s']:.1f}x"])
    return ["", f"Kernel micro-benchmark (`--gemv`, `jaxinfer.benchmarks.gemv_stream`): one jitted call over one "
            f"weight, bytes = values + scales, median of the timed calls; \"of probe\": of the roofline's "
            f"{gb_s:.1f} GB/s. XLA = `qeinsum` with the native kernels forbidden (the engine's path without them).", "",
            table(["weight", "rows", "[N, K]", "MiB read", "native ms", "native GB/s", "of probe", "XLA ms",
                   "XLA GB/s", "native / XLA"], body)]


def _findings(rows: list[dict], prows: list[dict]) -> list[str]:
    """Native over XLA per batch, w8a8 over bf16 (each format's fastest row), and the issue's goals (batch 1, native
    rows; each ISA level's row named when the run has several)."""
    out, xla = [], _xla_rows(rows)
    several = len({r.get("isa") for r in rows if r["matmuls"] == "native"}) > 1

    def label(r: dict) -> str:
        return _with_isa(r["format"], r) if several else r["format"]

    for batch in sorted({r["batch"] for r in rows}):
        ratios = [f"{label(r)} {r['tok_s'] / xla[_key(r)]['tok_s']:.2f}x" for r in rows
                  if r["batch"] == batch and r["matmuls"] == "native" and _key(r) in xla]
        if ratios:
            out.append(f"- Batch {batch}, native kernels over XLA (tok/s): " + "; ".join(ratios) + ".")
        best: dict[str, float] = {}
        for r in rows:
            if r["batch"] == batch:
                best[r["format"]] = max(best.get(r["format"], 0.0), r["tok_s"])
        if "int8 (w8a8)" in best and "bf16" in best:
            out.append(f"- Batch {batch}: int8 (w8a8) {best['int8 (w8a8)']:.1f} tok/s vs bf16 {best['bf16']:.1f} "
                       f"({best['int8 (w8a8)'] / best['bf16']:.2f}x).")
    native1 = [r for r in rows if r["batch"] == 1 and r["matmuls"] == "native"]
    goal = [r for f in GOAL_FORMATS for r in native1 if r["format"] == f]
    if goal:
        met = all(r["of_roofline"] >= ROOFLINE_GOAL for r in goal)
        out.append(f"- Goal: >= {ROOFLINE_GOAL:.0%} of the weight-read roofline for int8 and int4 at batch 1 with "
                   "the native kernels: " + "; ".join(f"{label(r)} {r['of_roofline']:.0%}" for r in goal)
                   + f" ({'met' if met else 'not met'}).")
    q4 = next((p for p in prows if p["peer"] == "llama.cpp" and p["weights"] == "Q4_0"), None)
    int4 = [r for f in INT4_FORMATS for r in native1 if r["format"] == f]
    if q4 and int4:
        runs = f", the median of {len(q4['runs'])} runs between the rounds" if len(q4["runs"]) > 1 else ""
        out.append(f"- Goal: int4 batch-1 decode >= llama.cpp Q4_0 ({q4['tok_s']:.1f} tok/s{runs}) in the same run: "
                   + "; ".join(f"{label(r)} {r['tok_s']:.1f} ({r['tok_s'] / q4['tok_s']:.2f}x)" for r in int4)
                   + f" ({'met' if all(r['tok_s'] >= q4['tok_s'] for r in int4) else 'not met'}).")
    return out


def render(data: dict, args: argparse.Namespace, elapsed_s: float) -> str:
    """The section's markdown (without its markers) from `quant.run`'s data (its "peer_rows": `peer_rows`)."""
    rows, gb_s = data["rows"], data["roofline_gb_s"]
    prows = data["peer_rows"]
    peers_ran = data.get("peer") is not None or data.get("llamacpp") is not None
    return "\n".join([
        "## Quantization: decode speed and memory roofline",
        "",
        f"`{args.command}` ({args.date}; {machine_line()}; {elapsed_s:.0f} s). {rows[0]['model']}, one decode token "
        f"per sequence at context {data['context']}, "
        + ("steps chained as the engine's decode loop runs them (each dispatched before the previous one is read: "
           "async scheduling; a sample is a round's calls' mean, the chain's throughput)"
           if getattr(args, "async_scheduling", True) else "each step alone (`--no-async-scheduling`)")
        + ", device step + sampling + host, median "
        "of the timed calls (min-max), "
        + ("one a round per engine, after the other engines' calls (`--burst 1`: the weights as far out of the "
           "caches as those left them)" if getattr(args, "burst", 1) == 1 else
           f"{args.burst - 1} in a row a round per engine after one untimed step (`--burst {args.burst}`, as the "
           "peers time their steps in a row: a lone engine's speed; chained, the untimed step is dispatched and "
           "read before the timed calls, so none of them waits for it)")
        + ". Matmuls: native = the CPU kernels of `pallas_kernels.cpu_gemv` where they "
        "apply (the engine's default), XLA = `JAXINFER_NATIVE_KERNELS=0` around the engine's compile and calls. "
        f"Roofline: batch x {gb_s:.1f} GB/s (the roofline probe's better reading, at the start "
        f"({roofline_gb_s(data['bandwidth']):.1f}) and at the end ({roofline_gb_s(data['bandwidth_end']):.1f}) of "
        "this run) / "
        "bytes the step must read (weights, minus embedding rows not gathered, plus the batch's KV). Last two "
        "columns: XLA's memory analysis of the compiled batch-1 step (temporary bytes) and the buffers in it that "
        "are full-precision copies of quantized weights (`jaxinfer.benchmarks.hlo.materialized_weight_copies`), "
        "and the native kernel call sites in it (`hlo.native_kernel_calls`; the layer scan's body counts once).",
        "",
        table(["weights", "matmuls", "batch", "weight MiB", "params quantized", "step ms", "tok/s", "native / XLA",
               "roofline tok/s", "of roofline", "step temp, weight copies", "native calls"], _format_rows(rows)),
        *_peer_table(prows),
        *([""] + [f"- {line}" for line in peer_lines(data)] if peers_ran else []),
        *_gemv_table(data.get("gemv") or [], gb_s),
        "",
        *_findings(rows, prows),
    ])
