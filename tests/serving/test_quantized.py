"""The engine serves a quantized model (models/quantize.py) with the quantized model's own greedy tokens
(`generate` on each request alone), under continuous batching, chunked prefill and preemption."""

import pytest

from models.quantize import quantize
from serving.config import ServingConfig
from serving.engine import Engine
from tests.models.helpers import INT8_DYNAMIC, fused_copy, tiny_vlm
from tests.serving.test_engine import _alone, _requests, _serve

pytest.importorskip("torchao")


@pytest.mark.parametrize("method", ["int4", INT8_DYNAMIC])
def test_a_quantized_model_serves_its_own_greedy_tokens(method):
    """int4: torchao's packed tinygemm weight (int8's plain int8 weight takes the same path: the engine leaves
    tensor-subclass weights to their own forward); int8-dynamic: each row of a batch rounded to int8 with its
    own scale, so a request's rows compute as they do alone."""
    model = quantize(fused_copy(tiny_vlm(seed=1)), method)  # fused, then quantized, as load_for_inference
    requests = _requests()
    engine = Engine(model, config=ServingConfig(num_blocks=40, block_size=8, max_num_seqs=8,
                                                max_batch_tokens=10))
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i


def test_the_server_quantizes_at_load_and_says_so_at_start_up_and_in_health(monkeypatch, capsys):
    """`--quantize int8`: load_for_inference fuses, then quantizes; a start-up line and /health say so."""
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi.testclient import TestClient

    import loading
    import serving.server
    from data.chat_processors import ChatProcessor
    from tests.models.helpers import base_tokenizer, chat_vlm

    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    monkeypatch.setattr(loading, "load_with_processor",
                        lambda *args: (model, ChatProcessor.from_config(model.config, tokenizer)))
    health = []
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda self: health.append(TestClient(self.config.app).get("/health").json()))
    assert serving.server.main(["--device", "cpu", "--quantize", "int8", "--kv-cache-mib", "1"]) == 0
    assert health[0]["quantization"] == {"language": "int8"}
    assert type(model.language.blocks[0].attn.qkv_proj.weight).__name__ == "Int8Tensor"  # fused, then int8
    weights = [line for line in capsys.readouterr().err.splitlines() if line.startswith("weights: ")]
    float_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert weights[0].endswith(f" (language int8; {float_mib:.1f} MiB in float32)"), weights
