"""llama.cpp peer for `jaxinfer bench step`: llama-cpp-python's low-level API on the same GGUF file and prompt ids.

Runs in its own venv (llama-cpp-python built from source, e.g. /work/venv-llamacpp); it imports nothing from
jaxinfer and speaks the protocol of `jaxinfer.benchmarks.peers` (one JSON object as the last stdout line, "[peer]"
progress lines on stderr). For each weight type of `--types`:

* the model file: `--gguf` itself when it already has that type (`llama_model_ftype`), else `--gguf` re-quantized
  with `llama_model_quantize` (requantizing allowed), cached in `--cache-dir` under a name keyed by the source
  file's path, size and mtime, so a second run loads it without redoing it;
* prefill: the whole `--prompt-file` prompt in one `llama_decode` (logits of the last token only) into an empty KV
  cache, then the greedy argmax; one untimed warm-up, median over `--prefill-reps`;
* decode at batch 1 and at each `--batches` size: every sequence prefilled (untimed) from its own
  `--decode-prompt-len`-token prompt (batch 1: the first tokens of the prefill prompt; batch b: the first b rows of
  `--batch-prompts`), then steps of one token per sequence through `llama_batch_init` (one seq id per row) and
  `llama_decode`, each row's next token the argmax of its logits (`llama_get_logits_ith`). Whole steps are
  timed; median over `--decode-steps` (`--batch-steps` at batch > 1) after `--warmup-steps`; aggregate tok/s =
  batch / step time.

Settings: `--threads` for generation and batch processing, ggml's extra CPU buffer types (AMX, repacked weight
layouts) on unless `--no-extra-bufts` (llama-cpp-python 0.3.36 built natively died with SIGSEGV in its first Q4_0 /
Q4_1 prefill with them on an Intel Xeon with AMX; `jaxinfer bench step` then reruns with this flag), flash attention
off (llama.cpp's flash attention is not batch-invariant at batch 32 on CPU), an f16 KV cache (the default) unified
across sequences, sized for the longest run.

    /work/venv-llamacpp/bin/python scripts/peer_llamacpp.py --gguf MODEL.gguf --prompt-file ids.json \
        --batch-prompts rows.json --batches 8,32 --types Q4_0,BF16,Q4_1
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("peer_llamacpp")

# Weight types by the name reports use -> the llama_cpp constant of its file type.
FTYPES = {"F32": "LLAMA_FTYPE_ALL_F32", "BF16": "LLAMA_FTYPE_MOSTLY_BF16", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}
DEFAULT_CACHE = Path.home() / ".cache" / "jaxinfer" / "peers"


def parse_types(text: str) -> list[str]:
    """"Q4_0,BF16" -> ["Q4_0", "BF16"].

    Raises:
      ValueError: an empty list, or a name not in `FTYPES` (named).
    """
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--types is empty: give some of {', '.join(FTYPES)}")
    unknown = [t for t in names if t not in FTYPES]
    if unknown:
        raise ValueError(f"--types: unknown {', '.join(unknown)} (known: {', '.join(FTYPES)})")
    return names


def cache_path(source: Path, type_name: str, cache_dir: Path) -> Path:
    """Where `source` re-quantized to `type_name` is cached: the source's name, its type and a key of the source's
    resolved path, size and mtime (a changed or different file of the same name gets a new entry)."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / f"{source.stem}.{key}.{type_name}.gguf"


def context_tokens(prefill_len: int, decode_prompt_len: int, decode_tokens: int, batches: list[int]) -> int:
    """KV cache cells for every run: the prefill prompt, or the largest batch's sequences of
    `decode_prompt_len + decode_tokens` tokens each (all sequences share one unified cache), rounded up to 256."""
    need = max([prefill_len + 1] + [b * (decode_prompt_len + decode_tokens + 1) for b in [1, *batches]])
    return -(-need // 256) * 256


def prefill_calls(prompts: list[list[int]], n_batch: int) -> list[list[tuple[int, int, int, bool]]]:
    """The `llama_decode` calls that prefill `prompts` (sequence i = prompt i, from position 0): lists of
    (token, position, seq id, wants logits) entries, at most `n_batch` per call, whole prompts packed together
    while they fit; only each prompt's last token wants logits.

    Raises:
      ValueError: a prompt is empty or longer than `n_batch`.
    """
    calls: list[list[tuple[int, int, int, bool]]] = [[]]
    for seq, prompt in enumerate(prompts):
        if not 0 < len(prompt) <= n_batch:
            raise ValueError(f"prompt {seq} has {len(prompt)} tokens; a prefill call takes 1 to {n_batch}")
        if len(calls[-1]) + len(prompt) > n_batch:
            calls.append([])
        calls[-1] += [(tok, pos, seq, pos == len(prompt) - 1) for pos, tok in enumerate(prompt)]
    return calls


def step_entries(tokens: list[int], positions: list[int]) -> list[tuple[int, int, int, bool]]:
    """One decode step's entries: token i of sequence i at position i, every row wanting logits."""
    return [(tok, pos, seq, True) for seq, (tok, pos) in enumerate(zip(tokens, positions))]


def median_ms(seconds: list[float]) -> float:
    """Median of wall-time samples, in ms."""
    return 1e3 * statistics.median(seconds)


class Session:
    """One loaded model and context with a batch buffer, and the calls the measurements make."""

    def __init__(self, llama_cpp, path: Path, n_ctx: int, n_batch: int, n_seq: int, threads: int,
                 extra_bufts: bool) -> None:
        self.lib = lib = llama_cpp
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = extra_bufts
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.kv_unified = True  # all sequences share the n_ctx cells (else each gets n_ctx / n_seq)
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens for {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def describe(self) -> dict:
        """The model's llama.cpp description, file type and tensor bytes."""
        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.model, buf, len(buf))
        return {"desc": buf.value.decode(), "ftype": int(self.lib.llama_model_ftype(self.model)),
                "model_bytes": int(self.lib.llama_model_size(self.model))}

    def clear(self) -> None:
        """Empties the KV cache."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One `llama_decode` of the entries; returns the greedy next token of each entry that wants logits."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = tok, pos, 1, seq, logits
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode of {len(entries)} tokens returned {rc}")
        return [self.greedy(i) for i, e in enumerate(entries) if e[3]]

    def greedy(self, i: int) -> int:
        """Argmax of batch entry i's logits."""
        row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
        return int(row.argmax())

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def time_prefill(s: Session, prompt: list[int], reps: int) -> list[float]:
    """Seconds of `reps` prefills of `prompt` into an empty cache, after one untimed warm-up."""
    out = []
    for rep in range(reps + 1):
        s.clear()
        t0 = time.perf_counter()
        s.decode(prefill_calls([prompt], len(prompt))[0])
        dt = time.perf_counter() - t0
        log.info("prefill %d tokens: %.3f s%s", len(prompt), dt, " (warm-up)" if rep == 0 else "")
        if rep:
            out.append(dt)
    return out


def time_decode(s: Session, prompts: list[list[int]], n_batch: int, warmup: int, steps: int) -> dict:
    """Prefills `prompts` (equal lengths, untimed), then times `warmup + steps` greedy steps of all of them."""
    s.clear()
    tokens = [t for call in prefill_calls(prompts, n_batch) for t in s.decode(call)]
    positions = [len(p) for p in prompts]
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        tokens = s.decode(step_entries(tokens, positions))
        times.append(time.perf_counter() - t0)
        positions = [p + 1 for p in positions]
    step_ms = median_ms(times[warmup:])
    n = len(prompts)
    log.info("decode batch %d: %.2f ms/step, %.1f tok/s", n, step_ms, n * 1e3 / step_ms)
    return {"batch": n, "step_ms": step_ms, "tok_s": n * 1e3 / step_ms,
            "context": [len(prompts[0]) + warmup + 1, len(prompts[0]) + warmup + steps]}


def file_type(llama_cpp, path: Path) -> int:
    """The llama_ftype of a GGUF file (its weights are memory-mapped, not read)."""
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    try:
        return int(llama_cpp.llama_model_ftype(model))
    finally:
        llama_cpp.llama_model_free(model)


def model_file(llama_cpp, source: Path, type_name: str, source_ftype: int, cache_dir: Path,
               threads: int) -> tuple[Path, float | None]:
    """(the GGUF file of `type_name`, seconds spent quantizing it now or None): the source itself when it has that
    type, else its cached re-quantization (made now if missing)."""
    ftype = getattr(llama_cpp, FTYPES[type_name])
    if ftype == source_ftype:
        return source, None
    out = cache_path(source, type_name, cache_dir)
    if out.is_file():
        log.info("%s: cached %s", type_name, out)
        return out, None
    cache_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype, threads, True
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    seconds = time.perf_counter() - t0
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize to {type_name} returned {rc}")
    os.replace(tmp, out)  # whole files only in the cache, even if a run is killed mid-way
    log.info("%s: quantized to %s in %.1f s", type_name, out, seconds)
    return out, seconds


def measure_type(llama_cpp, path: Path, prompt: list[int], rows: list[list[int]], args: argparse.Namespace,
                 batches: list[int], n_ctx: int) -> dict:
    """Prefill and decode (batch 1 and `batches`) of one model file."""
    t0 = time.perf_counter()
    n_batch = max([len(prompt), args.decode_prompt_len, *batches])  # one call: the prefill, a prompt, a step
    s = Session(llama_cpp, path, n_ctx, n_batch, max([1, *batches]), args.threads, not args.no_extra_bufts)
    try:
        result = {**s.describe(), "file": str(path), "load_s": time.perf_counter() - t0}
        prefill_ms = median_ms(time_prefill(s, prompt, args.prefill_reps))
        one = time_decode(s, [prompt[:args.decode_prompt_len]], n_batch, args.warmup_steps, args.decode_steps)
        result.update(prefill_ms=prefill_ms, prefill_tok_s=len(prompt) * 1e3 / prefill_ms, decode_ms=one["step_ms"],
                      decode_tok_s=one["tok_s"], decode_context=one["context"],
                      batch_decodes=[time_decode(s, rows[:b], n_batch, args.warmup_steps,
                                                 args.batch_steps or args.decode_steps) for b in batches])
    finally:
        s.close()
    return result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--gguf", required=True, type=Path, help="the GGUF file jaxinfer benchmarks")
    ap.add_argument("--prompt-file", required=True, type=Path, help="JSON list of the prefill prompt's token ids")
    ap.add_argument("--batch-prompts", type=Path, help="JSON list of equal-length prompts for --batches")
    ap.add_argument("--batches", default="", help="decode batch sizes besides 1, e.g. 8,32")
    ap.add_argument("--types", default="Q4_0,BF16,Q4_1", help=f"weight types, of {', '.join(FTYPES)}")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where re-quantized files are kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="load weights without ggml's extra CPU buffer types (AMX, repacked layouts)")
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--batch-steps", type=int, help="timed decode steps at the --batches sizes (default: "
                    "--decode-steps)")
    args = ap.parse_args()
    try:
        args.type_names = parse_types(args.types)
        args.batch_sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError as e:
        ap.error(str(e))
    if args.batch_sizes and args.batch_prompts is None:
        ap.error("--batches needs --batch-prompts")
    if not args.gguf.is_file():
        ap.error(f"--gguf {args.gguf} is not a file")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[peer] %(asctime)s %(message)s")
    import llama_cpp  # only here: the helpers above are importable (and tested) without llama-cpp-python

    prompt = json.loads(args.prompt_file.read_text())
    rows = json.loads(args.batch_prompts.read_text()) if args.batch_prompts else []
    if args.batch_sizes and (len(rows) < max(args.batch_sizes) or len({len(r) for r in rows}) != 1):
        raise SystemExit(f"--batch-prompts needs >= {max(args.batch_sizes)} prompts of one length")
    args.decode_prompt_len = min(args.decode_prompt_len, len(prompt))
    llama_cpp.llama_backend_init()
    n_ctx = context_tokens(len(prompt), max(args.decode_prompt_len, len(rows[0]) if rows else 0),
                           args.warmup_steps + max(args.decode_steps, args.batch_steps or 0), args.batch_sizes)
    source_ftype = file_type(llama_cpp, args.gguf)
    result = {"llama_cpp": llama_cpp.__version__, "threads": args.threads, "flash_attn": False, "n_ctx": n_ctx,
              "extra_bufts": not args.no_extra_bufts,
              "kv_type": "f16", "system_info": llama_cpp.llama_print_system_info().decode().strip(), "results": {}}
    for name in args.type_names:
        path, quantize_s = model_file(llama_cpp, args.gguf, name, source_ftype, args.cache_dir, args.threads)
        r = measure_type(llama_cpp, path, prompt, rows, args, args.batch_sizes, n_ctx)
        result["results"][name] = {**r, "quantize_s": quantize_s}
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
