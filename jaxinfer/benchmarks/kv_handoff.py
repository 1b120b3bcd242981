r"""`jaxinfer bench kv_handoff`: what moving a prefilled request's KV pages between engines costs per token of
context (`jaxinfer.engine.kv_handoff`): bytes on the wire, and the milliseconds of the export (device -> host, with
the conversion to the wire dtype on device) and of the import (host -> device, converted to the cache dtype and
written into new pages), for f32 / bf16 / int8 / fp8 on the wire.

One engine plays both ends (on one machine they would share the cores anyway): for each context length it prefills
one prompt of random ids with `prefill_only`, then times `export_handoff` on the held pages `--reps` times per wire
dtype (the export without the release of the pages) and `import_kv` of that payload (each import is aborted again,
its pages freed). Reported: medians. What moves between machines (Ray's object store, a network) is not measured:
at B bytes per token and a link of G GB/s, add B / G ns per token.

Expectation, written before measuring: SmolLM2-135M's KV is 30 layers x 3 KV heads x 64 x 2 (K, V) = 11,520
numbers per token: 46 KB in f32, 23 KB in bf16, 11.5 KB + 1.4 KB of f32 scales in int8 / fp8. Copies run at a
few GB/s on this CPU, so ~5-30 us per token each way; the int8 / fp8 conversion adds a pass over the data.

    .venv/bin/jaxinfer bench kv_handoff
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import numpy as np

from jaxinfer.benchmarks.report import Report, int_list, machine_line, table
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_handoff import WIRE_DTYPES, export_handoff, resolve_wire_dtype
from jaxinfer.sampling_params import SamplingParams

SECTION = ("<!-- kv-handoff: begin -->", "<!-- kv-handoff: end -->")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (and its KV cache's)")
    parser.add_argument("--lengths", default="128,512,2048", help="comma-separated context lengths, tokens")
    parser.add_argument("--wire", default="float32,bfloat16,int8,fp8", help="comma-separated wire dtypes")
    parser.add_argument("--reps", type=int, default=5, help="timed exports and imports per length and wire dtype")


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 1):  # the first compiles this shape
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _measure(engine: Engine, length: int, wires: list[str], reps: int, rng: np.random.Generator) -> list[dict]:
    prompt = rng.integers(3, engine.runner.vocab_limit, length).tolist()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(prompt, params, request_id="bench", prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    text, seq = engine._handoffs["bench"]
    rows = []
    for wire in wires:
        dtype = resolve_wire_dtype(wire, engine.runner.kv.kv_dtype)
        def export(dtype=dtype):
            return export_handoff(engine.runner.kv, engine.model_config, engine.mesh, seq, text, dtype)

        handoff = export()
        export_s = _median_s(export, reps)

        def import_() -> None:
            engine.import_kv(handoff, params, request_id="import")
            jax.block_until_ready(engine.runner.kv_cache)
            engine.abort("import")
            while engine.has_unfinished_requests():
                engine.step()

        import_s = _median_s(import_, reps)
        rows.append({"tokens": length, "wire": wire, "bytes": handoff.nbytes,
                     "bytes_per_token": handoff.nbytes / length,
                     "export_ms": export_s * 1e3, "import_ms": import_s * 1e3,
                     "export_us_per_token": export_s * 1e6 / length, "import_us_per_token": import_s * 1e6 / length})
    engine.abort("bench")
    return rows


def run(args: argparse.Namespace) -> Report:
    """Measures every length and wire dtype; the report (`data`: rows of tokens, wire, bytes, bytes_per_token,
    export_ms, import_ms, export_us_per_token, import_us_per_token).

    Raises:
      ValueError: bad options.
    """
    lengths = int_list("--lengths", args.lengths)
    wires = [w.strip() for w in args.wire.split(",") if w.strip()]
    if args.reps < 1 or any(w not in WIRE_DTYPES for w in wires):
        raise ValueError(f"--lengths must list lengths >= 1, --reps be >= 1 and --wire name some of "
                         f"{', '.join(WIRE_DTYPES)}")
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, warmup=False, enable_prefix_caching=False,
                                 max_model_len=max(lengths) + 8, max_num_batched_tokens=max(lengths) + 8,
                                 max_num_seqs=2))
    rng = np.random.default_rng(0)
    rows = [row for length in lengths for row in _measure(engine, length, wires, args.reps, rng)]
    cells = [[str(r["tokens"]), r["wire"], f"{r['bytes'] / 2**20:.2f}", f"{r['bytes_per_token']:,.0f}",
              f"{r['export_ms']:.2f}", f"{r['import_ms']:.2f}", f"{r['export_us_per_token']:.1f}",
              f"{r['import_us_per_token']:.1f}"] for r in rows]
    markdown = "\n".join([
        "## KV handoff (disaggregated prefill / decode)\n",
        f"`jaxinfer bench kv_handoff`: one {args.dtype} engine prefills a prompt (`prefill_only`) and exports its "
        "KV pages to the host (`export_handoff`: gathered and converted to the wire dtype on device), then imports "
        f"them into new pages (`import_kv`: converted to the cache dtype); medians of {args.reps}. The move "
        "between machines is not included.\n",
        "```", args.command, "```\n",
        f"- date: {args.date}; model {engine.model_config.name}; {machine_line()}, Python "
        f"{platform.python_version()}\n",
        table(["context tokens", "wire", "MiB", "bytes / token", "export ms", "import ms", "export us / token",
               "import us / token"], cells), ""])
    return Report("kv_handoff", markdown, {"rows": rows, "settings": {"lengths": lengths, "wires": wires,
                                                                      "dtype": args.dtype, "reps": args.reps}})
