"""The compiled, shape-static decode path gives the eager path's tokens, and compiles once per generate call."""

import pytest
import torch

from tests.models.generation_helpers import left_padded_batch
from tests.models.helpers import tiny_vlm


@pytest.fixture(scope="module")
def model():
    torch._dynamo.reset()
    return tiny_vlm()


def test_tensor_position_step_equals_int_position_step(model):
    """The step the compiled path runs (tensor start_pos, attention over the whole cache) matches eager slicing."""
    ids, mask, images = left_padded_batch()
    eager = model.generate(ids, images, mask, max_new_tokens=12, greedy=True)
    with torch.inference_mode():
        embeddings = model.embed(ids, images)
        full_mask = torch.ones(3, ids.shape[1] + 12, dtype=torch.long)
        full_mask[:, : ids.shape[1]] = mask
        cache = model.language.allocate_kv_cache(3, ids.shape[1] + 12)
        hidden, cache = model.language(embeddings, full_mask, cache)
        token, position, tokens = model.language.head(hidden[:, -1]).argmax(-1), torch.tensor(ids.shape[1]), []
        for _ in range(12):
            tokens.append(token)
            token = model.decode_step(token, full_mask, cache, position).argmax(-1)
            position += 1
    assert torch.equal(torch.stack(tokens, 1), eager)


def test_tensor_position_step_under_bf16_autocast(model):
    """Under autocast the projections give bfloat16 K/V for the float32 cache: the in-place write casts them, as the
    int-position path's slice assignment does, and both steps give the same logits."""
    ids, mask, images = left_padded_batch()
    full_mask = torch.ones(3, ids.shape[1] + 1, dtype=torch.long)
    full_mask[:, : ids.shape[1]] = mask
    logits = []
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for start_pos in (ids.shape[1], torch.tensor(ids.shape[1])):
            cache = model.language.allocate_kv_cache(3, ids.shape[1] + 1)
            hidden, cache = model.language(model.embed(ids, images), full_mask, cache)
            logits.append(model.decode_step(hidden[:, -1].argmax(-1), full_mask, cache, start_pos).float())
    torch.testing.assert_close(logits[0], logits[1], rtol=0.02, atol=0.02)


@pytest.mark.slow
def test_compiled_decode_equals_eager_without_recompiling(model):
    from torch._dynamo.utils import counters

    ids, mask, images = left_padded_batch()
    eager = model.generate(ids, images, mask, max_new_tokens=16, greedy=True)
    counters.clear()
    compiled = model.generate(ids, images, mask, max_new_tokens=16, greedy=True, compile=True)
    assert torch.equal(compiled, eager)
    frames = sum(counters["frames"].values())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    again = model.generate(ids, images, mask, max_new_tokens=16, greedy=True, compile=True)
    assert torch.equal(again, eager) and counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters)
    assert sum(counters["frames"].values()) >= frames


@pytest.mark.slow
def test_compiled_decode_reuses_its_graph_across_lengths(model):
    from torch._dynamo.utils import counters

    ids, mask, images = left_padded_batch()
    model.generate(ids, images, mask, max_new_tokens=4, greedy=True, compile=True)
    counters.clear()
    shorter = (ids[[0, 2], 5:], images[[0, 2]], mask[[0, 2], 5:])  # prompts of 9 and 12 tokens, less padding
    for (batch_ids, batch_images, batch_mask), new_tokens in [((ids, images, mask), 9), (shorter, 30)]:
        eager = model.generate(batch_ids, batch_images, batch_mask, max_new_tokens=new_tokens, greedy=True)
        compiled = model.generate(batch_ids, batch_images, batch_mask, max_new_tokens=new_tokens, greedy=True, compile=True)
        assert torch.equal(compiled, eager)
    # batch 3 reuses the first graph; batch 2 needs its own, once (lengths never force a recompile)
    assert counters["stats"]["unique_graphs"] <= 1, dict(counters)
