"""The BENCHMARKS.md section of `jaxinfer bench prefix`."""

from __future__ import annotations

import statistics

import jax

from jaxinfer.benchmarks.prefix_measure import PS, QUESTION_TOKENS, median
from jaxinfer.benchmarks.report import machine_line, table, vs_range


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.01 else f"{s * 1e3:.1f}"


def render(r: dict, command: str, date: str, elapsed_s: float, load: tuple[float, float]) -> str:
    """The section (the runner adds its markers), from what `prefix.run` measured (`r`)."""
    out = [f"## Prefix caching ({r['model']['name']}, float32)\n"]
    out.append(f"Two engines in one process (prefix caching on, with a {r['host_pages']}-page host tier; and off), "
               f"same shapes; a page of K and V is 2 x {r['model']['num_layers']} layers x "
               f"{r['model']['num_kv_heads']} KV heads x {PS} tokens x {r['model']['head_dim']} x 4 bytes = "
               f"{r['page_bytes'] / 1024:.0f} KiB; "
               f"{r['kv_pages']} KV pages of {PS} tokens each, default `max_num_batched_tokens` 512. Untimed runs of "
               "every measured request shape come first (the persistent compilation cache is off), so no compile is "
               "timed. TTFT is the request's own: from `add_request` to its first token. See "
               "`jaxinfer/benchmarks/prefix.py` for the method and the expectations written before the run (for "
               "SmolLM2-135M-Instruct). Command:\n")
    out.append(f"```\n{command}\n```\n")
    out.append(f"- date: {date}; backend {jax.default_backend()}; {machine_line()}; run time "
               f"{elapsed_s:.0f} s; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
               "(2 cores: above 2, other jobs competed); a shared, noisy VM\n")

    t = r["ttft"]
    cold, warm = median(t["cold"]), median(t["warm"])
    ratio = warm / cold
    out.append(f"### TTFT: {t['prefix_tokens']}-token shared prefix + {QUESTION_TOKENS}-token question\n")
    out.append(table(["", "median TTFT ms", "min ms", "max ms", "median wall of generate ms", "cached tokens"], [
        ["cold (cache reset)", _ms(cold), _ms(min(t["cold"])), _ms(max(t["cold"])), _ms(median(t["cold_wall"])),
         "0"],
        ["warm (prefix cached, another question)", _ms(warm), _ms(min(t["warm"])), _ms(max(t["warm"])),
         _ms(median(t["warm_wall"])), str(t["cached"])],
    ]) + "\n")
    out.append(f"- warm / cold = **{ratio:.1%}** (medians of {t['reps']} interleaved pairs, after one untimed pair); "
               f"the goal, warm <= 15% of cold, is **{'met' if ratio <= 0.15 else 'not met'}**. "
               f"Warm computes {t['prompt_tokens'] - t['cached']} of {t['prompt_tokens']} tokens; cold prefills at "
               f"{t['prompt_tokens'] / cold:.0f} tokens/s.\n")
    out.append(f"- against the expectations written before the first run (docstring): cold 0.8-1.2 s, measured "
               f"{cold:.2f} s ({vs_range(cold, 0.8, 1.2)}); warm 50-100 ms, measured {_ms(warm)} ms "
               f"({vs_range(warm, 0.05, 0.1)}); "
               f"ratio 5-10%, measured {ratio:.1%} ({vs_range(ratio, 0.05, 0.10)})\n")

    c = r["chat"]
    out.append(f"### Multi-turn chat: {c['convs']} conversations x {c['turns']} turns, greedy, max_tokens "
               f"{c['max_tokens']}\n")
    out.append(f"One shared system message, ChatML; first prompt {c['first_prompt_tokens']} tokens, each later turn "
               "= previous prompt + reply + a new user message; a conversation's next turn is sent when its reply "
               f"finishes. {c['passes']} timed passes per engine, alternating, after an untimed one each.\n")
    rows = []
    agg = {}
    for name in ("on", "off"):
        runs = c["runs"][name]
        wall = median([x.wall_s for x in runs])
        pt, ot = runs[0].prompt_tokens, runs[0].output_tokens
        ttft = median([statistics.fmean(x.ttft_s) for x in runs])
        p50 = median([median(x.ttft_s) for x in runs])
        agg[name] = (wall, ttft)
        rows.append([f"caching {name}", f"{wall:.1f}", " / ".join(f"{x.wall_s:.1f}" for x in runs), str(pt), str(ot),
                     f"{(pt + ot) / wall:.0f}", f"{ot / wall:.1f}", _ms(ttft), _ms(p50),
                     f"{runs[0].hit_rate:.1%}" if name == "on" else "-", str(runs[0].cached_tokens)])
    out.append(table(["", "wall s (median)", "each pass s", "prompt tokens", "output tokens",
                       "(prompt+output) tok/s", "output tok/s", "mean TTFT ms", "median TTFT ms", "hit rate (stats)",
                       "cached tokens"], rows) + "\n")
    (w_on, t_on), (w_off, t_off) = agg["on"], agg["off"]
    out.append(f"- caching on: throughput **{w_off / w_on:.2f}x** (the same tokens in less wall time, so prompt+output "
               f"and output-only rates move together), mean TTFT **{t_off / t_on:.1f}x** lower; replies "
               f"token-identical on and off: {'yes' if c['same_tokens'] else 'NO'}\n")
    hit = c["runs"]["on"][0].hit_rate
    out.append(f"- against the expectations written before the first run (docstring): hit rate 75-85%, measured "
               f"{hit:.1%} ({vs_range(hit, 0.75, 0.85)}); throughput 1.5-2x, measured {w_off / w_on:.2f}x "
               f"({vs_range(w_off / w_on, 1.5, 2.0)}); mean TTFT 3-5x lower, measured {t_off / t_on:.1f}x "
               f"({vs_range(t_off / t_on, 3, 5)})\n")

    out.append("### Host tier: load k pages back vs recompute them\n")
    out.append(f"A k-page prefix + a {QUESTION_TOKENS}-token question: TTFT with the prefix recomputed (cache reset), "
               "loaded from the host tier (the step runs the LOAD, then the question), or on the device. Then the raw "
               "calls: `runner.kv.load_pages` of k real host pages (host numpy -> device scatter) vs a standalone prefill "
               f"step of k x {PS} tokens (`runner.execute`). Medians of {r['break_even'][0]['reps']}.\n")
    rows = []
    for x in r["break_even"]:
        rows.append([str(x["pages"]), str(x["pages"] * PS), _ms(x["recompute"]), _ms(x["host"]), _ms(x["device"]),
                     _ms(x["host"] - x["device"]), _ms(x["recompute"] - x["device"]), _ms(x["load_call"]),
                     _ms(x["prefill_call"])])
    out.append(table(["k pages", "tokens", "TTFT recompute ms", "TTFT host ms", "TTFT device ms",
                       "load cost (host - device) ms", "recompute cost (recompute - device) ms",
                       "load_pages call ms", f"prefill step of k x {PS} tokens ms"], rows) + "\n")
    wins = [x["pages"] for x in r["break_even"] if x["host"] < x["recompute"]]
    smallest = min(wins) if wins else None
    if smallest is not None and all(x["host"] < x["recompute"] for x in r["break_even"] if x["pages"] >= smallest):
        verdict = (f"loading beats recomputing from k = {smallest} on (and at every larger k measured)")
    else:
        verdict = "loading does not beat recomputing consistently at these k"
    supported = smallest == r["min_pages_default"] == 1
    out.append(f"- {verdict}. `DEFAULT_OFFLOAD_MIN_PAGES['cpu']` is {r['min_pages_default']}: "
               + ("the data supports it." if supported else
                  f"the data suggests {smallest if smallest is not None else 'a larger value (or no host tier)'}.")
               + "\n")
    return "\n".join(out)
