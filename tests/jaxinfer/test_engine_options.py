"""Every `EngineConfig` field is a flag of the `jaxinfer` subcommands its `Flag` names, with the field's help and
default, and a keyword of `LLM`: an option is declared once, in `jaxinfer/engine/config.py` (no model loads)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jaxinfer import cli
from jaxinfer.commands import options as cli_options
from jaxinfer.engine.config import EngineConfig

FIELDS = dataclasses.fields(EngineConfig)
REQUIRED = {"generate": ["--prompt", "x"], "chat": [], "serve": [], "convert": ["--output", "out"]}
# Every flag spelling of earlier releases, with a value, and the field it sets.
OLD_FLAGS = {
    "generate": ["--model", "m.gguf", "--dtype", "bfloat16", "--max-model-len", "64", "--page-size", "8",
                 "--kv-cache-memory-bytes", "4096", "--max-num-batched-tokens", "32", "--warmup", "--tp", "2",
                 "--ep", "1", "--no-prefix-caching", "--kv-cache-dtype", "int8", "--attention-backend", "reference",
                 "--speculative-config", '{"num_speculative_tokens": 2}', "--quantization", "int8"],
    "serve": ["--model", "m.gguf", "--dtype", "bfloat16", "--max-num-seqs", "4", "--no-warmup",
              "--tensor-parallel-size", "2", "--expert-parallel-size", "1", "--kv-offload-bytes", "1024",
              "--kv-cache-dtype", "fp8", "--quantization", '{"format": "fp8"}'],
    "convert": ["--model", "m.gguf", "--dtype", "bfloat16", "--quantization", "fp8"],
}


def _no_space(text: str) -> str:
    return re.sub(r"\s", "", text)  # argparse wraps help lines (also after hyphens)


@pytest.mark.parametrize("command", list(REQUIRED))
def test_every_field_is_a_flag_with_its_help_and_default(command, capsys):
    parser = cli._build_parser()
    args = vars(parser.parse_args([command, *REQUIRED[command]]))
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    shown = _no_space(capsys.readouterr().out)
    taken = [f for f in FIELDS if command in f.metadata["flag"].commands]
    assert taken, command
    for field in taken:
        flag = field.metadata["flag"]
        assert args[field.name] == flag.command_defaults.get(command, field.default), field.name
        assert "--" + field.name.replace("_", "-") in shown, field.name
        assert _no_space(flag.command_help.get(command, field.metadata["help"])) in shown, field.name
    if command != "convert":
        assert {f.name for f in FIELDS} - {f.name for f in taken} <= {"seed"}  # generate's --seed samples


def test_every_field_has_a_flag_in_some_command():
    for field in FIELDS:
        assert set(field.metadata["flag"].commands) & set(REQUIRED), field.name


def test_the_flags_defaults_are_the_engines():
    parser = cli._build_parser()
    serve = cli_options.engine_options(parser.parse_args(["serve"]))
    assert EngineConfig.create(**serve) == EngineConfig()
    generate = cli_options.engine_options(parser.parse_args(["generate", "--prompt", "x"]))
    # one prompt: no start-up compile, and a KV cache for one sequence; chat too (one turn at a time)
    assert EngineConfig.create(**generate) == EngineConfig(warmup=False, max_num_seqs=1)
    chat = cli_options.engine_options(parser.parse_args(["chat"]))
    assert EngineConfig.create(**chat) == EngineConfig(warmup=False, max_num_seqs=1)


@pytest.mark.parametrize("command", list(OLD_FLAGS))
def test_the_flags_of_earlier_releases_still_set_their_fields(command):
    options = cli_options.engine_options(cli._build_parser().parse_args([command, *REQUIRED[command], *OLD_FLAGS[command]]))
    assert options["model"] == "m.gguf" and options["dtype"] == "bfloat16"
    if command == "generate":
        config = EngineConfig.create(**options)
        assert (config.max_model_len, config.page_size, config.kv_cache_memory_bytes) == (64, 8, 4096)
        assert (config.max_num_batched_tokens, config.warmup, config.tensor_parallel_size) == (32, True, 2)
        assert (config.enable_prefix_caching, config.kv_cache_dtype, config.attention_backend) == \
            (False, "int8", "reference")
        assert config.speculative_config.num_speculative_tokens == 2 and config.quantization.format == "int8"
    elif command == "serve":
        config = EngineConfig.create(**options)
        assert (config.max_num_seqs, config.warmup, config.tensor_parallel_size) == (4, False, 2)
        assert (config.kv_offload_bytes, config.kv_cache_dtype, config.quantization.format) == (1024, "fp8", "fp8")
    else:
        assert set(options) == {"model", "dtype", "quantization"} and options["quantization"].format == "fp8"


class _FakeEngine:
    """Stands in for `Engine`: keeps the config `LLM` built, loads nothing."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = self.model_config = self.runner = self.page_allocator = None
        self.page_size = self.max_model_len = 0


@pytest.fixture
def fake_engine(monkeypatch):
    from jaxinfer import llm

    monkeypatch.setattr(llm, "Engine", _FakeEngine)


def test_llm_takes_every_field_as_a_keyword(fake_engine):
    from jaxinfer import LLM

    assert LLM(**{f.name: f.default for f in FIELDS}).engine.config == EngineConfig()
    options = cli_options.engine_options(cli._build_parser().parse_args(["generate", *REQUIRED["generate"],
                                                                  *OLD_FLAGS["generate"]]))
    assert LLM(**options).engine.config == EngineConfig.create(**options)


def test_llm_names_an_unknown_keyword_and_the_close_fields(fake_engine):
    from jaxinfer import LLM

    with pytest.raises(ValueError, match=r"unknown engine option\(s\) 'max_num_seq' \(did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)


def _config_file(tmp_path, options: dict) -> str:
    import json

    path = tmp_path / "engine.json"
    path.write_text(json.dumps({**options, "_note": "skipped"}))
    return str(path)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_config_file_gives_what_the_typed_flags_do_not(tmp_path, command):
    path = _config_file(tmp_path, {"max_num_seqs": 8, "page_size": 32, "enable_prefix_caching": False,
                                   "quantization": "int8", "seed": 7})
    parse = cli._build_parser().parse_args

    def config(*flags: str) -> EngineConfig:
        return EngineConfig.create(**cli_options.engine_options(parse([command, *REQUIRED[command], *flags])))

    base = config()
    from_file = config("--config", path)
    args = parse([command, *REQUIRED[command], "--config", path])
    cli_options.engine_options(args)
    assert cli_options.given(args, "page_size") and not cli_options.given(args, "max_model_len")  # the file's
    assert (from_file.max_num_seqs, from_file.page_size, from_file.enable_prefix_caching) == (8, 32, False)
    assert from_file.quantization.format == "int8" and from_file.seed == 7  # generate has no --seed flag: taken
    assert from_file.max_num_batched_tokens == base.max_num_batched_tokens  # not in the file: the flag's default
    # A typed flag wins over the file, also when it types the default value.
    typed = config("--config", path, "--max-num-seqs", str(base.max_num_seqs), "--prefix-caching", "--page-size", "16")
    assert (typed.max_num_seqs, typed.enable_prefix_caching, typed.page_size) == (base.max_num_seqs, True, 16)
    assert typed.quantization.format == "int8"


def test_config_file_errors_name_the_file_or_flag(tmp_path):
    parse = cli._build_parser().parse_args
    bad = _config_file(tmp_path, {"max_num_seqs": 8, "quantization": "int3"})
    with pytest.raises(ValueError, match=r"config file .*engine\.json: quantization: .*int3"):
        cli_options.engine_options(parse(["serve", "--config", bad]))
    unknown = _config_file(tmp_path, {"max_num_seq": 8})
    with pytest.raises(ValueError, match=r"config file .*engine\.json: unknown engine option\(s\) 'max_num_seq'"):
        cli_options.engine_options(parse(["serve", "--config", unknown]))
    with pytest.raises(SystemExit):
        parse(["convert", "--output", "o", "--config", bad])  # convert takes no config file


def test_llm_takes_a_config_file_or_dict_and_keywords_win(fake_engine, tmp_path):
    from jaxinfer import LLM

    path = _config_file(tmp_path, {"max_num_seqs": 8, "model": "m.gguf", "kv_cache_dtype": "int8"})
    assert LLM(config=path).engine.config == EngineConfig(max_num_seqs=8, model="m.gguf", kv_cache_dtype="int8")
    llm = LLM("other.gguf", config=path, max_num_seqs=4)
    assert llm.engine.config == EngineConfig(max_num_seqs=4, model="other.gguf", kv_cache_dtype="int8")
    assert LLM(config={"page_size": 8}).engine.config == EngineConfig(page_size=8)
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) 'page'"):
        LLM(config={"page": 8})
    with pytest.raises(ValueError, match="config must be a config file path, a dict"):
        LLM(config=3)
