"""Pixel shuffle against an explicit loop over the patch grid."""

import torch

from models import ModalityProjector
from tests.models.helpers import tiny_vlm_config


def test_pixel_shuffle_groups_neighbouring_patches():
    config = tiny_vlm_config()  # a 4x4 patch grid, factor 2 -> 4 tokens
    projector = ModalityProjector(config)
    patches = torch.randn(2, 16, config.vision.hidden_size)
    grid, f = 4, 2
    expected = torch.stack(
        [
            torch.stack(
                [
                    torch.cat(
                        [
                            patches[n, (row * f + dr) * grid + col * f + dc]
                            for dr in range(f)
                            for dc in range(f)
                        ]
                    )
                    for row in range(grid // f)
                    for col in range(grid // f)
                ]
            )
            for n in range(2)
        ]
    )
    torch.testing.assert_close(projector(patches), projector.proj(expected))
    assert projector(patches).shape == (2, config.tokens_per_image, config.language.hidden_size)


def test_position_embedding_marks_each_token_alike_in_every_image():
    config = tiny_vlm_config()
    projector = ModalityProjector(config.replace({"projector.position_embedding": "true"}))
    patches = torch.randn(3, 16, config.vision.hidden_size)
    plain = ModalityProjector(config)
    plain.proj.weight.data.copy_(projector.proj.weight)
    assert projector.position.shape == (config.tokens_per_image, config.language.hidden_size)
    torch.testing.assert_close(projector(patches), plain(patches) + projector.position)
    assert projector.position.std() > 2 * plain(patches).std() / 3  # as visible as the content it is added to
