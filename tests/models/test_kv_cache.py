"""KV-cache memory: the formula against the tensors actually allocated, and SmolLM2's figure; a layout
written outside models/ plugs into the unchanged model."""

import torch

from models import LanguageConfig, LanguageModel, kv_cache_bytes
from models.kv_cache import Layout, tensors


def test_formula_matches_allocated_tensors():
    config = LanguageConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=6,
                            num_kv_heads=2)
    caches = LanguageModel(config).allocate_kv_cache(batch=5, capacity=37, dtype=torch.float16)
    allocated = sum(t.numel() * t.element_size() for cache in caches for t in tensors(cache).values())
    assert kv_cache_bytes(config, batch=5, tokens=37, dtype=torch.float16) == allocated


def test_smollm2_figure():
    # 2 x 30 layers x 3 kv heads x 64 dims x 8192 tokens x 1 x 2 bytes = 180 MiB in bf16
    assert kv_cache_bytes(LanguageConfig(), batch=1, tokens=8192) == 180 * 2**20


class _HandWritten(Layout):
    """A layout written outside models/: K/V concatenated call by call, attention spelled out (a softmax
    over q k^T under the causal rule, each kv head repeated for its query heads) instead of SDPA."""

    def write(self, cache, key, value, start_pos):
        cache = {"key": torch.cat([cache["key"], key], 2), "value": torch.cat([cache["value"], value], 2),
                 "layout": self}
        return cache, cache["key"], cache["value"]

    def attend(self, q, key, value, mask, cache, start_pos):
        cache, keys, values = self.write(cache, key, value, start_pos)
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scores = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5
        visible = torch.arange(keys.shape[2]) <= torch.arange(q.shape[2])[:, None] + start_pos
        return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values, cache


def test_a_layout_written_outside_models_plugs_into_the_unchanged_model():
    """The cache's layout is the seam: a prefill then three decode steps through a layout the model has never
    seen give the preallocated layout's logits (float64)."""
    torch.manual_seed(0)
    config = LanguageConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                            num_kv_heads=2)
    model = LanguageModel(config).double().eval()
    ids = torch.randint(0, 64, (2, 12))
    empty = torch.zeros(2, config.num_kv_heads, 0, config.head_dim, dtype=torch.float64)
    ours = [{"key": empty, "value": empty, "layout": _HandWritten()} for _ in range(config.num_layers)]
    preallocated = model.allocate_kv_cache(2, 12)
    with torch.no_grad():
        for start, end in ((0, 9), (9, 10), (10, 11), (11, 12)):
            embeddings = model.token_embedding(ids[:, start:end])
            hidden, ours = model(embeddings, kv_cache=ours, start_pos=start)
            expected, preallocated = model(embeddings, kv_cache=preallocated, start_pos=start)
            torch.testing.assert_close(model.head(hidden), model.head(expected), atol=1e-12, rtol=0)
    assert all(cache["key"].shape[2] == 12 and isinstance(cache["layout"], _HandWritten) for cache in ours)
