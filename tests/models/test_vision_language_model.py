"""The VLM's splice of image features into the token embeddings, and its loss."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import models.linear_cross_entropy as chunked_loss
from models import VisionLanguageModel
from tests.models.helpers import tiny_vlm, tiny_vlm_config

IMAGE_ID = 95


def test_image_embeddings_land_exactly_on_the_image_token_positions():
    model = tiny_vlm()
    ids = torch.randint(3, 90, (2, 14), generator=torch.Generator().manual_seed(0))
    ids[0, 2:6] = IMAGE_ID          # row 0: one image
    ids[1, 1:5] = IMAGE_ID          # row 1: two images
    ids[1, 8:12] = IMAGE_ID
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        embedded = model.embed(ids, images)
        features = model.projector(model.vision(images))  # [3 images, 4 tokens, 64]
        text = model.language.token_embedding(ids)
    torch.testing.assert_close(embedded[0, 2:6], features[0])
    torch.testing.assert_close(embedded[1, 1:5], features[1])
    torch.testing.assert_close(embedded[1, 8:12], features[2])
    is_text = ids != IMAGE_ID
    torch.testing.assert_close(embedded[is_text], text[is_text])


def test_loss_counts_only_positions_with_targets():
    model = tiny_vlm()
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    targets = torch.full_like(ids, -100)
    targets[0, 3:6], targets[1, 7] = ids[0, 4:7], ids[1, 8]
    logits, loss = model(ids, None, targets=targets)
    kept = targets != -100
    torch.testing.assert_close(loss, F.cross_entropy(logits[kept], targets[kept]))


def test_gradients_reach_every_part():
    model = tiny_vlm().train()
    ids = torch.randint(3, 90, (1, 10))
    ids[0, 1:5] = IMAGE_ID
    targets = ids.roll(-1, 1)
    model(ids, torch.randn(1, 3, 32, 32), targets=targets)[1].backward()
    for part in (model.vision, model.projector, model.language):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters()), part


def test_bf16_autocast_trains_and_matches_float32():
    """Mixed precision (as train.py runs it on a GPU; CPU autocast takes the same path): the bfloat16
    projector output is spliced into the float32 embeddings, and the loss stays within bfloat16 noise of
    float32's."""
    model = tiny_vlm().train()
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(2))
    ids[0, 1:5] = IMAGE_ID
    images = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    _, reference = model(ids, images, targets=ids.roll(-1, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(ids, images, targets=ids.roll(-1, 1))
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=0.02, atol=0.02)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_packed_training_forward_compiles_as_one_graph():
    """train.compile: the forward of a packed batch with images is one graph (no host read-back) and gives the
    eager losses."""
    torch._dynamo.reset()
    model = tiny_vlm().train()
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(4))
    ids[0, 1:5], ids[0, 9:13], ids[1, 2:6] = IMAGE_ID, IMAGE_ID, IMAGE_ID
    mask = torch.tensor([[1] * 8 + [2] * 8, [1] * 12 + [0] * 4])  # row 0: two packed sequences; row 1: padded
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    _, losses = compiled(ids, images, mask, targets=ids.roll(-1, 1), reduction="none")
    torch.testing.assert_close(losses, model(ids, images, mask, targets=ids.roll(-1, 1), reduction="none")[1])


def test_wrong_number_of_images():
    model = tiny_vlm()
    ids = torch.full((1, 6), 5)
    ids[0, :4] = IMAGE_ID
    with pytest.raises(ValueError, match="hold 4 image tokens but the images give 0"):
        model(ids, None)


def test_resizing_the_vocabulary_keeps_the_rest_of_the_config():
    model = VisionLanguageModel(tiny_vlm_config())
    model.resize_token_embeddings(120, image_token_id=119)
    assert model.config == dataclasses.replace(tiny_vlm_config(vocab_size=120), image_token_id=119)


def _saved_elements_loss_and_grads(model, ids, images, targets, **options) -> tuple[int, torch.Tensor, dict]:
    """Elements kept for the backward pass, the loss, and every gradient, for one forward and backward."""
    model.zero_grad()
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _, loss = model(ids, images, targets=targets, **options)
    loss.backward()
    return sum(saved), loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                       if p.grad is not None}


def test_activation_checkpointing_keeps_less_for_the_same_loss_and_gradients():
    """float64, so that the recomputed forward's equality does not rest on which CPU kernels ran."""
    model = tiny_vlm(seed=3).double().train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (2, 14), generator=generator)
    ids[:, 2:6] = IMAGE_ID
    images = torch.randn(2, 3, 32, 32, generator=generator, dtype=torch.float64)
    targets = ids.roll(-1, 1)
    kept, loss, grads = _saved_elements_loss_and_grads(model, ids, images, targets)
    kept_checkpointed, loss_checkpointed, grads_checkpointed = _saved_elements_loss_and_grads(
        model, ids, images, targets, checkpoint_activations=True
    )
    assert kept_checkpointed < 0.6 * kept
    torch.testing.assert_close(loss_checkpointed, loss, atol=1e-12, rtol=0)
    assert grads_checkpointed.keys() == grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        torch.testing.assert_close(grads_checkpointed[name], grad, atol=1e-12, rtol=0, msg=name)


def _losses_and_gradients(model, forward, ids, images, mask, targets, **options
                          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A training forward's per-position losses through `forward` (the model or its compiled form), and the
    gradients of their sum."""
    model.zero_grad()
    _, losses = forward(ids, images, mask, targets, reduction="none", return_logits=False, **options)
    losses.sum().backward()
    return losses.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("activation_checkpointing, chunked", [(False, False), (True, False), (False, True)])
def test_the_training_forward_compiles_as_one_graph_and_computes_what_eager_does(
        activation_checkpointing, chunked, monkeypatch):
    """torch.compile(fullgraph=True) of a training step's forward (packed records, padding, per-position
    losses; the loss a chunk at a time, or not): no graph break anywhere (a break raises), and the same losses
    and gradients as eager. aot_eager traces forward and backward as inductor would, without compiling kernels
    (seconds on a CPU)."""
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 10 * 96)  # 48 positions: 5 chunks
    torch._dynamo.reset()
    model = tiny_vlm(seed=4).train()
    config = model.config
    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 1 : 1 + config.tokens_per_image] = config.image_token_id
    images = torch.randn(2, 3, config.vision.image_size, config.vision.image_size)
    targets = ids.roll(-1, 1)
    targets[:, : 1 + config.tokens_per_image] = -100
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[:, 14:20] = 2  # a second record packed into each row
    mask[1, 20:] = 0  # and padding
    options = {"checkpoint_activations": activation_checkpointing, "chunked_loss": chunked}
    eager, eager_grads = _losses_and_gradients(model, model, ids, images, mask, targets, **options)
    compiled, compiled_grads = _losses_and_gradients(
        model, torch.compile(model, fullgraph=True, backend="aot_eager"), ids, images, mask, targets,
        **options
    )
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
    for expected, got in zip(eager_grads, compiled_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_the_loss_without_logits_equals_the_loss_from_them(tie, monkeypatch):
    """return_logits=False with chunked_loss (train.chunked_loss) computes the head and the loss a chunk
    of positions at a time where the logits would be large: the same losses, for every reduction, and the same
    gradients (float64: equal but for the order of the sums, on any CPU)."""
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 7 * 96)  # 2 x 16 positions: 5 chunks
    model = tiny_vlm(seed=6, tie_word_embeddings=tie).double().train()
    ids = torch.randint(3, 90, (2, 16), generator=torch.Generator().manual_seed(1))
    ids[:, 1:5] = IMAGE_ID
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    targets = ids.roll(-1, 1)
    targets[:, :5] = -100
    for reduction in ("none", "mean", "sum"):
        results = []
        for return_logits in (True, False):
            model.zero_grad()
            logits, loss = model(ids, images, targets=targets, reduction=reduction,
                                 return_logits=return_logits, chunked_loss=True)
            assert (logits is None) == (not return_logits)
            loss.sum().backward()
            results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
        (plain, plain_grads), (chunked, chunked_grads) = results
        torch.testing.assert_close(chunked, plain, atol=1e-12, rtol=1e-12)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(chunked_grads[name], grad, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward pass needs a CUDA GPU")
def test_flex_attention_trains_as_the_dense_mask_does_on_a_gpu():
    """A compiled training forward and backward of packed, padded rows through FlexAttention: the losses and
    gradients of eager SDPA under the dense mask (float32)."""
    torch._dynamo.reset()
    model = tiny_vlm(seed=4).cuda().train()
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (2, 300), generator=generator)
    ids[:, 1 : 1 + config.tokens_per_image] = config.image_token_id
    images = torch.randn(2, 3, config.vision.image_size, config.vision.image_size, generator=generator)
    targets = ids.roll(-1, 1)
    targets[:, : 1 + config.tokens_per_image] = -100
    mask = torch.ones(2, 300, dtype=torch.long)
    # a second record packed into each row from 130 on: the keys' first 128-token tile is all masked for the
    # queries of the third, which the kernel skips
    mask[:, 130:] = 2
    mask[1, 280:] = 0  # and padding
    ids, images, targets, mask = (t.cuda() for t in (ids, images, targets, mask))
    dense, dense_grads = _losses_and_gradients(model, model, ids, images, mask, targets)
    flex, flex_grads = _losses_and_gradients(model, torch.compile(model, fullgraph=True), ids, images, mask,
                                             targets, flex_attention=True)
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    for expected, got in zip(dense_grads, flex_grads, strict=True):  # float32 rounding grows with gradients
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got, expected, atol=5e-5 * scale, rtol=1e-3)
