"""The step workload's BENCHMARKS.md section, from its report data: tables, then findings computed from the
numbers (the wording follows the numbers, so a rerun stays consistent)."""

from __future__ import annotations

import platform

import jax

from jaxinfer.benchmarks import kv_layout, model_setup, step_peers_report
from jaxinfer.benchmarks.report import machine_line, table
from jaxinfer.benchmarks.step_breakdown import PARTS, part_labels
from models.config import ModelConfig


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r]


def _scan_vs_unrolled(data: dict, modes: dict, bds: dict) -> str | None:
    parts = []
    for dt in data["dtypes"]:
        s, u = modes.get((dt, "scan")), modes.get((dt, "unrolled"))
        if s and u:
            s_comp = s["prefill_compile_s"] + s["decode_short"]["compile_s"]
            u_comp = u["prefill_compile_s"] + u["decode_short"]["compile_s"]
            parts.append(f"{dt}: decode (short context) {s['decode_short']['tok_s'] / u['decode_short']['tok_s']:.1f}x "
                         f"faster, prefill {s['prefill_tok_s'] / u['prefill_tok_s']:.2f}x, compile (prefill + decode "
                         f"shapes) {s_comp:.0f} s vs {u_comp:.0f} s")
    if not parts:
        return None
    text = "**Scan vs unrolled.** Scan over layers against the unrolled loop: " + "; ".join(parts) + "."
    bd = bds.get(data["dtypes"][0])
    if bd:
        text += (" The unrolled forward slices each layer's weights out of the stacked [L, ...] arrays inside the jit, "
                 "and XLA:CPU materializes every slice as a copy fusion before its matmul: the matmuls alone take "
                 f"{bd['dense_sliced']:.0f} ms that way, against {bd['dense_scan']:.0f} ms scanned and "
                 f"{bd['dense_separate']:.0f} ms unrolled over separate per-layer arrays ({data['dtypes'][0]}, "
                 "breakdown table). Compute-bound prefill hardly notices.")
    return text


def _roofline(data: dict, modes: dict, bds: dict, rows: list[dict]) -> str | None:
    bw = data["roofline_gb_s"] * 1e9
    b1: dict[str, dict] = {}
    for r in rows:  # each dtype's first scan batch-1 row: the short context (the long one follows it)
        if r["layers"] == "scan" and r["batch"] == 1:
            b1.setdefault(r["dtype"], r)
    parts = [f"{dt} {100 * r['of_roofline']:.0f}% ({r['tok_s']:.0f} of {r['roofline_tok_s']:.0f} tok/s)"
             for dt, r in b1.items()]
    if not parts:
        return None
    text = "**Roofline.** Batch-1 decode (scan, short context) reaches " + ", ".join(parts) + "."
    for dt, bd in bds.items():
        floor_gbs = data["weight_bytes"][dt] / (bd["dense_scan"] / 1e3) / 1e9
        text += (f" {dt}: of {bd['execute']:.1f} ms per `execute`, the forward is {bd['forward']:.1f}, sampling "
                 f"{bd['sample']:.1f}, host-side work ~{max(bd['execute'] - bd['step'], 0):.1f}; the forward's dense "
                 f"matmuls alone need {bd['dense_scan']:.1f} ms ({floor_gbs:.0f} GB/s of weights, "
                 f"{100 * floor_gbs * 1e9 / bw:.0f}% of the probe bandwidth).")
    big = [r for r in _ok(data["batch_decodes"]) if modes.get((r["dtype"], "scan"))]
    if big:
        r = max(big, key=lambda x: x["batch"])
        pre = modes[(r["dtype"], "scan")]["prefill_tok_s"]
        text += (f" At batch {r['batch']} the bandwidth roofline stops binding: {r['dtype']} decode's {r['tok_s']:.0f} "
                 f"tok/s is {100 * r['tok_s'] / pre:.0f}% of the same dtype's prefill rate ({pre:.0f} tok/s), which "
                 "is closer to this machine's compute ceiling.")
    return text


def _bf16_vs_f32(data: dict, modes: dict, bds: dict) -> str | None:
    f32, bf16 = modes.get(("float32", "scan")), modes.get(("bfloat16", "scan"))
    if not (f32 and bf16):
        return None
    text = (f"**bf16 vs f32.** bf16 halves the bytes; it prefills at "
            f"{bf16['prefill_tok_s'] / f32['prefill_tok_s']:.2f}x the f32 rate and decodes batch 1 at "
            f"{bf16['decode_short']['tok_s'] / f32['decode_short']['tok_s']:.2f}x.")
    bd = bds.get("bfloat16")
    if bd and "float32" in bds:
        lm = (f"XLA:CPU's bf16 matrix-vector product with one row takes {bd['lm_head_1row']:.1f} ms for the LM head "
              f"against {bd['lm_head_2rows']:.1f} ms with two rows (f32: {bds['float32']['lm_head_1row']:.1f} vs "
              f"{bds['float32']['lm_head_2rows']:.1f})")
        if bd["logit_rows"] == 1:
            text += (f" The LM head explains it: a batch-1 decode step computes logits for one row, and {lm}, "
                     f"{bd['lm_head_1row'] / bd['forward'] * 100:.0f}% of the bf16 forward.")
        else:
            text += f" The runner pads batch-1 logits to {bd['logit_rows']} rows, which matters: {lm}."
    by = {(r["dtype"], r["batch"]): r for r in _ok(data["batch_decodes"])}
    common = sorted(b for (dt, b) in by if dt == "bfloat16" and ("float32", b) in by)
    if common:
        text += " bf16 over f32 at " + ", ".join(
            f"batch {b}: {by[('bfloat16', b)]['tok_s'] / by[('float32', b)]['tok_s']:.2f}x" for b in common) + "."
    return text


def observations(data: dict) -> list[str]:
    """Findings computed from this run's numbers."""
    modes = {(m["dtype"], m["layers"]): m for m in data["modes"]}
    bds = data.get("breakdown", {})
    notes = [_scan_vs_unrolled(data, modes, bds), _roofline(data, modes, bds, _ok(data["decode_rows"])),
             _bf16_vs_f32(data, modes, bds)]
    kv = [k for k in data.get("kv_layout", []) if "ours_ms" in k and "alt_ms" in k]
    if kv:
        def verdict(x: float) -> str:
            return "ours faster" if x < 0.9 else "alternative faster" if x > 1.1 else "within 10%, noise here"

        cells = [f"{k['dtype']} {k['ours_ms']:.2f} vs {k['alt_ms']:.2f} ms ({verdict(k['ours_ms'] / k['alt_ms'])})"
                 for k in kv]
        dt = data["dtypes"][0]
        share = 100 * data["kv_bytes_per_token"][dt] * data["prefill_len"] / data["weight_bytes"][dt]
        notes.append(f"**KV layout.** Our [P, K, page_size, H] layout against [P, page_size, K, H], one layer call "
                     f"at batch {data['kv_batch']}, context {data['kv_context']}: {'; '.join(cells)}. At batch 1 the "
                     f"KV cache is a small share of a decode step's bytes either way ({share:.1f}% of the {dt} "
                     f"weights at context {data['prefill_len']}).")
    fails = [r for r in data["decode_rows"] if "error" in r]
    if fails:
        notes.append("**Failures.** " + ", ".join(f"{r['dtype']} batch {r['batch']}" for r in fails)
                     + " raised instead of running; see the footnote.")
    return [n for n in notes if n] + step_peers_report.observations(data)


def _intro(data: dict, cfg: ModelConfig, command: str, date: str) -> list[str]:
    return [
        "## Step workload: prefill, decode, roofline, step breakdown, KV layout, peers\n",
        f"CPU throughput of jaxinfer on {cfg.name or 'the model'} ({model_setup.describe(cfg)}; "
        f"`{data['model_path']}` loaded in f32 and cast to the benchmarked dtype), measured through `ModelRunner` "
        f"with greedy sampling and page size {data['page_size']}. Prefill is one {data['prefill_len']}-token chunk; "
        f"decode is batch 1 after a {data['decode_prompt_len']}-token prompt (short context) and near context "
        f"{data['prefill_len']} (long, scan only), timing whole `execute` calls (host padding, transfer, jitted step, sampling, "
        "sync). Every shape is run once before timing; that first call's extra time is reported as compile seconds. "
        f"Medians over {data['prefill_reps']} prefills and {data['decode_steps']} decode steps. All sections come "
        "from one run of:\n",
        f"```\n{command}\n```\n",
        f"- date: {date}\n- backend {jax.default_backend()}, Python "
        f"{platform.python_version()}\n- {machine_line()}; a shared, noisy VM: numbers move by 20% or more between "
        f"runs, so compare rows of one run\n- total run time: {data['elapsed_s'] / 60:.1f} min\n",
    ]


def _bandwidth(data: dict) -> list[str]:
    bw, end = data["bandwidth"], data["bandwidth_end"]
    return [
        "### Memory read bandwidth\n",
        f"Each probe ran at the start and again at the end of the run (median of {data['bw_reps']} calls each time).\n",
        table(["probe", "bytes read", "GB/s at start", "GB/s at end"],
              [[b["label"], f"{b['bytes'] / 2**30:.2f} GiB", f"{b['gb_s']:.1f}",
                f"{end[k]['gb_s']:.1f}" if k in end else "-"] for k, b in bw.items()]),
        f"\nEvery roofline below divides by the roofline probe (the jitted f32 sum), the better of its two readings: "
        f"{data['roofline_gb_s']:.1f} GB/s.\n",
    ]


def _speeds(data: dict) -> list[str]:
    p, s = data["prefill_len"], data["decode_prompt_len"]
    no_long = {"tok_s": "-", "step_ms": "-", "compile_s": "-"}  # unrolled runs no long-context decode

    def num(x, fmt: str = ".1f") -> str:
        return x if isinstance(x, str) else format(x, fmt)

    rows = [[m["dtype"], m["layers"], f"{m['prefill_tok_s']:.0f}", f"{m['prefill_ms']:.0f}",
             f"{m['decode_short']['tok_s']:.1f}", f"{m['decode_short']['step_ms']:.1f}",
             num(m.get("decode_long", no_long)["tok_s"]), num(m.get("decode_long", no_long)["step_ms"]),
             f"{m['prefill_compile_s']:.1f} / {m['decode_short']['compile_s']:.1f} / "
             f"{num(m.get('decode_long', no_long)['compile_s'])}"] for m in data["modes"]]
    return ["### Prefill and batch-1 decode\n",
            table(["dtype", "layers", f"prefill {p} tok/s", "prefill ms", f"decode ctx~{s} tok/s", "ms/token",
                   f"decode ctx~{p} tok/s", "ms/token", f"compile s (prefill {p} / decode {s} / decode {p})"],
                  rows), ""]


def _roofline_table(data: dict, cfg: ModelConfig) -> list[str]:
    if cfg.tie_word_embeddings:
        embed = (f"The tied [{cfg.vocab_size}, {cfg.hidden_size}] embedding table is counted once: the LM head reads "
                 f"all of it, the embedding gather only one {cfg.hidden_size}-wide row per token (ignored).")
    else:
        embed = (f"The untied [{cfg.vocab_size}, {cfg.hidden_size}] embedding table is counted whole, although the "
                 "gather reads only one row per token.")
    rows = []
    for r in data["decode_rows"]:
        if "error" in r:
            rows.append([r["dtype"], r["layers"], str(r["batch"]), "-", "-", "-", "-", "fails [^err]", "-"])
            continue
        rows.append([r["dtype"], r["layers"], str(r["batch"]), f"{r['context'][0]}-{r['context'][1]}",
                     f"{r['weight_bytes'] / 1e6:.0f}", f"{r['kv_bytes'] / 1e6:.1f}", f"{r['roofline_tok_s']:.0f}",
                     f"{r['tok_s']:.1f}", f"{100 * r['of_roofline']:.0f}%"])
    return [
        "### Decode roofline\n",
        "Bytes one decode step must read = all weight bytes + the KV cache of the real context of every sequence. "
        f"{embed} KV bytes = 2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} x context x "
        "dtype size, for the mean context of the timed steps; the reference attention actually gathers the whole "
        "padded page bucket, but the padding entries all point at the one null page, so that extra traffic stays in "
        "cache and is not counted. Roofline tokens/s = batch x bandwidth / bytes.\n",
        table(["dtype", "layers", "batch", "context", "weight MB", "KV MB", "roofline tok/s", "measured tok/s",
               "% of roofline"], rows), ""]


def _breakdown(data: dict, cfg: ModelConfig) -> list[str]:
    bds = data.get("breakdown")
    if not bds:
        return []
    labels = part_labels(cfg)
    return [f"### Where a batch-1 decode step goes (scan, context ~{data['decode_prompt_len'] + 4})\n",
            "Median ms of each part run on its own, the parts interleaved in rounds so that machine noise hits them "
            "alike. The dense-matmul rows run only the forward's projections, MLP and LM head (same weights, same "
            "2-row shapes), without attention, norms, RoPE or the KV write.\n",
            table(["part"] + [f"{dt} ms" for dt in bds],
                  [[labels[k]] + [f"{bds[dt][k]:.2f}" for dt in bds] for k in PARTS]), ""]


def _kv_layout(data: dict, cfg: ModelConfig) -> list[str]:
    def cell(k: dict, name: str) -> str:
        return f"{k[name + '_ms']:.3f}" if name + "_ms" in k else "fails [^err]"

    rows = [[k["dtype"], f"{k['kv_bytes'] / 1e6:.1f}", cell(k, "ours"), cell(k, "alt"),
             f"{k['ours_ms'] / k['alt_ms']:.2f}" if "ours_ms" in k and "alt_ms" in k else "-",
             f"{k['max_abs_diff']:.1e}" if "max_abs_diff" in k else "-"] for k in data["kv_layout"]]
    return ["### KV layout\n",
            f"One layer's decode attention, batch {data['kv_batch']}, {cfg.num_heads} query / {cfg.num_kv_heads} KV "
            f"heads, head dim {cfg.head_dim}, page {data['page_size']}, context {data['kv_context']} per sequence "
            "(pages handed out in shuffled order), masks and softmax included: `paged_attention_reference` on our "
            "layout [P, K, page_size, H] against the same math written for [P, page_size, K, H] "
            f"(`jaxinfer.benchmarks.kv_layout`). Median of {kv_layout.ROUNDS * data['kv_reps']} calls each, "
            "interleaved in rounds.\n",
            table(["dtype", "KV read MB", "ours [P, K, ps, H] ms", "alternative [P, ps, K, H] ms",
                   "ours / alternative", "max abs diff"], rows), ""]


def render(data: dict, cfg: ModelConfig, command: str, date: str) -> str:
    """The section's markdown (without its markers) for the step workload's report data."""
    out = (_intro(data, cfg, command, date) + _bandwidth(data) + _speeds(data) + _roofline_table(data, cfg)
           + _breakdown(data, cfg) + _kv_layout(data, cfg) + step_peers_report.section(data, cfg))
    notes = observations(data)
    if notes:
        out += ["### Observations\n", "\n".join(f"- {n}" for n in notes) + "\n"]
    errors = sorted({r["error"] for r in data["decode_rows"] if "error" in r}
                    | {k[f"{n}_error"] for k in data["kv_layout"] for n in ("ours", "alt") if f"{n}_error" in k})
    if errors:
        out.append("[^err]: failed with " + "; ".join(f"`{e}`" for e in errors) + ".\n")
    return "\n".join(out)
