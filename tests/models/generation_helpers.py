"""Left-padded prompt batches with image placeholders, for the generation tests."""

import torch

TOKENS_PER_IMAGE = 4  # tiny_vlm: 32 px images, 8 px patches, pixel shuffle 2
IMAGE_ID = 95


def make_prompt(length: int, seed: int) -> torch.Tensor:
    """Some text, one image's placeholders, more text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (length,), generator=g)
    ids[1 : 1 + TOKENS_PER_IMAGE] = IMAGE_ID
    return ids


def left_pad_prompts(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return ids, mask


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three prompts of different lengths, left-padded, each with one image."""
    ids, mask = left_pad_prompts([make_prompt(n, seed) for seed, n in enumerate((9, 17, 12))])
    return ids, mask, torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
