"""Fused projections (models/fused_linear.py): a fused model computes what it did, generates the same tokens
(eager and compiled), and its state dict, saved checkpoints and loading keep the separate layers' tensors."""

import pytest
import torch
from safetensors.torch import load_file

from models import CheckpointError, VisionLanguageModel
from models.fused_linear import FusedLinear
from models.lora import add_adapters
from models.weights import load_checked
from tests.models.helpers import fused_copy, tiny_vlm

IMAGE_ID = 95


def _inputs():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (2, 12), generator=generator)
    ids[:, 1:5] = IMAGE_ID
    return ids, torch.randn(2, 3, 32, 32, generator=generator)


def test_every_block_runs_one_matmul_for_qkv_and_one_for_gate_up():
    model = tiny_vlm().fuse_projections()
    fused = {name: module.parts for name, module in model.named_modules() if isinstance(module, FusedLinear)}
    assert fused["language.blocks.0.attn.qkv_proj"] == {"q_proj": 64, "k_proj": 32, "v_proj": 32}
    assert fused["language.blocks.2.mlp.gate_up_proj"] == {"gate_proj": 128, "up_proj": 128}
    assert fused["vision.blocks.1.attn.qkv_proj"] == {"q_proj": 32, "k_proj": 32, "v_proj": 32}
    assert len(fused) == 3 * 2 + 2  # 3 LM blocks (attention and MLP), 2 ViT blocks
    assert not any(name.endswith(("q_proj", "gate_proj")) for name, _ in model.named_modules())


def test_a_fused_model_computes_and_generates_what_it_did():
    model = tiny_vlm(seed=1)
    fused = fused_copy(model)
    ids, images = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, images)[0], model(ids, images)[0], atol=1e-5, rtol=0)
    for compile in (False, True):
        expected = model.generate(ids, images, max_new_tokens=10, greedy=True, compile=compile)
        assert torch.equal(fused.generate(ids, images, max_new_tokens=10, greedy=True, compile=compile),
                           expected), compile


def test_the_state_dict_and_checkpoints_keep_the_separate_tensors(tmp_path):
    model = tiny_vlm(seed=2)
    fused = fused_copy(model)
    state, fused_state = model.state_dict(), fused.state_dict()
    assert list(fused_state) == list(state)
    assert all(torch.equal(fused_state[name], tensor) for name, tensor in state.items())
    fused.save_pretrained(tmp_path / "fused")  # and back into an unfused model: the same weights
    saved = load_file(tmp_path / "fused" / "model.safetensors")
    assert all(torch.equal(saved[name], tensor) for name, tensor in state.items() if name in saved)
    reloaded = VisionLanguageModel.from_pretrained(tmp_path / "fused")
    assert all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in state.items())


def test_a_fused_model_loads_a_checkpoints_separate_tensors():
    source, target = tiny_vlm(seed=3), tiny_vlm(seed=4).fuse_projections()
    target.load_state_dict(source.state_dict())
    ids, images = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(target(ids, images)[0], source(ids, images)[0], atol=1e-5, rtol=0)
    partial = {k: v for k, v in source.state_dict().items() if "language.blocks.0.attn.q_proj" not in k}
    with pytest.raises(CheckpointError, match=r"missing keys: language\.blocks\.0\.attn\.q_proj\.weight$"):
        load_checked(target, partial)  # as every loader checks a checkpoint


def test_adapted_layers_do_not_fuse():
    model = tiny_vlm()
    add_adapters(model, rank=2, alpha=4, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"only plain nn.Linear layers.*q_proj peft\.tuners\.lora"):
        model.fuse_projections()
