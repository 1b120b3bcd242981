"""The step workload's peer comparison (its "Peers" subsection and the peer findings): jaxinfer beside HF
transformers and llama.cpp, measured in the same run on the same prompt ids, each beside the decode roofline."""

from __future__ import annotations

from jaxinfer.benchmarks import model_setup
from jaxinfer.benchmarks.report import table
from models.config import ModelConfig

# The llama.cpp weight type each jaxinfer format is compared with: the first of these the run measured.
LLAMACPP_MATCH = {"float32": ("F32", "BF16"), "bfloat16": ("BF16", "F32"), "int8": ("Q8_0", "Q4_0", "Q4_1")}


def _ours(data: dict) -> dict[str, dict]:
    """Each jaxinfer format's numbers (scan mode): {format: {"mode": bench_mode result, "batches": {b: decode},
    "roofline": {(batch, context): roofline row}}}."""
    q = data.get("int8")
    out = {}
    for fmt in data["dtypes"] + (["int8"] if q else []):
        mode = q["mode"] if fmt == "int8" else next((m for m in data["modes"] if m["dtype"] == fmt
                                                     and m["layers"] == "scan"), None)
        if mode is None:
            continue
        decodes = q["batch_decodes"] if fmt == "int8" else [r for r in data["batch_decodes"] if r["dtype"] == fmt]
        rows = q.get("decode_rows", []) if fmt == "int8" else data["decode_rows"]
        out[fmt] = {"mode": mode, "batches": {r["batch"]: r for r in decodes},
                    "roofline": {(r["batch"], tuple(r["context"])): r for r in rows
                                 if r["dtype"] == fmt and r["layers"] == "scan" and "error" not in r}}
    return out


def _peer_results(peer: dict | None) -> dict:
    return peer["results"] if peer and "results" in peer else {}


def _cells(ours: float | None, peer: float | None) -> list[str]:
    """A peer's tok/s and our ratio to it ("-" where either is missing)."""
    if peer is None:
        return ["-", "-"]
    return [f"{peer:.1f}", f"{ours / peer:.2f}" if ours is not None else "-"]


def _comparison_rows(data: dict, fmt: str, o: dict, hf: dict | None, ll: dict | None) -> list[list[str]]:
    """The rows of one format's table: prefill, then decode at batch 1 and each batch size."""
    p = data["prefill_len"]
    pre = o["mode"]["prefill_tok_s"]
    rows = [[fmt, f"prefill {p} tok/s", f"{pre:.0f}", *_cells(pre, hf and hf["prefill_tok_s"]),
             *_cells(pre, ll and ll["prefill_tok_s"]), "-", "-"]]
    by_batch = {1: o["mode"]["decode_short"], **o["batches"]}
    for b, d in sorted(by_batch.items()):
        name = f"decode b{b} ctx~{data['decode_prompt_len']} tok/s"
        if "error" in d:
            rows.append([fmt, name, "fails [^err]", "-", "-", "-", "-", "-", "-"])
            continue
        peer_b = {}
        for key, res in (("hf", hf), ("ll", ll)):
            if res is not None:
                peer_b[key] = res["decode_tok_s"] if b == 1 else next(
                    (x["tok_s"] for x in res.get("batch_decodes", []) if x["batch"] == b), None)
        roof = o["roofline"].get((b, tuple(d["context"])))
        rows.append([fmt, name, f"{d['tok_s']:.1f}", *_cells(d["tok_s"], peer_b.get("hf")),
                     *_cells(d["tok_s"], peer_b.get("ll")), f"{roof['roofline_tok_s']:.0f}" if roof else "-",
                     f"{100 * roof['of_roofline']:.0f}%" if roof else "-"])
    return rows


def _comparison(data: dict) -> list[str]:
    """One table per jaxinfer format: jaxinfer beside HF transformers (same dtype) and llama.cpp (the matching
    type), with the ratios and the roofline of jaxinfer's bytes."""
    hf_res, ll_res = _peer_results(data.get("peer")), _peer_results(data.get("llamacpp"))
    out = []
    for fmt, o in _ours(data).items():
        ll_type = next((t for t in LLAMACPP_MATCH[fmt] if t in ll_res), None)
        hf_name = "HF transformers" + ("" if fmt in hf_res else " (-)")
        ll_name = f"llama.cpp {ll_type}" if ll_type else "llama.cpp (-)"
        title = data["int8"]["format"] if fmt == "int8" else fmt
        out += [f"#### jaxinfer {title}\n",
                table(["format", "metric", "jaxinfer", hf_name, "ours / HF", ll_name, "ours / llama.cpp",
                       "roofline tok/s", "jaxinfer % of roofline"],
                      _comparison_rows(data, fmt, o, hf_res.get(fmt), ll_res.get(ll_type))), ""]
    return out


def _llamacpp_types(data: dict, cfg: ModelConfig) -> list[str]:
    """Every llama.cpp type measured, each decode beside the roofline of its own bytes (tensors + f16 KV)."""
    res = _peer_results(data.get("llamacpp"))
    if not res:
        return []
    kv_per_token = model_setup.kv_bytes_per_token(cfg, 2)  # f16 cache
    batches = [1] + data.get("batches", [])
    rows = []
    for t, r in res.items():
        decodes = {1: {"tok_s": r["decode_tok_s"], "context": r["decode_context"]},
                   **{d["batch"]: d for d in r.get("batch_decodes", [])}}
        cells = []
        for b in batches:
            d = decodes.get(b)
            if d is None:
                cells.append("-")
                continue
            roof = b * data["roofline_gb_s"] * 1e9 / (r["model_bytes"] + b * kv_per_token * sum(d["context"]) / 2)
            cells.append(f"{d['tok_s']:.1f} ({100 * d['tok_s'] / roof:.0f}%)")
        rows.append([t, r["desc"], f"{r['model_bytes'] / 1e6:.0f}", f"{r['prefill_tok_s']:.0f}", *cells])
    return ["#### llama.cpp by weight type\n",
            "Decode tok/s, in brackets the share of the roofline of llama.cpp's own bytes per step (its tensors + "
            "an f16 KV cache of the real context), at the same probe bandwidth.\n",
            table(["type", "llama.cpp model", "tensor MB", f"prefill {data['prefill_len']} tok/s",
                   *[f"decode b{b} tok/s" for b in batches]], rows), ""]


def peer_lines(data: dict) -> list[str]:
    """What each peer is, or why it did not run (also `jaxinfer bench quant`'s peer prose).

    Args:
      data: a report's data with "peer" (the HF peer's JSON) and "llamacpp" (the llama.cpp peer's JSON), each None
        when not run, or {"error": why}.

    Returns:
      [the HF line, the llama.cpp line].
    """
    peer, ll = data.get("peer"), data.get("llamacpp")
    if peer is None:
        hf = "HF transformers peer skipped (`--peer-python` not given)."
    elif "error" in peer:
        hf = f"HF transformers peer not run: {peer['error']}."
    else:
        hf = (f"HF transformers {peer['transformers']} on torch {peer['torch']} (CPU, {peer['threads']} threads, "
              "eager mode), `scripts/peer_transformers.py`: the model file dequantized by transformers to dense "
              "`nn.Linear` weights of the dtype; prefill with `logits_to_keep=1`, decode with a `DynamicCache`, "
              "each step = forward + argmax of every row.")
    if ll is None:
        lc = "llama.cpp peer skipped (`--llamacpp-python` not given)."
    elif "error" in ll:
        lc = f"llama.cpp peer not run: {ll['error']}."
    else:
        lc = (f"llama.cpp through llama-cpp-python {ll['llama_cpp']} ({ll['threads']} threads, flash attention "
              f"{'on' if ll['flash_attn'] else 'off'}, {ll['kv_type']} KV cache of {ll['n_ctx']} cells shared by "
              f"the sequences{_extra_bufts(ll)}), `scripts/peer_llamacpp.py`: the GGUF re-quantized with "
              "`llama_model_quantize` to "
              "each type (its own type used as is); batch decode through `llama_batch_init` with one sequence id "
              "per row and `llama_decode`, each row's next token the argmax of its logits.")
    return [hf, lc]


def _extra_bufts(ll: dict) -> str:
    """How the llama.cpp peer loaded its weights, for the prose ("" for the default, or older JSON)."""
    if ll.get("extra_bufts", True):
        return ""
    return (", ggml's extra CPU buffer types (AMX, repacked layouts) off: the first run with them died from a "
            "signal (SIGSEGV in its first Q4_0 prefill on this CPU)")


def section(data: dict, cfg: ModelConfig) -> list[str]:
    """The "Peers" subsection: what each peer ran, one comparison table per jaxinfer format, llama.cpp by type."""
    out = ["### Peers\n",
           "Both peers run in their own venvs during the same run, on the same model file and the same prompt ids "
           "(the prefill prompt; batch b decodes the first b of the same batch prompts), timing whole steps, "
           "medians as above. jaxinfer numbers are scan mode (the engine's default) from the tables above; the "
           "roofline is that of jaxinfer's bytes (decode roofline table).\n",
           "\n".join(f"- {line}" for line in peer_lines(data)) + "\n"]
    return out + _comparison(data) + _llamacpp_types(data, cfg)


def observations(data: dict) -> list[str]:
    """The peer findings: jaxinfer's ratio to each peer at prefill, batch-1 and the largest batch decode."""
    ours, notes = _ours(data), []
    for name, res, match in (("HF transformers (eager, torch CPU)", _peer_results(data.get("peer")), None),
                             ("llama.cpp", _peer_results(data.get("llamacpp")), LLAMACPP_MATCH)):
        parts = []
        for fmt, o in ours.items():
            key = fmt if match is None else next((t for t in match[fmt] if t in res), None)
            p = res.get(key)
            if p is None:
                continue
            part = (f"{fmt}{'' if match is None else f' vs {key}'}: prefill "
                    f"{o['mode']['prefill_tok_s'] / p['prefill_tok_s']:.2f}x, decode batch 1 "
                    f"{o['mode']['decode_short']['tok_s'] / p['decode_tok_s']:.2f}x")
            peer_b = {x["batch"]: x["tok_s"] for x in p.get("batch_decodes", [])}
            common = [b for b in sorted(o["batches"]) if b in peer_b and "error" not in o["batches"][b]]
            if common:
                b = common[-1]
                part += f", batch {b} {o['batches'][b]['tok_s'] / peer_b[b]:.2f}x"
            parts.append(part)
        if parts:
            notes.append(f"**Peer {name}.** jaxinfer (scan) relative to it: " + "; ".join(parts) + ".")
    return notes
