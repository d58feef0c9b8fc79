"""generate(compile=True) gives the eager path's tokens: its shape-static decode step compiles once per cache
bucket and batch bucket, its prefill once for every prompt (each call compiles a prefill graph and a decode
graph the first time)."""

from copy import deepcopy

import pytest
import torch

from models.errors import InputError
from models.kv_cache import CacheCapacityError, Preallocated, with_layout
from tests.models.generation_helpers import left_padded_batch
from tests.models.helpers import tiny_vlm


@pytest.fixture(scope="module")
def model():
    torch._dynamo.reset()
    return tiny_vlm()


def test_tensor_position_step_equals_int_position_step(model):
    """The step the compiled path runs (tensor start_pos, attention over the whole cache) matches eager
    slicing."""
    ids, mask, images = left_padded_batch()
    eager = model.generate(ids, images, mask, max_new_tokens=12, greedy=True)
    with torch.inference_mode():
        embeddings = model.embed(ids, images)
        full_mask = torch.ones(3, ids.shape[1] + 12, dtype=torch.long)
        full_mask[:, : ids.shape[1]] = mask
        cache = model.language.allocate_kv_cache(3, ids.shape[1] + 12)
        hidden, cache = model.language(embeddings, full_mask, cache)
        cache = with_layout(cache, Preallocated(shape_static=True))
        token = model.language.head(hidden[:, -1]).argmax(-1)
        position, tokens = torch.tensor(ids.shape[1]), []
        for _ in range(12):
            tokens.append(token)
            token = model.decode_step(token, full_mask, cache, position).argmax(-1)
            position += 1
    assert torch.equal(torch.stack(tokens, 1), eager)


def test_tensor_position_step_under_bf16_autocast(model):
    """Under autocast the projections give bfloat16 K/V for the float32 cache: the in-place write casts them,
    as the int-position path's slice assignment does, and both steps give the same logits."""
    ids, mask, images = left_padded_batch()
    full_mask = torch.ones(3, ids.shape[1] + 1, dtype=torch.long)
    full_mask[:, : ids.shape[1]] = mask
    logits = []
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for start_pos in (ids.shape[1], torch.tensor(ids.shape[1])):
            cache = model.language.allocate_kv_cache(3, ids.shape[1] + 1)
            hidden, cache = model.language(model.embed(ids, images), full_mask, cache)
            if isinstance(start_pos, torch.Tensor):
                cache = with_layout(cache, Preallocated(shape_static=True))
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
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # the prefill, the decode step
    again = model.generate(ids, images, mask, max_new_tokens=16, greedy=True, compile=True)
    assert (torch.equal(again, eager) and counters["stats"]["unique_graphs"] == 2
            and not counters["recompiles"]), dict(counters)
    assert sum(counters["frames"].values()) >= frames


@pytest.mark.slow
def test_compiled_decode_takes_one_graph_per_cache_bucket():
    """Capacities (prompt + new tokens) are rounded up to 256-token buckets: lengths on both sides of the 256
    boundary take exactly one decode graph each, later lengths in a bucket reuse it, and every call gives the
    eager tokens (one prefill graph serves every capacity)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_vlm(max_position_embeddings=1024)
    ids, mask, images = left_padded_batch()  # 17 positions
    counters.clear()
    for new_tokens, graphs in [(200, 2), (239, 2), (240, 3), (100, 3)]:  # capacities 217, 256 | 257; 117
        eager = model.generate(ids, images, mask, max_new_tokens=new_tokens, greedy=True)
        compiled = model.generate(ids, images, mask, max_new_tokens=new_tokens, greedy=True, compile=True)
        assert torch.equal(compiled, eager), new_tokens
        assert counters["stats"]["unique_graphs"] == graphs, (new_tokens, dict(counters["stats"]))


@pytest.mark.slow
def test_compiled_decode_serves_more_batch_sizes_than_the_recompile_limit(model):
    """Regression: one graph per batch size hit dynamo's recompile limit (8) at the 9th size and raised.
    Batches are now padded to buckets (1, 2, 4, 8, 16, ...): sizes 1..11 take 5 decode graphs (+ the one
    prompt's prefill), and each size gives the eager tokens."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ids, mask, images = left_padded_batch()
    counters.clear()
    for samples in range(1, 12):
        settings = dict(max_new_tokens=5, temperature=0.9, num_samples=samples)
        eager = model.generate(ids[:1], images[:1], mask[:1],
                               generator=torch.Generator().manual_seed(samples), **settings)
        compiled = model.generate(ids[:1], images[:1], mask[:1], compile=True,
                                  generator=torch.Generator().manual_seed(samples), **settings)
        assert torch.equal(compiled, eager), samples
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])


@pytest.mark.slow
def test_the_compiled_prefill_takes_new_prompt_lengths_without_recompiling(model):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ids, mask, images = left_padded_batch()
    counters.clear()
    for extra in (0, 5, 11):  # text appended: prompts of 17, 22 and 28 tokens
        text = torch.randint(3, 90, (3, extra), generator=torch.Generator().manual_seed(extra))
        longer, longer_mask = torch.cat([ids, text], 1), torch.cat([mask, torch.ones_like(text)], 1)
        eager = model.generate(longer, images, longer_mask, max_new_tokens=4, greedy=True)
        compiled = model.generate(longer, images, longer_mask, max_new_tokens=4, greedy=True, compile=True)
        assert torch.equal(compiled, eager), extra
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one prefill, one decode step


@pytest.mark.slow
def test_the_decode_step_stays_shape_static_after_a_compiled_prefill():
    """Regression: the prefill marked its tensors' sizes dynamic, and at a batch that needs no padding the
    decode step took those very cache and mask tensors, so its graph turned symbolic in the cache length (one
    graph for every capacity instead of one per bucket)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_vlm(max_position_embeddings=1024)
    ids, mask, images = left_padded_batch()
    counters.clear()
    for new_tokens in (20, 300):  # capacities in the 256 and 512 buckets
        eager = model.generate(ids[:1], images[:1], mask[:1], max_new_tokens=new_tokens, greedy=True)
        compiled = model.generate(ids[:1], images[:1], mask[:1], max_new_tokens=new_tokens, greedy=True,
                                  compile=True)
        assert torch.equal(compiled, eager), new_tokens
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # a prefill, a decode per bucket


def test_a_compiled_generation_still_checks_the_image_tokens(model):
    """The compiled prefill cannot read the placeholders' count back: it is counted before it, eagerly."""
    ids, mask, images = left_padded_batch()
    with pytest.raises(InputError, match="image tokens but the images give"):
        model.generate(ids, images[:1], mask, max_new_tokens=2, compile=True)


@pytest.mark.slow
def test_compiled_decode_falls_back_to_eager_past_the_recompile_limit(model):
    torch._dynamo.reset()
    ids, mask, images = left_padded_batch()
    eager = model.generate(ids, images, mask, max_new_tokens=6, greedy=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        model.generate(ids[:1], images[:1], mask[:1], max_new_tokens=3, greedy=True, compile=True)
        with pytest.warns(UserWarning, match="recompile limit"):
            compiled = model.generate(ids, images, mask, max_new_tokens=6, greedy=True, compile=True)
    assert torch.equal(compiled, eager)


@pytest.mark.slow
def test_copies_and_reloaded_weights_decode_with_their_own_weights(model):
    """Regression: the compiled step was a bound method of the model it was built on, so a deep copy of a
    model that had decoded compiled kept decoding with the original's weights."""
    ids, mask, images = left_padded_batch()
    original = tiny_vlm(seed=3)
    original.generate(ids, images, mask, max_new_tokens=6, greedy=True, compile=True)
    other = tiny_vlm(seed=4)
    copy = deepcopy(original)
    copy.load_state_dict(other.state_dict())
    expected = other.generate(ids, images, mask, max_new_tokens=6, greedy=True)
    assert not torch.equal(expected, original.generate(ids, images, mask, max_new_tokens=6, greedy=True))
    assert torch.equal(copy.generate(ids, images, mask, max_new_tokens=6, greedy=True, compile=True),
                       expected)
    original.load_state_dict(other.state_dict())  # new weights into a model that has compiled
    assert torch.equal(original.generate(ids, images, mask, max_new_tokens=6, greedy=True, compile=True),
                       expected)


def test_decode_step_on_a_full_cache_is_an_error(model):
    """Regression: decode_step on a cache with no free slot silently attended to zeros (the write grew a
    private copy of the cache, which the step threw away)."""
    ids, _, images = left_padded_batch()
    with torch.inference_mode():
        cache = model.language.allocate_kv_cache(3, ids.shape[1])
        hidden, cache = model.language(model.embed(ids, images), None, cache)
        with pytest.raises(CacheCapacityError):
            model.decode_step(hidden[:, -1].argmax(-1), None, cache, ids.shape[1])
