"""jaxinfer.loading.codec: configs round-trip through JSON; unknown fields and bad enum values are refused."""

from __future__ import annotations

import json

import pytest

from jaxinfer.loading.codec import config_from_dict, config_to_dict
from models.config import ModelConfig, RopeScaling, RopeType


# --- config JSON ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8),
    ModelConfig(architecture="mistral", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=5e5, sliding_window=8, tie_word_embeddings=True,
                rope_scaling=RopeScaling(RopeType.LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=32), name="x"),
    ModelConfig(architecture="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                num_kv_heads=2, head_dim=16, attention_bias=True, rope_scaling=RopeScaling(RopeType.LINEAR, 2.0)),
])
def test_config_round_trips_through_json(cfg):
    text = json.dumps(config_to_dict(cfg))
    assert config_from_dict(json.loads(text)) == cfg


def test_config_from_dict_refuses_unknown_fields_and_bad_enums():
    data = config_to_dict(ModelConfig(architecture="llama", vocab_size=8, hidden_size=8,
                                      intermediate_size=8, num_layers=1, num_heads=1,
                                      num_kv_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="unknown ModelConfig field.*made_up"):
        config_from_dict({**data, "made_up": 1})
    with pytest.raises(ValueError, match="'cubic' is not a RopeType"):
        config_from_dict({**data, "rope_scaling": {"rope_type": "cubic", "factor": 2.0}})
