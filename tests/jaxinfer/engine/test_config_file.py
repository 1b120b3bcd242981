"""Config files (`jaxinfer.engine.config_file`): a JSON object of engine options that loads back to the same
`EngineConfig`, with errors that name the file and the unknown option."""

from __future__ import annotations

import json

import pytest

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.config_file import json_value, load_config_file, write_config_file


def test_round_trip_of_normalised_and_written_options(tmp_path):
    written = {"max_num_seqs": 8, "page_size": 32, "enable_prefix_caching": False, "kv_cache_dtype": "int8",
               "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
               "quantization": {"format": "int8", "quantize_activations": True}, "max_model_len": None}
    config = EngineConfig.create(**written)
    # From the raw options and from the normalised config's fields: both load back to the same config.
    normalised = {name: getattr(config, name) for name in written}
    for i, options in enumerate((written, normalised)):
        path = write_config_file(tmp_path / f"c{i}.json", options, notes={"tuned": {"output_tok_s": 12.5}})
        body = json.loads(path.read_text())
        assert body["_tuned"] == {"output_tok_s": 12.5}  # a note, which the loader skips
        assert EngineConfig.create(**load_config_file(path)) == config
    assert json_value(config.quantization) == {"format": "int8", "quantize_activations": True}
    assert json_value(config.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("text, match", [
    ('{"max_num_seq": 8}', r"config file .*c\.json: unknown engine option\(s\) 'max_num_seq' \(did you mean "
                           r"'max_num_seqs'"),
    ('{"max_num_seqs": 8,}', r"config file .*c\.json: not valid JSON: .*line 1 column"),
    ('[["max_num_seqs", 8]]', r"config file .*c\.json: must be a JSON object of engine options, got list"),
])
def test_bad_files_are_named(tmp_path, text, match):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_config_file(path)


def test_missing_file_and_bad_values(tmp_path):
    with pytest.raises(ValueError, match=r"config file .*nope\.json: cannot be read"):
        load_config_file(tmp_path / "nope.json")
    path = tmp_path / "c.json"
    path.write_text('{"max_num_seqs": 0}')
    with pytest.raises(ValueError, match="max_num_seqs=0 must be a positive integer"):
        EngineConfig.create(**load_config_file(path))
    with pytest.raises(ValueError, match="unknown engine option"):
        write_config_file(tmp_path / "w.json", {"max_num_seq": 8})
