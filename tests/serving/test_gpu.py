"""The engine's GPU fast path (skipped without CUDA): the decode step replayed from a CUDA graph per batch
bucket (eager or torch.compile'd before the capture) gives the eager step's tokens for every bucket, nothing
is captured after start-up, and a decode step syncs with the device only for its one copy of the sampled
ids, and overlapped steps (the default) give the tokens of steps read one at a time."""

import pytest
import torch

from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestParams
from tests.models.helpers import tiny_vlm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_NUM_SEQS = 40  # buckets 1, 2, 4, 8, 16, 32, 40


def _requests(count: int, max_tokens: int = 12) -> list[Request]:
    generator = torch.Generator().manual_seed(count)
    return [Request(torch.randint(3, 90, (int(torch.randint(5, 60, (1,), generator=generator)),),
                                  generator=generator).tolist(), None,
                    RequestParams(greedy=True, max_tokens=max_tokens, ignore_eos=True)) for _ in range(count)]


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(seed=1).cuda()


def _engine(model, cuda_graphs: bool, compile_decode: bool = False, overlap: bool | None = None) -> Engine:
    return Engine(model, config=ServingConfig(
        num_blocks=600, block_size=16, max_num_seqs=MAX_NUM_SEQS, max_batch_tokens=4096, attention="triton",
        cuda_graphs=cuda_graphs, compile_decode=compile_decode, overlap=overlap))


def test_graphed_decode_equals_eager_for_every_bucket_without_capturing_again(model):
    graphed, eager = _engine(model, cuda_graphs=True), _engine(model, cuda_graphs=False)
    graphs = dict(graphed.runner.graphs.graphs)
    assert sorted(graphs) == [1, 2, 4, 8, 16, 32, 40]
    for count in (1, 2, 3, 4, 7, 8, 13, 16, 31, 32, 33, 40):  # every bucket, full and padded
        requests = _requests(count)
        assert [r.token_ids for r in graphed.generate(requests)] == [
            r.token_ids for r in eager.generate(requests)
        ], count
    assert graphed.runner.graphs.graphs == graphs  # the same graph objects: no capture after start-up


def test_the_default_engine_captures_its_graphs(model):
    """Engine(model) with no flags, as the server and lmms-eval make it: the Triton kernel, a graph per
    bucket, admission in batches of max_num_seqs / 8 (the default once ran eagerly, one admission at a
    time)."""
    engine = Engine(model, config=ServingConfig(num_blocks=600, block_size=16, max_num_seqs=MAX_NUM_SEQS))
    assert engine.settings.attention == "triton" and engine.runner.graphs is not None
    assert sorted(engine.runner.graphs.graphs) == [1, 2, 4, 8, 16, 32, 40]
    assert engine.scheduler.admission_batch == MAX_NUM_SEQS // 8
    assert engine.settings.overlap


def test_overlapped_steps_give_the_tokens_of_steps_read_at_once(model):
    """Overlapped (the GPU default), each step's ids are read after the next step is launched and its decode
    tokens are read on the device: greedy samples ending by their own stop tokens at many steps, and seeded
    samples with log-probabilities, get what the engine reading each step at once gives them."""
    serial = _engine(model, cuda_graphs=True, overlap=False)
    requests = _requests(24, max_tokens=20)
    first = serial.generate(requests)
    stopping = [Request(request.prompt, None, RequestParams(greedy=True, max_tokens=20,
                                                            stop_token_ids=(result.token_ids[0][2 + i % 9],)))
                for i, (request, result) in enumerate(zip(requests, first))]
    stopping += [Request(request.prompt, None, RequestParams(temperature=0.9, top_p=0.9, max_tokens=20, n=2,
                                                             seed=i, logprobs=2, ignore_eos=True))
                 for i, request in enumerate(requests[:6])]
    expected = serial.generate(stopping)
    overlapped = _engine(model, cuda_graphs=True)
    assert overlapped.settings.overlap
    results = overlapped.generate(stopping)
    assert [(r.token_ids, r.finish_reasons) for r in results] == [(r.token_ids, r.finish_reasons)
                                                                  for r in expected]
    assert sum(r.finish_reasons == ["stop"] for r in expected) >= 20
    for result, reference in zip(results[24:], expected[24:]):  # the rows of a step differ: float32 rounding
        for entries, reference_entries in zip(result.logprobs, reference.logprobs):
            assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in reference_entries],
                                                                 abs=1e-4)


def test_the_compiled_decode_captured_per_bucket_gives_the_eager_tokens_and_compiles_twice(model):
    """torch.compile'd before the capture (the Triton kernel inside the compiled graph): one compile for
    the buckets of many rows, one for a single row; and one for the prompt chunks (compile_prefill follows
    compile_decode; the Triton kernel's grid symbolic), none while serving."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, eager = _engine(model, True, compile_decode=True), _engine(model, cuda_graphs=False)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    for count in (1, 3, 8, 13, 32, 40):
        requests = _requests(count)
        assert [r.token_ids for r in compiled.generate(requests)] == [
            r.token_ids for r in eager.generate(requests)
        ], count
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


def test_graphed_engine_equals_generate_alone_in_float32(model):
    graphed = _engine(model, cuda_graphs=True)
    requests = _requests(12, max_tokens=16)
    for request, result in zip(requests, graphed.generate(requests)):
        alone = model.generate(torch.tensor([request.prompt], device="cuda"), max_new_tokens=16, greedy=True)
        assert result.token_ids[0] == alone[0].tolist()


def _decoding(engine: Engine, params: RequestParams, count: int) -> Engine:
    """`engine` with `count` requests added and stepped until every one of them decodes."""
    for request in _requests(count):
        engine.add_request(Request(request.prompt, None, params))
    while engine.scheduler.waiting or not all(s.decoding for g in engine.scheduler.running for s in g.live):
        engine.step()
    return engine


def _steps_without_syncs(engine: Engine, steps: int) -> None:
    """`steps` steps under CUDA's sync debug mode, which raises on any synchronizing operation (the wait
    for the sampled ids is on the event of their non-blocking copy into pinned memory, which it does not
    count)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("params", [RequestParams(greedy=True, max_tokens=40, ignore_eos=True),
                                    RequestParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=40,
                                                  ignore_eos=True)], ids=["greedy", "sampled"])
def test_a_decode_step_does_not_sync_with_the_device(model, params):
    _steps_without_syncs(_decoding(_engine(model, cuda_graphs=True), params, 24), 20)


def test_a_step_that_starts_an_image_request_does_not_sync_with_the_device(model):
    """An image request joining running decodes: its pixels (pinned when the request is prepared) go to the
    device without the host waiting, so the overlapped step that runs its vision tower and prompt chunk does
    not sync either (a copy from pageable memory would wait for the step before)."""
    from tests.models.generation_helpers import IMAGE_ID, TOKENS_PER_IMAGE

    engine = _decoding(_engine(model, cuda_graphs=True),
                       RequestParams(greedy=True, max_tokens=30, ignore_eos=True), 8)
    prompt = [5, 6, *[IMAGE_ID] * TOKENS_PER_IMAGE, 7, 8, 9]
    pixels = torch.randn(1, 3, model.config.vision.image_size, model.config.vision.image_size)
    engine.add_request(Request(prompt, pixels, RequestParams(greedy=True, max_tokens=5), request_id="image"))
    assert engine.groups["image"].images.is_pinned()
    _steps_without_syncs(engine, 5)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_engine_captures_its_graphs_and_gives_the_eager_tokens(method):
    """torchao's CUDA weights (int8; int4's tile-packed tinygemm layout, bfloat16 only) inside the captured
    decode step: a graph per bucket, and the tokens of the same quantized engine run eagerly."""
    from models.quantize import quantize
    from tests.models.helpers import fused_copy

    pytest.importorskip("torchao")
    model = quantize(fused_copy(tiny_vlm(seed=1)).cuda().to(torch.bfloat16), method)
    graphed, eager = _engine(model, cuda_graphs=True), _engine(model, cuda_graphs=False)
    assert sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8, 16, 32, 40]
    for count in (1, 3, 16, 33):
        requests = _requests(count)
        assert [r.token_ids for r in graphed.generate(requests)] == [
            r.token_ids for r in eager.generate(requests)
        ], count
