"""generate(): cached against uncached, batched against alone, stopping, samples from one prefill,
streaming."""

import pytest
import torch

from models import GenerationError
from tests.models.generation_helpers import left_pad_prompts, make_prompt
from tests.models.helpers import tiny_vlm


@pytest.fixture(scope="module")
def model():
    return tiny_vlm()


@pytest.fixture(scope="module")
def batch():
    prompts = [make_prompt(n, seed) for seed, n in enumerate((9, 17, 12))]
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return prompts, images


def test_cached_equals_uncached_on_a_left_padded_batch(model, batch):
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts)
    settings = dict(max_new_tokens=24, greedy=True)
    cached = model.generate(ids, images, mask, **settings)
    uncached = model.generate(ids, images, mask, use_cache=False, **settings)
    assert cached.shape == (3, 24)
    assert len(set(cached.flatten().tolist())) > 5  # the random model really wanders
    assert torch.equal(cached, uncached)


def test_left_padded_batch_equals_each_prompt_alone(model, batch):
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts)
    together = model.generate(ids, images, mask, max_new_tokens=20, greedy=True)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], images[row : row + 1], max_new_tokens=20, greedy=True)
        assert torch.equal(together[row], alone[0]), f"row {row}"


def test_stops_each_row_at_eos_and_ends_when_all_are_done(model, batch):
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts)
    free = model.generate(ids, images, mask, max_new_tokens=40, greedy=True)
    eos = int(free[0, 2])
    stopped = model.generate(ids, images, mask, max_new_tokens=40, greedy=True, eos_token_id=eos,
                             pad_token_id=0)
    for row in range(3):
        hits = (free[row] == eos).nonzero()
        if len(hits):
            end = int(hits[0]) + 1
            assert torch.equal(stopped[row, :end], free[row, :end])
            assert (stopped[row, end:] == 0).all()
    alone = model.generate(prompts[0][None], images[:1], max_new_tokens=40, greedy=True, eos_token_id=eos)
    assert alone.shape[1] < 40 and int(alone[0, 2]) == eos  # the loop ended soon after the only row finished


def test_num_samples_reuse_one_prefill(model, batch, monkeypatch):
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts[:2])
    greedy_one = model.generate(ids, images[:2], mask, max_new_tokens=12, greedy=True)
    calls = []
    original = model.vision.forward
    monkeypatch.setattr(model.vision, "forward", lambda x, *a: calls.append(x.shape[0]) or original(x, *a))
    prefill_batches = []
    language_forward = model.language.forward
    monkeypatch.setattr(model.language, "forward",
                        lambda e, *a, **k: (prefill_batches.append(e.shape) if e.shape[1] > 1 else None)
                        or language_forward(e, *a, **k))
    greedy_three = model.generate(ids, images[:2], mask, max_new_tokens=12, greedy=True, num_samples=3)
    assert calls == [2] and prefill_batches == [torch.Size([2, ids.shape[1], 64])]
    assert torch.equal(greedy_three, greedy_one.repeat_interleave(3, 0))


def test_sampled_generation_is_reproducible_with_a_seed(model, batch):
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts)
    settings = dict(max_new_tokens=16, temperature=1.5, top_k=20, top_p=0.9, num_samples=2)
    first = model.generate(ids, images, mask, generator=torch.Generator().manual_seed(7), **settings)
    second = model.generate(ids, images, mask, generator=torch.Generator().manual_seed(7), **settings)
    other = model.generate(ids, images, mask, generator=torch.Generator().manual_seed(8), **settings)
    assert torch.equal(first, second) and not torch.equal(first, other)


def test_stream_yields_the_generated_tokens_step_by_step(model, batch):
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts)
    steps = list(model.stream(ids, images, mask, max_new_tokens=10, greedy=True))
    assert len(steps) == 10 and all(s.shape == (3,) for s in steps)
    assert torch.equal(torch.stack(steps, 1),
                       model.generate(ids, images, mask, max_new_tokens=10, greedy=True))


@pytest.mark.parametrize("compile", [False, True])
def test_stream_ends_at_the_step_every_row_has_stopped(model, batch, compile):
    """Regression: a finished row kept yielding its stop token (as the pad) for up to 7 more steps, so the
    README's loop printed `<|im_end|>` seven times after the answer. Each row's stop is its 4th or 6th greedy
    token; the stream ends with the last of them, the row that stopped first yielding pads meanwhile."""
    prompts, images = batch
    ids, mask = left_pad_prompts(prompts[:2])
    free = model.generate(ids, images[:2], mask, max_new_tokens=10, greedy=True)
    stops = [int(free[0, 3]), int(free[1, 5])]
    first = [next(i for i, t in enumerate(row) if t in stops) for row in free.tolist()]
    steps = list(model.stream(ids, images[:2], mask, max_new_tokens=10, greedy=True, eos_token_id=stops,
                              pad_token_id=0, compile=compile))
    assert len(steps) == max(first) + 1 < 10
    for row, end in enumerate(first):
        assert [int(s[row]) for s in steps[: end + 1]] == free[row, : end + 1].tolist()
        assert all(int(s[row]) == 0 for s in steps[end + 1 :])
    alone = list(model.stream(prompts[0][None], images[:1], max_new_tokens=10, greedy=True,
                              eos_token_id=stops[0]))
    assert torch.cat(alone).tolist() == free[0, : first[0] + 1].tolist()  # ends at its stop token
    generated = model.generate(ids, images[:2], mask, max_new_tokens=10, greedy=True, eos_token_id=stops,
                               pad_token_id=0)
    assert torch.equal(generated[:, : len(steps)], torch.stack(steps, 1))  # generate checks every 8 steps


@pytest.mark.parametrize("settings, message", [
    (dict(max_new_tokens=200), "exceeds the context of 128"),
    (dict(max_new_tokens=0), "max_new_tokens and num_samples must be >= 1"),
    (dict(num_samples=0), "max_new_tokens and num_samples must be >= 1"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must lie in"),
    (dict(top_k=-2), "top_k must be >= 0"),
])
def test_bad_settings_are_clear_errors(model, batch, settings, message):
    prompts, images = batch
    with pytest.raises(ValueError, match=message):
        model.generate(prompts[0][None], images[:1], **settings)


def test_image_count_must_match_the_placeholders(model, batch):
    prompts, images = batch
    with pytest.raises(ValueError, match="hold 4 image tokens but the images give 8"):
        model.generate(prompts[0][None], images[:2], max_new_tokens=2)


def test_prompt_longer_than_context_is_a_generation_error(model):
    with pytest.raises(GenerationError):
        model.generate(torch.full((1, 130), 5), None, max_new_tokens=1)
