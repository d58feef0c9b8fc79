"""Configs: validation messages, JSON round trip, dotted overrides parsed from strings."""

import pytest

from models import ConfigError, LanguageConfig, VisionConfig, VLMConfig


def test_json_round_trip(tmp_path):
    config = VLMConfig(vision=VisionConfig(image_size=64, patch_size=8, image_mean=(0.1, 0.2, 0.3)),
                       image_token_id=7)
    config.save_json(tmp_path / "config.json")
    assert VLMConfig.from_json(tmp_path / "config.json") == config


def test_overrides_parse_strings_by_field_type():
    config = VLMConfig().replace({"language.num_layers": "4", "language.tie_word_embeddings": "false",
                                  "language.rope_theta": "1e4", "vision.image_mean": "0.1,0.2,0.3",
                                  "image_token_id": "5", "language.eos_token_id": "none"})
    assert config.language.num_layers == 4 and config.language.tie_word_embeddings is False
    assert config.language.rope_theta == 10000.0 and config.vision.image_mean == (0.1, 0.2, 0.3)
    assert config.image_token_id == 5 and config.language.eos_token_id is None


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: LanguageConfig(num_heads=9, num_kv_heads=4),
            r"num_heads \(9\) must be divisible by language.num_kv_heads \(4\)",
        ),
        (
            lambda: LanguageConfig(hidden_size=100, num_heads=9, num_kv_heads=3),
            r"hidden_size \(100\) must be divisible",
        ),
        (
            lambda: VisionConfig(image_size=100, patch_size=16),
            r"image_size \(100\) must be divisible by vision.patch_size",
        ),
        (
            lambda: VLMConfig(vision=VisionConfig(image_size=48, patch_size=16)),
            r"patch grid \(3x3\) must be divisible",
        ),
        (lambda: VLMConfig(image_token_id=10**6), r"image_token_id \(1000000\) must lie in"),
        (lambda: VLMConfig().replace({"language.colour": 1}), "unknown key language.colour"),
        (
            lambda: VLMConfig().replace({"vision.patch_size": "big"}),
            "vision.patch_size: expected int, got 'big'",
        ),
        (lambda: VLMConfig().replace({"language.tie_word_embeddings": "maybe"}), "expected true or false"),
        (
            lambda: VLMConfig.from_dict({"language": {"num_layers": 2.5}}),
            "language.num_layers: expected int, got 2.5",
        ),
        (lambda: VLMConfig.from_dict({"vision": 3}), "vision: expected a mapping"),
    ],
)
def test_invalid_configs_fail_with_clear_messages(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        VLMConfig.from_json(tmp_path / "config.json")
