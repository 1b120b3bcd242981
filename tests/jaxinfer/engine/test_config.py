"""`EngineConfig`: `create` normalises what users write, the frozen config only validates, and every field
declares its meaning once (host-only: no model loads)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from jaxinfer.engine.config import ATTENTION_BACKENDS, EngineConfig, Flag
from jaxinfer.engine.spec_decode.config import SpeculativeConfig

FIELDS = dataclasses.fields(EngineConfig)


def test_every_field_has_help_and_a_flag():
    for field in FIELDS:
        assert isinstance(field.metadata.get("help"), str) and len(field.metadata["help"]) > 10, field.name
        flag = field.metadata.get("flag")
        assert isinstance(flag, Flag) and flag.commands, field.name
        assert set(flag.command_defaults) <= set(flag.commands) and set(flag.command_help) <= set(flag.commands)


def test_create_parses_user_values_and_the_config_holds_them():
    config = EngineConfig.create(quantization="int8", speculative_config='{"num_speculative_tokens": 2}',
                                 max_num_seqs=4)
    assert config.quantization.format == "int8" and config.max_num_seqs == 4
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig.create(quantization={"format": "fp8", "group_size": 128}).quantization.group_size == 128
    assert EngineConfig.create() == EngineConfig()
    assert EngineConfig.create(**dataclasses.asdict(config) | {"speculative_config": {"num_speculative_tokens": 2},
                                                               "quantization": json.dumps({"format": "int8"})}
                               ) == config
    assert EngineConfig(quantization=config.quantization) == EngineConfig.create(quantization="int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 8  # type: ignore[misc]


@pytest.mark.parametrize("options, message", [
    ({"quantization": "int8"}, "quantization='int8' is not a QuantizationConfig; pass a format name, dict or JSON "
                               "string as EngineConfig.create(quantization=...)"),
    ({"speculative_config": {"method": "ngram"}}, "speculative_config={'method': 'ngram'} is not a SpeculativeConfig; "
                                                  "pass a dict or JSON string as EngineConfig.create("),
    ({"speculative_config": "{}"}, "speculative_config='{}' is not a SpeculativeConfig"),
])
def test_the_constructor_names_an_unparsed_value_and_how_to_pass_it(options, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**options)
    assert message in str(e.value)


def test_unknown_options_are_named_with_the_close_fields():
    with pytest.raises(ValueError) as e:
        EngineConfig.create(max_num_seq=4, kv_cache_dtypes="int8", colour="red")
    message = str(e.value)
    assert "unknown engine option(s) 'max_num_seq' (did you mean 'max_num_seqs'?)" in message
    assert "'kv_cache_dtypes' (did you mean 'kv_cache_dtype'?)" in message and "'colour'; the options are" in message


def test_bad_values_still_raise_naming_the_field():
    with pytest.raises(ValueError, match="page_size=0 must be a positive integer"):
        EngineConfig.create(page_size=0)
    with pytest.raises(ValueError, match="quantization format='int3' is not one of int8, fp8, int4"):
        EngineConfig.create(quantization="int3")
    with pytest.raises(ValueError, match="attention_backend='fast' is not one of auto, reference, pallas"):
        EngineConfig(attention_backend="fast")


@pytest.mark.parametrize("options, message", [
    ({"seed": -1}, r"seed=-1 must be an integer in \[0, 2\*\*32\)"),
    ({"seed": 2**32}, r"seed=4294967296 must be an integer"),
    ({"seed": "a"}, r"seed='a' must be an integer"),
    ({"max_model_len": 0}, r"max_model_len=0 must be None or a positive integer"),
    ({"max_model_len": "1024"}, r"max_model_len='1024' must be None or a positive integer"),
    ({"kv_cache_memory_bytes": True}, r"kv_cache_memory_bytes=True must be None or a positive integer"),
    ({"model": 123}, r"model=123 must be a path"),
])
def test_every_field_is_checked_before_anything_loads(options, message):
    """Found by a fresh-user trial: these reached the loader (or numpy's seeding) before failing."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


@pytest.mark.parametrize("options, message", [
    ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size=0 must be a positive integer"),
    ({"pipeline_microbatches": 0}, r"pipeline_microbatches=0 must be None or a positive integer"),
    ({"pipeline_microbatches": 4}, r"pipeline_microbatches=4 cuts steps for pipeline stages; it needs "
                                   r"pipeline_parallel_size > 1 \(got 1\)"),
    ({"pipeline_parallel_size": 2, "scan_layers": False}, r"pipeline_parallel_size=2 .* scan_layers=False"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "self_draft"}},
     r"pipeline_parallel_size=2 does not support speculative method 'self_draft'"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "draft_model", "model": "m"}},
     r"pipeline_parallel_size=2 does not support speculative method 'draft_model'"),  # not "or 'self_draft'"
    ({"tensor_parallel_size": 2, "speculative_config": {"method": "draft_model", "model": "m"}},
     r"method 'draft_model' runs on one device"),
])
def test_unsupported_pipeline_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(**options)
    assert EngineConfig(pipeline_parallel_size=2, tensor_parallel_size=2).num_devices == 4


def test_attention_backends_are_the_dispatchers():
    from pallas_kernels.dispatch import AttentionBackend

    assert ATTENTION_BACKENDS == tuple(b.value for b in AttentionBackend)


def test_the_options_and_the_command_line_load_without_jax():
    code = ("import sys, jaxinfer.engine.config, jaxinfer.cli; jaxinfer.cli._build_parser(); "
            "jaxinfer.engine.config.EngineConfig.create(speculative_config='{}'); assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_jnp_dtypes_load_on_first_use():
    import jax.numpy as jnp

    from jaxinfer.engine import config

    assert config.DTYPES == {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    assert config.KV_CACHE_DTYPES == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
    with pytest.raises(AttributeError, match="no attribute 'DTYPE'"):
        config.DTYPE  # noqa: B018


@pytest.mark.parametrize("variable,value", [("JAXINFER_NATIVE_ISA", "bogus"), ("JAXINFER_NATIVE_THREADS", "abc"),
                                            ("JAXINFER_NATIVE_KERNELS", "maybe")])
@pytest.mark.parametrize("kernels_off", [False, True])
def test_a_bad_native_kernel_variable_fails_the_config_before_any_weight_loads(monkeypatch, variable, value,
                                                                               kernels_off):
    """Each variable is checked even with the kernels turned off (a typo must not pass unseen)."""
    if kernels_off and variable != "JAXINFER_NATIVE_KERNELS":
        monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        EngineConfig()


def test_importing_the_package_does_not_check_the_environment():
    """A bad variable fails creating an engine (where a caller can catch it), not `import jaxinfer` (an `Engine`
    default argument once built an EngineConfig at import)."""
    import subprocess
    import sys

    code = ("from jaxinfer import LLM\nfrom jaxinfer.engine.engine import Engine\ntry:\n    Engine()\n"
            "except ValueError as e:\n    print('refused:', e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "JAXINFER_NATIVE_ISA": "bogus"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "refused: JAXINFER_NATIVE_ISA='bogus' is not a level" in result.stdout
