"""Tokenizers for jaxinfer: text <-> token ids, chat templates, streaming detokenization.

One public type, `Tokenizer`, wraps one of two backends:

* a `tokenizers.Tokenizer` (HF fast tokenizer): built from a `tokenizer.json`, or from the
  vocabulary and merges stored in a GGUF file whose `tokenizer.ggml.model` is `"gpt2"`
  (byte-level BPE);
* a `sentencepiece.SentencePieceProcessor`: loaded from a `tokenizer.model`, or built from the
  pieces, scores and token types stored in a GGUF file whose `tokenizer.ggml.model` is `"llama"`.

Special tokens. `Tokenizer.encode` treats its input as *plain text*: a user who types
`<|im_start|>` gets the ids of those characters, never the control id. Only text rendered from
the model's own chat template is encoded with special tokens recognised, and even there the
message contents stay plain text (see `Tokenizer.apply_chat_template`). Non-special added tokens
(GGUF "user defined" tokens, HF added tokens with `special=False`) are ordinary vocabulary and
are matched in any text, as HF and llama.cpp do.

Chat templates are untrusted Jinja2 and render inside `jinja2.sandbox.ImmutableSandboxedEnvironment`.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas without emitting
half-finished UTF-8 characters.

Modules (one job each; the package is a leaf: stdlib, tokenizers, sentencepiece, jinja2, gguf):

* `tokenizer`: the `Tokenizer` class (constructors, encode/decode, BOS policy, saving).
* `backends`: the `tokenizers` and SentencePiece backends, and `_SpecialConfig`.
* `gguf_convert`: GGUF `tokenizer.*` metadata -> backend and config.
* `hf_dir`: HF tokenizer folder -> backend and config.
* `chat_template`: the sandboxed Jinja2 environment, message checks, template lookup, and
  encoding rendered prompts with message contents kept plain.
* `detokenizer`: `IncrementalDetokenizer`.
"""

from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
