"""The ViT against transformers' SigLIP, loaded from saved Hugging Face checkpoints."""

import pytest
import torch

from models import CheckpointError, VisionTransformer
from tests.models.helpers import fused_copy


def _siglip_vision_config():
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=48, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, layer_norm_eps=1e-6)


def _randomise(model):
    torch.manual_seed(0)
    with torch.no_grad():  # non-trivial norms and biases too, so every weight is checked
        for p in model.parameters():
            p.normal_(0, 0.2).add_(1.0 if p.dim() == 1 and p.shape[0] == 48 else 0.0)
    return model.eval()


def test_matches_siglip_vision_model(tmp_path):
    from transformers import SiglipVisionModel

    reference = _randomise(SiglipVisionModel(_siglip_vision_config()))
    reference.save_pretrained(tmp_path)
    ours = VisionTransformer.from_pretrained(tmp_path).eval()
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = reference(pixel_values=images).last_hidden_state
        actual = ours(images)
        actual_fused = fused_copy(ours)(images)
    assert ours.config.num_patches == 16 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(actual_fused, expected, atol=1e-4, rtol=0)


def test_loads_the_vision_tower_of_a_full_siglip_model(tmp_path):
    from transformers import SiglipConfig, SiglipModel, SiglipTextConfig

    config = SiglipConfig(text_config=SiglipTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=4),
                          vision_config=_siglip_vision_config())
    reference = _randomise(SiglipModel(config))
    reference.save_pretrained(tmp_path)
    ours = VisionTransformer.from_pretrained(tmp_path).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = reference.vision_model(pixel_values=images).last_hidden_state
        torch.testing.assert_close(ours(images), expected, atol=1e-4, rtol=0)


def test_wrong_image_size_is_a_clear_error(tmp_path):
    from transformers import SiglipVisionModel

    SiglipVisionModel(_siglip_vision_config()).save_pretrained(tmp_path)
    ours = VisionTransformer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"images must be \[N, 3, 32, 32\]"):
        ours(torch.randn(1, 3, 64, 64))


def test_llama_checkpoint_is_not_a_vision_checkpoint(tmp_path):
    from tests.models.helpers import save_tiny_llama

    save_tiny_llama(tmp_path, tie=True)
    with pytest.raises((CheckpointError, KeyError)):
        VisionTransformer.from_pretrained(tmp_path)


def test_a_sparse_hub_config_takes_transformers_defaults():
    """Older SigLIP repos list only what differs from the defaults: {"vision_config": {"model_type",
    "patch_size"}}."""
    from transformers import SiglipVisionConfig

    from models.siglip import config_from_hf

    config = config_from_hf({"model_type": "siglip", "vision_config": {"model_type": "siglip_vision_model",
                                                                       "patch_size": 16}})
    defaults = SiglipVisionConfig()
    assert (config.image_size, config.patch_size, config.hidden_size, config.intermediate_size,
            config.num_layers, config.num_heads, config.layer_norm_eps) == (
        defaults.image_size, 16, defaults.hidden_size, defaults.intermediate_size, defaults.num_hidden_layers,
        defaults.num_attention_heads, defaults.layer_norm_eps)
    with pytest.raises(CheckpointError, match="clip"):
        config_from_hf({"model_type": "clip", "vision_config": {}})
