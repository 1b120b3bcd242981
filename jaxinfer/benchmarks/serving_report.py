"""The serving workload's BENCHMARKS.md section: headline against the HF peer, every scenario, where the time goes,
the decode probe, and observations computed from the numbers of the run."""

from __future__ import annotations

import functools
import math

from jaxinfer.benchmarks.report import machine_line, table
from jaxinfer.benchmarks.serving_scenarios import PAGE_SIZE, Scenario


def render(r: dict) -> str:
    """The serving section of BENCHMARKS.md (the runner adds its markers, so a serving run replaces only it).

    Args:
      r: what `serving.run` measured: scenarios, ours ({dtype: ...}), peer, roof_bw (bytes/s), bandwidth, model
        (name and shapes), machine, engine limits, command, date, elapsed_s.
    """
    scenarios: list[Scenario] = r["scenarios"]
    ours: dict = r["ours"]
    peer: dict | None = r.get("peer")
    roof_bw = r["roof_bw"]
    head = scenarios[0]
    layers = r["model"]["num_layers"]
    out = ["## Serving workload\n"]
    out.append(
        f"Requests to {r['model']['name']} through `Engine` (continuous batching, default `EngineConfig` but: page "
        f"size {PAGE_SIZE}, `max_num_seqs` {r['max_num_seqs']}, `max_num_batched_tokens` "
        f"{r['max_num_batched_tokens']}, scan over layers; `max_model_len` "
        f"{next(iter(ours.values()))['max_model_len']}, the longest context rounded up to its page-table bucket, "
        "which gives the same step shapes as the default 8192 with fewer to warm up), driven directly: each "
        "request is added with `add_request` at its arrival time and `step` runs until all finish. Prompts are "
        "consecutive slices of the GPL-3 text tokenized with the model's tokenizer; every request is greedy with "
        "`ignore_eos=True` and `max_tokens` = its output length, so it produces exactly that many tokens. Per "
        "dtype, the engine first compiles what `EngineConfig(warmup=True)` compiles at start-up (every decode "
        "bucket and single-sequence prefill bucket; timed on its own below), then each scenario runs untimed "
        "with the same prompts and arrivals and outputs cut short (just long enough to reach the same KV page "
        "buckets), which "
        "compiles the remaining shapes (steps that prefill several sequences at once); the time of the calls that "
        "compiled is the compile-run column. The XLA persistent compilation cache was "
        + ("on" if r.get("compilation_cache") else "off (cold compiles)") + ". The machine is a shared 2-core VM: "
        "numbers move by 20% or more between runs (much more when other jobs run), so compare rows of one run.\n")
    out.append(
        "Definitions: **end-to-end** output tok/s = all output tokens / (last finish - first arrival); **TTFT** = "
        "first token - scheduled arrival; **TPOT** = (finish - first token) / (output tokens - 1); p50/p99 over "
        "requests; **decode-only** tok/s = tokens produced by steps that ran only decodes / those steps' wall time "
        "(host work included). For HF transformers (one batched `generate` of all prompts, left padding, greedy, "
        "`max_new_tokens = min_new_tokens` = output length, torch threads = "
        f"{peer.get('threads', '?') if peer else '?'}): TTFT = when the batch's first tokens reach the streamer "
        "(the whole batch's prefill), the same for every request; decode-only = N x (output - 1) / (total - TTFT).\n")
    out.append(f"This section comes from one run of:\n\n```\n{r['command']}\n```\n")
    out.append(f"- date: {r['date']}; total run time of the command: {r['elapsed_s'] / 60:.1f} min\n"
               f"- {machine_line(r['machine'])}\n"
               f"- model: {r['model']['name']}: {layers} layers, hidden size {r['model']['hidden_size']}, "
               f"{r['model']['num_heads']} query / {r['model']['num_kv_heads']} KV heads of "
               f"{r['model']['head_dim']}, vocabulary {r['model']['vocab_size']}\n"
               f"- bandwidth measured in the same run (the roofline probe, {r['bandwidth']['label']}; the larger "
               f"of its measurements at the start and the end): {roof_bw / 1e9:.1f} GB/s\n"
               f"- 1-minute load average at the start and end of each timed run (2 cores; well above 2 means other "
               f"jobs competed for the CPU): "
               + ", ".join(f"{dt} `{name}` {s['load_avg'][0]:.1f}-{s['load_avg'][1]:.1f}"
                           for dt, o in ours.items() for name, s in o["scenarios"].items())
               + (f", HF peer {peer['load_avg'][0]:.1f}-{peer['load_avg'][1]:.1f}"
                  if peer and "load_avg" in peer else "") + "\n"
               + "".join(f"- scenario `{sc.name}`: {sc.describe()}, seed {sc.seed}\n" for sc in scenarios))

    # headline: ours vs peer
    pres = (peer or {}).get("results", {})
    out.append(f"### Headline: `{head.name}` ({head.describe()}), jaxinfer vs HF transformers\n")
    rows = []
    for dt, o in ours.items():
        s = o["scenarios"][head.name]
        p = pres.get(dt)

        def cell(v: float, fmt: str) -> str:
            return fmt.format(v) if v is not None and not math.isnan(v) else "-"

        def ratio(a, b, invert=False):
            if a is None or b is None or not b or not a:
                return "-"
            return f"{(b / a) if invert else (a / b):.2f}x"

        rows.append([dt, "end-to-end output tok/s", cell(s["output_tok_s"], "{:.1f}"),
                     cell(p["output_tok_s"], "{:.1f}") if p else "-",
                     ratio(s["output_tok_s"], p["output_tok_s"]) if p else "-"])
        rows.append([dt, "decode-only tok/s", cell(s.get("decode_tok_s"), "{:.1f}"),
                     cell(p["decode_tok_s"], "{:.1f}") if p else "-",
                     ratio(s.get("decode_tok_s"), p["decode_tok_s"]) if p else "-"])
        rows.append([dt, "TTFT p50 / p99 s", f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f}",
                     f"{p['ttft_s']:.2f} / {p['ttft_s']:.2f}" if p else "-",
                     ratio(s["ttft_p50"], p["ttft_s"], invert=True) + " (p50)" if p else "-"])
        rows.append([dt, "TPOT p50 / p99 ms", f"{1e3 * s['tpot_p50']:.0f} / {1e3 * s['tpot_p99']:.0f}",
                     f"{1e3 * p['tpot_s']:.0f} / {1e3 * p['tpot_s']:.0f}" if p else "-",
                     ratio(s["tpot_p50"], p["tpot_s"], invert=True) + " (p50)" if p else "-"])
        rows.append([dt, "wall s (first arrival to last finish)", f"{s['wall_s']:.1f}",
                     f"{p['total_s']:.1f}" if p else "-", "-"])
    out.append(table(["dtype", "metric", "jaxinfer", "HF transformers", "jaxinfer / HF (higher is better)"],
                      rows))
    out.append("")
    if peer is None:
        out.append("HF transformers peer skipped (`--peer-python` not given).\n")
    elif "error" in peer:
        out.append(f"HF transformers peer not run: {peer['error']}.\n")
    else:
        out.append(f"HF transformers {peer['transformers']}, torch {peer['torch']}, same GGUF file dequantized to "
                   "the dtype, same prompt ids. llama.cpp (llama-cpp-python) is not compared: the package index "
                   "here offers only its source distribution, no prebuilt CPU wheel, and building llama.cpp from "
                   "source was out of this run's time budget.\n")

    # all scenarios, ours
    out.append("### jaxinfer, every scenario\n")
    rows = []
    for dt, o in ours.items():
        for sc in scenarios:
            s = o["scenarios"][sc.name]
            rows.append([sc.name, dt, f"{s['output_tok_s']:.1f}", f"{s.get('decode_tok_s', float('nan')):.1f}",
                         f"{s['ttft_p50']:.2f} / {s['ttft_p99']:.2f}",
                         f"{1e3 * s['tpot_p50']:.0f} / {1e3 * s['tpot_p99']:.0f}", f"{s['wall_s']:.1f}",
                         f"{s['steps']} ({s['decode_steps']} decode-only)", str(s["preemptions"]),
                         f"{s['compiled_shapes']} / {s['compile_s']:.1f}", str(s["compiled_calls"])])
    out.append(table(["scenario", "dtype", "e2e out tok/s", "decode-only tok/s", "TTFT p50 / p99 s",
                       "TPOT p50 / p99 ms", "wall s", "steps", "preemptions",
                       "compile run: shapes / s", "compiles in timed run"], rows))
    out.append("")
    out.append("Engine start-up: model load + KV cache allocation "
               + ", ".join(f"{dt} {o['load_s']:.1f} s" for dt, o in ours.items())
               + "; start-up compile (`EngineConfig(warmup=True)`) "
               + ", ".join(f"{dt} {o['warmup_shapes']} shapes in {o['warmup_s']:.1f} s" for dt, o in ours.items())
               + ".\n")

    # efficiency
    out.append(f"### Where the time goes (jaxinfer, `{head.name}`)\n")
    out.append(
        "Padding: rows the runner computes / real tokens (token buckets are powers of two, at least 2 for decode "
        "and 16 for prefill), and attention score cells the reference attention computes (padded sequences x "
        "padded query run x page-table width x 16) / the cells of the real (new tokens x context) pairs. Host share: "
        "`EngineMetrics.host_time_s / step_time_s` (scheduler and output bookkeeping; the engine counts the whole "
        "`execute` call, host padding included, as device time), and the share of step wall time outside the "
        "jitted step itself (blocked until ready; so host padding, transfers and sampling-array building are "
        "counted as host). Decode roofline: bytes a decode-only step must read (all weights + the K/V of every "
        "sequence's real context) per second of decode-only step time, as a share of the measured bandwidth. "
        "Dense GFLOP/s: the forward's matmul FLOPs (projections, MLP, LM head on the sampled rows) per second of "
        "decode-only step wall time, and per second of the prefill calls' device time.\n")
    rows = []
    for dt, o in ours.items():
        s = o["scenarios"][head.name]
        g = functools.partial(lambda d, k, fmt: fmt.format(d.get(k, float("nan"))), s)
        rows.append([dt, f"{g('decode_token_pad', '{:.2f}')} / {g('decode_attn_pad', '{:.2f}')}",
                     f"{g('prefill_token_pad', '{:.2f}')} / {g('prefill_attn_pad', '{:.2f}')}",
                     f"{100 * s['engine_host_share']:.1f}%", f"{100 * s['outside_device_share']:.1f}%",
                     f"{g('decode_step_ms_median', '{:.0f}')} (batch {g('decode_mean_batch', '{:.0f}')})",
                     f"{g('decode_gb_s', '{:.1f}')} GB/s = "
                     f"{100 * s.get('decode_gb_s', float('nan')) * 1e9 / roof_bw:.0f}%",
                     f"{g('decode_dense_gflop_s', '{:.0f}')} / {g('prefill_dense_gflop_s', '{:.0f}')}"])
    out.append(table(["dtype", "decode padding: tokens / attention", "prefill padding: tokens / attention",
                       "engine host share", "outside jitted step", "decode-only step ms (median)",
                       "decode bytes rate = % of roofline", "dense GFLOP/s: decode / prefill calls"], rows))
    out.append("")
    probes = {dt: o["probe"] for dt, o in ours.items() if "probe" in o}
    if probes:
        pr0 = next(iter(probes.values()))
        lo, hi = pr0["contexts"]
        out.append(f"A decode step of batch {pr0['batch']} on its own (`ModelRunner.execute`, median of 5; dummy "
                   "sequences on distinct pages): at context "
                   f"{lo} ({-(-lo // PAGE_SIZE)} pages, page-table bucket {pr0['widths'][0]}) "
                   f"and {hi} ({-(-hi // PAGE_SIZE)} pages, bucket {pr0['widths'][1]} pages = "
                   f"{pr0['widths'][1] * PAGE_SIZE} tokens computed per sequence), and only "
                   f"the dense matmuls of the forward ({pr0['rows']} rows, {layers} layers + LM head; "
                   "`jaxinfer.benchmarks.dense_matmuls`), and only the attention (`paged_attention_reference`, "
                   f"the runner's attention, on the same page tables, timed per call x {layers} layers). The parts run "
                   "on their own, so they need not add up exactly to the step.\n")
        out.append(table(["dtype", f"execute ctx {lo} ms", f"execute ctx {hi} ms", "dense matmuls only ms",
                           f"attention only ctx {lo} ms", f"attention only ctx {hi} ms",
                           f"rest at ctx {hi} ms (execute - dense - attention)"],
                          [[dt, f"{p[f'execute_ctx{lo}']:.0f}", f"{p[f'execute_ctx{hi}']:.0f}", f"{p['dense']:.0f}",
                            f"{p[f'attention_ctx{lo}']:.0f}", f"{p[f'attention_ctx{hi}']:.0f}",
                            f"{p[f'execute_ctx{hi}'] - p['dense'] - p[f'attention_ctx{hi}']:.0f}"]
                           for dt, p in probes.items()]))
        out.append("")
    notes = observations(r) + compile_notes(r)
    if notes:
        out.append("### Observations\n")
        out.append("\n".join(f"- {n}" for n in notes) + "\n")
    return "\n".join(out)


def observations(r: dict) -> list[str]:
    """Findings computed from the numbers of this run."""
    notes = []
    head: Scenario = r["scenarios"][0]
    pres = (r.get("peer") or {}).get("results", {})
    parts = []
    for dt, o in r["ours"].items():
        s, p = o["scenarios"][head.name], pres.get(dt)
        if p:
            parts.append(f"{dt}: end-to-end {s['output_tok_s'] / p['output_tok_s']:.2f}x, decode-only "
                         f"{s['decode_tok_s'] / p['decode_tok_s']:.2f}x, TTFT p50 {s['ttft_p50']:.1f} s vs "
                         f"{p['ttft_s']:.1f} s")
    if parts:
        text = f"**Against HF transformers** at `{head.name}`: " + "; ".join(parts) + "."
        if head.offline:
            budget = r["max_num_batched_tokens"]
            per_step = budget // head.input_len[1] if head.input_len[1] <= budget else 0
            text += (" HF prefills the whole batch in one forward, so every request waits for all of it; the engine "
                     f"admits prompts within its {budget}-token step budget ({per_step} x {head.input_len[1]} "
                     "tokens per step here), so early requests get their first token sooner and the last ones later "
                     "(TTFT p99), while the running ones keep decoding in between.")
        notes.append(text)
    for dt, o in r["ours"].items():
        s, p = o["scenarios"][head.name], o.get("probe")
        if "decode_tok_s" not in s:
            continue
        share = s["decode_gb_s"] * 1e9 / r["roof_bw"]
        verdict = "so memory bandwidth is not the limit" if share < 0.5 else "close to the memory-bandwidth limit"
        text = (f"**What bounds decode ({dt}).** Decode-only steps move {s['decode_gb_s']:.1f} GB/s of "
                f"weights + real KV, {100 * share:.0f}% of the measured bandwidth, {verdict} at batch "
                f"{s['decode_mean_batch']:.0f}; their dense matmuls run at "
                f"{s['decode_dense_gflop_s']:.0f} GFLOP/s against {s.get('prefill_dense_gflop_s', float('nan')):.0f} "
                "in the prefill calls of the same run.")
        if p:
            lo, hi = p["contexts"]
            step, at_hi, at_lo = p[f"execute_ctx{hi}"], p[f"attention_ctx{hi}"], p[f"attention_ctx{lo}"]
            text += (f" In the isolated batch-{p['batch']} step at context {hi} ({step:.0f} ms), the dense matmuls "
                     f"take {p['dense']:.0f} ms ({100 * p['dense'] / step:.0f}%) and the reference attention "
                     f"{at_hi:.0f} ms ({100 * at_hi / step:.0f}%): it computes every sequence over its whole page "
                     f"bucket ({p['widths'][1] * PAGE_SIZE} tokens at context {hi}; buckets grow 4x), against "
                     f"{at_lo:.0f} ms at context {lo}, where the whole step takes {p[f'execute_ctx{lo}']:.0f} ms.")
        text += (f" Host work is {100 * s['outside_device_share']:.0f}% of step time (engine bookkeeping alone "
                 f"{100 * s['engine_host_share']:.1f}%).")
        notes.append(text)
    return notes


def compile_notes(r: dict) -> list[str]:
    """A note on compiles that happened in timed runs (their time is inside the timed numbers)."""
    hits = [f"{dt} `{name}` {s['compiled_calls']}" for dt, o in r["ours"].items()
            for name, s in o["scenarios"].items() if s["compiled_calls"]]
    if not hits:
        return ["**Compiles.** No step compiled during a timed run: start-up warm-up plus the short compile run "
                "covered every shape."]
    return ["**Compiles.** Some steps of timed runs still compiled a new shape (" + ", ".join(hits) + "): with "
            "Poisson arrivals the mix of sequences prefilled together in one step differs from the compile run's, "
            "and `EngineConfig(warmup=True)` compiles only single-sequence prefill shapes; each such compile (about "
            "1-2 s) lands in that run's TTFT / TPOT tail."]
