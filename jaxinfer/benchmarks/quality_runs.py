"""The engine side of the quality workload: an engine sized for evaluation, a text's logits chunk by chunk over the
paged KV cache, greedy continuations from points of the text, and models without a tokenizer (the tiny HF goldens
of `tests/data`, which `scripts/make_golden.py` writes without one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler.chunk import ScheduledChunk

CHAR_VOCAB_SIZE = 128  # the character tokenizer's ids: 7-bit ASCII codes, 0 standing for every other character
GOLDEN_FILE = "golden.json"  # scripts/make_golden.py: HF transformers' f32 logits of `token_ids`


def make_llm(model: str | os.PathLike | None, dtype: str, chunk: int, quantization=None,
             kv_cache_dtype: str | None = None, max_num_seqs: int = 32) -> LLM:
    """An engine sized for one long evaluation sequence, or `max_num_seqs` greedy continuations at once (no prefix
    caching, no warm-up, a 256 MiB KV cache).

    Args:
      model: what `LLM` takes (None: SmolLM2-135M-Instruct).
      dtype: "float32" or "bfloat16": weights that stay unquantized and activations.
      chunk: prefill tokens per step (`max_num_batched_tokens`, at least 16).
      quantization: anything `models.quant.QuantizationConfig.from_value` takes, or None.
      kv_cache_dtype: None / "auto" (the activation dtype), or a `jaxinfer.engine.config.KV_CACHE_DTYPE_NAMES` name.

    Raises:
      ValueError: from `LLM` (bad path, a quantization this model cannot take, ...).
    """
    extra = {} if kv_cache_dtype in (None, "auto") else {"kv_cache_dtype": kv_cache_dtype}
    return LLM(model, dtype=dtype, warmup=False, enable_prefix_caching=False, quantization=quantization,
               max_num_batched_tokens=max(chunk, 16), kv_cache_memory_bytes=256 << 20,
               max_num_seqs=max(max_num_seqs, 1), **extra)


def chunk_logits(llm: LLM, ids: list[int], chunk: int) -> Iterator[np.ndarray]:
    """Yields f32[len(piece), V] logits of each `chunk`-token piece of `ids` in order, prefilled through
    `ModelRunner.compute_logits` over the paged cache (later pieces attend to the cached earlier ones, as chunked
    prefill does). The sequence's pages are freed when the generator finishes or is closed.

    Raises:
      ValueError: if ids has fewer than 2 tokens or more than the KV cache can hold.
    """
    if len(ids) < 2:
        raise ValueError("need at least 2 tokens")
    runner, ps = llm.runner, llm.engine.page_size
    pages = llm.engine.page_allocator.allocate(-(-len(ids) // ps))
    try:
        for start in range(0, len(ids), chunk):
            new = ids[start : start + chunk]
            used = -(-(start + len(new)) // ps)
            yield runner.compute_logits([ScheduledChunk(new, start, pages[:used])])
    finally:
        llm.engine.page_allocator.free(pages)


def eval_logits(llm: LLM, ids: list[int], chunk: int) -> np.ndarray:
    """f32 logits [len(ids), V] of every position of `ids` (`chunk_logits`, concatenated)."""
    return np.concatenate(list(chunk_logits(llm, ids, chunk)))


def flip_prompts(ids: list[int], num: int, context: int) -> list[list[int]]:
    """The prompts of the flip measurement: `num` evenly spaced points of the text, p_i = len(ids) * (i + 1) // num
    for i in [0, num) (the last is the text's end), each prompt being the up to `context` tokens just before p_i.

    Raises:
      ValueError: if num or context is < 1, or num > len(ids).
    """
    if num < 1 or context < 1 or num > len(ids):
        raise ValueError(f"flips: need 1 <= num ({num}) <= the text's {len(ids)} tokens and context ({context}) >= 1")
    ends = [len(ids) * (i + 1) // num for i in range(num)]
    return [ids[max(0, p - context) : p] for p in ends]


def greedy_continuations(llm: LLM, prompts: list[list[int]], steps: int) -> np.ndarray:
    """i32[len(prompts), steps]: each prompt's `steps` greedy tokens (temperature 0, EOS ignored), all prompts in
    one `LLM.generate` call, so two engines of the same size batch them alike."""
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids[:steps] for o in outs], dtype=np.int32)


def has_tokenizer(folder: Path) -> bool:
    """Whether an HF folder has its tokenizer (`tokenizer.json` or `tokenizer.model`)."""
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()


def with_char_tokenizer(model: Path, folder: Path) -> Path:
    """A copy of the HF model folder `model` (its files linked, not copied) in the new folder `folder`, with a
    character tokenizer: each 7-bit ASCII character is one token, its code the id (1-127); every other character
    is id 0 ("<unk>"); no BOS. For the tiny golden models, whose vocabulary is exactly 128 ids and that come
    without a tokenizer; GPL-3 and textwrap.py are ASCII.

    Raises:
      ValueError: if `model` is not an HF folder, or its vocabulary is smaller than 128.
    """
    config = model / "config.json"
    if not config.is_file():
        raise ValueError(f"{str(model)!r} is not an HF model folder (no config.json)")
    vocab_size = json.loads(config.read_text()).get("vocab_size", 0)
    if vocab_size < CHAR_VOCAB_SIZE:
        raise ValueError(f"{str(model)!r} has no tokenizer and a vocabulary of {vocab_size} ids: the character "
                         f"tokenizer needs {CHAR_VOCAB_SIZE}")
    folder.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and f.name != GOLDEN_FILE:
            (folder / f.name).symlink_to(f.resolve())
    vocab = {"<unk>": 0} | {chr(i): i for i in range(1, CHAR_VOCAB_SIZE)}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tk.decoder = decoders.Fuse()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    return folder


def loadable(model: str | None, folder: Path) -> str | Path | None:
    """`model`, or, for an HF folder without a tokenizer, its copy with a character tokenizer made in the new
    folder `folder` (`with_char_tokenizer`), which must outlive the engines built from it."""
    if model is not None and Path(model).is_dir() and not has_tokenizer(Path(model)):
        return with_char_tokenizer(Path(model), folder)
    return model


def hf_golden(model: str | os.PathLike | None) -> tuple[list[int], np.ndarray] | None:
    """(token ids, HF transformers' f32 logits [len(ids), V]) from the model folder's `golden.json`
    (`scripts/make_golden.py`), or None when it has none."""
    path = None if model is None else Path(model) / GOLDEN_FILE
    if path is None or not path.is_file():
        return None
    golden = json.loads(path.read_text())
    if "token_ids" not in golden or "logits" not in golden:
        return None
    return list(golden["token_ids"]), np.asarray(golden["logits"], np.float32)
