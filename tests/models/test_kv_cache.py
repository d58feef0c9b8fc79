"""KV-cache memory: the formula against the tensors actually allocated, and SmolLM2's figure."""

import torch

from models import LanguageConfig, LanguageModel, kv_cache_bytes


def test_formula_matches_allocated_tensors():
    config = LanguageConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
                            num_kv_heads=2)
    caches = LanguageModel(config).allocate_kv_cache(batch=5, capacity=37, dtype=torch.float16)
    allocated = sum(t.numel() * t.element_size() for cache in caches for t in cache.values())
    assert kv_cache_bytes(config, batch=5, tokens=37, dtype=torch.float16) == allocated


def test_smollm2_figure():
    # 2 x 30 layers x 3 kv heads x 64 dims x 8192 tokens x 1 x 2 bytes = 180 MiB in bf16
    assert kv_cache_bytes(LanguageConfig(), batch=1, tokens=8192) == 180 * 2**20
