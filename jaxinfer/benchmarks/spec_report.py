"""The BENCHMARKS.md section of `jaxinfer bench spec`, and what it derives from the step costs: the break-even
acceptance of a verify step and the `max_step_tokens` the data suggests."""

from __future__ import annotations


from jaxinfer.benchmarks.report import machine_line, table, vs_range
from jaxinfer.benchmarks.spec_measure import STEP_CONTEXT, STEP_ROWS, derived, median

MAX_K = 16  # SpeculativeConfig's upper bound on num_speculative_tokens
FREE_RATIO = 1.5  # a verify step costing at most this many decode steps of its batch counts as "drafts ~free"


def break_even_acceptance(cost_ratio: float, k: int) -> float | None:
    """The per-draft acceptance a at which a verify step of k drafts, costing `cost_ratio` decode steps, pays for
    itself: expected tokens per step (1 - a^(k+1)) / (1 - a) (drafts accepted independently with probability a,
    up to the first rejection, plus the target's own token) equal to cost_ratio. None: not even a = 1 pays."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < cost_ratio:
            lo = mid
        else:
            hi = mid
    return hi



def suggest_max_step_tokens(steps: list[dict]) -> int:
    """The largest row count T (of STEP_ROWS) such that every measured verify step of at most T rows costs at most
    FREE_RATIO x the decode step of the same batch: the policy's max_step_tokens that keeps drafts nearly free.
    Shapes the policy never makes (k > 16, the most `num_speculative_tokens` allows) do not count."""
    best = 0
    for rows in STEP_ROWS:
        if all(s["vs_decode"] <= FREE_RATIO for s in steps
               if s["kind"] == "verify" and s["rows"] <= rows and s["k"] <= MAX_K):
            best = rows
        else:
            break
    return best


def render(r: dict, command: str, date: str, elapsed_s: float, load: tuple[float, float]) -> str:
    """The section (the runner adds its markers), from what `spec.run` measured (`r`, with its `settings`)."""
    st = r["settings"]
    out = [f"## Speculative decoding ({r['model']['name']}, float32, greedy)\n"]
    out.append(f"One process, {len(st['configs'])} engines that differ only in `speculative_config`, `warmup=False`, "
               f"`max_model_len` {st['max_model_len']}, {r['kv_pages']} KV pages of 16 tokens, prefix cache reset "
               "before "
               "every run. Every measured shape runs untimed first (with a fresh, empty persistent compilation "
               f"cache shared by the engines), so no compile is timed. Backend {r['backend']}: the policy's "
               f"`max_step_tokens` is {r['max_step_tokens']} "
               f"(`DEFAULT_MAX_STEP_TOKENS` = {r['default_max_step_tokens']}). Method, prompts and the expectations "
               "written before the first run: `jaxinfer/benchmarks/spec.py`. Command:\n")
    out.append(f"```\n{command}\n```\n")
    loads = r.get("loads") or [load[1]]
    out.append(f"- date: {date}; {machine_line()}; run time {elapsed_s:.0f} s (batch-1 "
               f"{r['single_s']:.0f} s, {st['requests']} requests {r['tput_s']:.0f} s, step costs "
               f"{r['steps_s']:.0f} s); 1-minute "
               f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, {min(loads):.1f}-{max(loads):.1f} "
               "after the timed runs (this process alone keeps it near 2 on the 2 cores; well above 2, other jobs "
               "competed); a shared, noisy VM\n")
    out.append("Expected (written before measuring SmolLM2-135M-Instruct): copy-heavy ngram k=2 1.8-2.4x, k=4 "
               "2.2-3.2x, k=8 2.3-3.5x "
               "(acceptance 0.7-0.9, a verify step of <= 9 rows ~1.1-1.3x a decode step); chat ngram 0.85-1.05x "
               "(acceptance 0.1-0.3, drafts mostly switched off); self_draft 28/30 layers k=2 0.5-0.8x (two draft "
               "forwards of 93% of the model per step); 32 concurrent requests on/off 0.95-1.05x (the policy turns "
               "drafts off above 16 decoding sequences with max_step_tokens 32; after the step-cost table below "
               "moved the CPU default to 8, above 4); step cost flat to ~16 rows, 1.3-1.6x at 32, roughly "
               "proportional beyond (knee ~32 rows).\n")

    single = r["single"]
    out.append(f"### Batch-1 decode tokens/s (median of {r['reps']} runs, min-max)\n")
    out.append(f"Copy-heavy: {r['prompt_lens']['copy-heavy']}-token chat prompt, a 159-word paragraph to repeat "
               f"with \"lighthouse\" changed to \"tower\" (`max_tokens` {st['copy_max_tokens']}); chat: "
               f"{r['prompt_lens']['chat']}-token prompt, \"{st['chat_question']}\" (`max_tokens` "
               f"{st['chat_max_tokens']}). "
               "Decode tok/s = (output tokens - 1) / (finish - first token). Acceptance = accepted / drafted; "
               "mean accepted length = tokens per verifying sequence-step (accepted + 1); tokens per step = over all "
               "decode steps, drafting or not (stats deltas over the timed runs); time per decode step vs off = "
               "tokens per step / speed-up: what a step with drafting (proposing + the wider verify step) costs; "
               "same round = each run against the off run of its round (runs a minute apart or less), which cancels "
               "slow drifts of the machine's load.\n")
    rows = []
    for task, cells in single.items():
        base = median(cells["off"]["tok_s"])
        for name, c in cells.items():
            med = median(c["tok_s"])
            d = derived(c["spec"]) if c["spec"] else None
            per_step = d["per_step"] if d else 1.0
            paired = [x / y for x, y in zip(c["tok_s"], cells["off"]["tok_s"])]
            rows.append([task, name, f"{med:.1f}", f"{min(c['tok_s']):.1f}-{max(c['tok_s']):.1f}",
                         f"**{med / base:.2f}x**" if name != "off" else "1.00x",
                         f"{median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})" if name != "off" else "-",
                         f"{d['acceptance']:.2f}" if d else "-", f"{d['mean_len']:.2f}" if d else "-",
                         f"{per_step:.2f}", f"{per_step / (med / base):.2f}",
                         str(len(c["tokens"])), "yes" if c["same_as_off"] else "**NO**"])
    out.append(table(["task", "speculation", "decode tok/s", "min-max", "vs off (medians)",
                       "vs off, same round (median, min-max)", "acceptance",
                       "mean accepted length", "tokens per decode step", "time per decode step vs off",
                       "output tokens",
                       "tokens identical to off (every run)"], rows) + "\n")
    copy_best = max((n for n in single["copy-heavy"] if n.startswith("ngram")),
                    key=lambda n: median(single["copy-heavy"][n]["tok_s"]))
    copy_speedup = median(single["copy-heavy"][copy_best]["tok_s"]) / median(single["copy-heavy"]["off"]["tok_s"])
    out.append(f"- at batch 1 the policy lets a sequence draft min(k, max_step_tokens - 1) = "
               f"min(k, {r['max_step_tokens'] - 1}) tokens per step (a verify step of at most max_step_tokens rows), "
               "so a config's k above that runs as that.\n")
    out.append(f"- goal >= 1.8x on the copy-heavy task: best ngram ({copy_best}) **{copy_speedup:.2f}x**, goal "
               f"**{'met' if copy_speedup >= 1.8 else 'not met'}**.\n")
    lines = []
    draft = st["self_draft"]
    for task, ranges in (("copy-heavy", {"ngram k=2": (1.8, 2.4), "ngram k=4": (2.2, 3.2), "ngram k=8": (2.3, 3.5),
                                         draft: (0.5, 0.8)}),
                         ("chat", {"ngram k=2": (0.85, 1.05), "ngram k=4": (0.85, 1.05), "ngram k=8": (0.85, 1.05),
                                   draft: (0.5, 0.8)})):
        base = median(single[task]["off"]["tok_s"])
        parts = []
        for name, (lo, hi) in ranges.items():
            if name not in single[task]:  # a config left out (--ngram-ks, --no-self-draft)
                continue
            x = median(single[task][name]["tok_s"]) / base
            parts.append(f"{name} {lo}-{hi}x, measured {x:.2f}x ({vs_range(x, lo, hi)})")
        lines.append(f"{task}: " + "; ".join(parts))
    out.append("- against the expectations: " + ". ".join(lines) + "\n")
    text = r["single_text"]["copy-heavy"]
    out.append(f"- the copy-heavy reply (same for every config) starts \"{text[:90]}...\" and is "
               f"{len(text.split())} words long; the chat reply is {len(r['single_text']['chat'].split())} words.\n")

    tp = r["tput"]
    out.append(f"### Throughput: {st['requests']} concurrent requests, max_tokens {st['tput_max_tokens']}\n")
    pl = tp["prompt_tokens"]
    out.append(f"{st['requests'] // 2} copy-heavy prompts ({min(pl[0::2])}-{max(pl[0::2])} tokens, distinct GPL-3 "
               f"paragraphs, one word changed) and {st['requests'] // 2} chat questions "
               f"({min(pl[1::2])}-{max(pl[1::2])} tokens), alternating, all added at "
               "t=0; default `max_num_seqs` 32, `max_num_batched_tokens` 512. On: `{\"method\": \"ngram\"}` (k=4, "
               f"automatic policy, `max_step_tokens` {r['max_step_tokens']}). {tp['reps']} timed runs each after one "
               "untimed, on/off interleaved (ABBA). Output tok/s = output tokens / wall time from the first "
               "`add_request` to the last finish.\n")
    rows, meds = [], {}
    for name in ("on", "off"):
        runs = tp["runs"][name]
        rates = [b.output_tokens / b.wall_s for b in runs]
        meds[name] = median(rates)
        spec = {}
        for b in runs:
            for k, v in b.spec.items():
                spec[k] = spec.get(k, 0) + v
        if name == "on":
            d = derived(spec)
            n = len(runs)
            spec_txt = (f"{spec['spec_verify_steps'] / n:.0f} verify steps / {spec['spec_off_steps'] / n:.0f} steps "
                        f"off by batch size per run; acceptance {d['acceptance']:.2f}, tokens per decode step "
                        f"{d['per_step']:.2f}")
        else:
            spec_txt = "-"
        rows.append([name, f"{meds[name]:.1f}", f"{min(rates):.1f}-{max(rates):.1f}",
                     f"{median([b.wall_s for b in runs]):.1f}", str(runs[0].output_tokens), spec_txt])
    out.append(table(["speculation", "output tok/s (median)", "min-max", "wall s (median)", "output tokens",
                       "policy (spec_* stats, per run)"], rows) + "\n")
    ratio = meds["on"] / meds["off"]
    pairs = [a.output_tokens / a.wall_s / (b.output_tokens / b.wall_s)
             for a, b in zip(tp["runs"]["on"], tp["runs"]["off"])]
    on_rates = [b.output_tokens / b.wall_s for b in tp["runs"]["on"]]
    off_rates = [b.output_tokens / b.wall_s for b in tp["runs"]["off"]]
    overlap = min(on_rates) <= max(off_rates) and min(off_rates) <= max(on_rates)
    out.append(f"- on / off = **{ratio:.2f}x** from the medians (the on and off min-max ranges "
               f"{'overlap' if overlap else 'do not overlap'}); from each run against the adjacent run of the other "
               f"setting (ABBA pairs): median **{median(pairs):.2f}x**, min-max {min(pairs):.2f}-{max(pairs):.2f}; "
               "tokens identical on and off "
               f"in every run: {'yes' if tp['same'] else '**NO**'}; expected 0.95-1.05x "
               f"({vs_range(ratio, 0.95, 1.05)})\n")

    steps = r["steps"]
    suggestion = suggest_max_step_tokens(steps)
    base = next(s["ms"] for s in steps if s["kind"] == "decode" and s["batch"] == 1)
    out.append("### Cost of a step vs token rows (policy calibration)\n")
    out.append(f"`ModelRunner.execute` (decode, q_len 1) and `execute_verify` (B sequences x (k + 1) tokens) on the "
               f"\"off\" engine's runner; every sequence at context {STEP_CONTEXT} on its own pages (page-table "
               f"bucket 32 pages = 512 tokens for all shapes), greedy rows. Rows = token rows the step computes "
               f"(a decode step pads to a power of two, at least 2). Median of {r['step_reps']} calls after an "
               f"untimed one. \"vs batch-1 decode\" = / the 2-row step ({base:.1f} ms); \"vs decode of batch B\" = / "
               "the plain decode step of the same batch: what the drafts add; break-even acceptance = the per-draft "
               "acceptance a at which (1 - a^(k+1)) / (1 - a) tokens per step equal that cost ratio.\n")
    rows = []
    for s in sorted(steps, key=lambda s: (s["rows"], s["batch"], s["kind"] != "decode")):
        label = (f"decode, batch {s['batch']}" if s["kind"] == "decode"
                 else f"verify, batch {s['batch']} x (k={s['k']} + 1)")
        if s["kind"] == "verify":
            a = break_even_acceptance(s["vs_decode"], s["k"])
            be = "never" if a is None else f"{a:.2f}"
        else:
            be = "-"
        rows.append([str(s["rows"]), label, f"{s['ms']:.1f}", f"{s['min_ms']:.1f}-{s['max_ms']:.1f}",
                     f"{s['ms'] / base:.2f}x", f"{s['vs_decode']:.2f}x" if s["kind"] == "verify" else "-", be])
    out.append(table(["rows", "step", "ms (median)", "min-max", "vs batch-1 decode", "vs decode of batch B",
                       "break-even acceptance"], rows) + "\n")
    cpu = r["default_max_step_tokens"].get("cpu")
    out.append(f"- every measured verify step of up to **{suggestion} rows** costs at most {FREE_RATIO}x the decode "
               f"step of its batch (not counting batch 1 with k = 31, which no config can ask for); "
               f"`DEFAULT_MAX_STEP_TOKENS['cpu']` is {cpu}: "
               + ("the data supports it." if suggestion == cpu else f"the data suggests {suggestion}.") + "\n")
    return "\n".join(out)
