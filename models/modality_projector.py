"""Image patches to language-model embeddings: pixel shuffle, then a linear map (as in nanoVLM / Idefics3)."""

from __future__ import annotations

from einops import rearrange
from torch import Tensor, nn

from models.config import VLMConfig


# Pixel shuffle (Shi et al. 2016) trades spatial tokens for width: factor f turns f*f neighbouring patches into one token.
class ModalityProjector(nn.Module):
    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.factor = config.projector.pixel_shuffle_factor
        self.grid = config.vision.grid_size
        self.proj = nn.Linear(config.vision.hidden_size * self.factor**2, config.language.hidden_size, bias=False)
        nn.init.normal_(self.proj.weight, std=0.02)

    def forward(self, patches: Tensor) -> Tensor:
        """[N, grid*grid, vision_hidden] -> [N, (grid/f)^2, language_hidden], row-major over the shuffled grid."""
        f = self.factor
        shuffled = rearrange(patches, "n (h fh w fw) c -> n (h w) (fh fw c)", fh=f, fw=f, h=self.grid // f)
        return self.proj(shuffled)
