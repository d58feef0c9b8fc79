"""benchmarks/decode.py: every method it times generates the same greedy tokens from the same weights."""

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig
from tests.models.helpers import tiny_vlm

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("decode_benchmark", ROOT / "benchmarks" / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # compiles transformers' static-cache decode (~15 s on 2 cores)
def test_every_method_generates_the_reference_tokens():
    from transformers import LlamaConfig, LlamaForCausalLM

    decode = load_benchmark()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=64,
                                             eos_token_id=None, bos_token_id=None)).eval()
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory)
        vision = VisionConfig(image_size=32, patch_size=16, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2)
        ours = VisionLanguageModel.from_backbones(VLMConfig(vision=vision,
                                                            language=LanguageConfig(pretrained=directory))).eval()
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[:, ids.shape[1]:]
        for method in decode.METHODS:  # the static+compile one raised TypeError with transformers >= 5.17
            assert torch.equal(decode.make_runner(method, reference, ours)(ids, 6), expected), method


def test_kernels_per_step_sees_the_three_matmuls_a_block_saves_by_fusing():
    """The benchmark's kernel count (on a CPU: the operators an eager step calls) drops by exactly three a
    block (q/k/v -> one, gate/up -> one) with fused projections."""
    decode = load_benchmark()
    model = tiny_vlm()
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        counts = {method: sum(decode.kernels_per_step(decode.make_runner(method, None, model), ids, 6,
                                                      torch.device("cpu")).values())
                  for method in ("tinyvlm eager", "tinyvlm fused eager")}
    assert counts["tinyvlm eager"] - counts["tinyvlm fused eager"] == 3 * model.config.language.num_layers
