"""The engine against `VisionLanguageModel.generate` run on each request alone: same tokens under continuous
batching, chunked prefill, preemption, prefix caching and n samples per request."""

import copy
import json

import pytest
import torch

from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestError, RequestParams
from tests.models.generation_helpers import IMAGE_ID, TOKENS_PER_IMAGE
from tests.models.helpers import TRITON_ON_CPU, fused_copy, tiny_vlm


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(seed=1)


def _prompt(length: int, seed: int, images: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (length,), generator=g).tolist()
    for i in range(images):  # placeholders after a little text, one token of text between images
        start = 2 + i * (TOKENS_PER_IMAGE + 1)
        ids[start : start + TOKENS_PER_IMAGE] = [IMAGE_ID] * TOKENS_PER_IMAGE
    return ids


def _images(count: int, seed: int) -> torch.Tensor | None:
    return torch.randn(count, 3, 32, 32,
                       generator=torch.Generator().manual_seed(100 + seed)) if count else None


def _alone(model, prompt, images, params: RequestParams, generator=None) -> list[list[int]]:
    """generate() on the request alone, each sample cut after its first stop token (the model's, and the
    request's own)."""
    rows = model.generate(torch.tensor([prompt]), images, max_new_tokens=params.max_tokens,
                          greedy=params.greedy, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, num_samples=params.n, eos_token_id=model.config.stop_ids,
                          generator=generator).tolist()
    cut = []
    for row in rows:
        stops = [i for i, token in enumerate(row)
                 if token in {*model.config.stop_ids, *params.stop_token_ids}]
        cut.append(row[: stops[0] + 1] if stops else row)
    return cut


def _requests():
    """Ten requests: prompts of 5-40 tokens, with 0, 1 or 2 images, 3-20 new tokens each."""
    specs = [(12, 1, 8), (5, 0, 20), (40, 2, 6), (17, 1, 12), (9, 0, 3), (30, 1, 15), (22, 2, 9), (6, 0, 18),
             (35, 1, 5), (14, 1, 10)]
    return [(_prompt(length, seed, images), _images(images, seed), RequestParams(greedy=True, max_tokens=new))
            for seed, (length, images, new) in enumerate(specs)]


def _serve(engine: Engine, requests, arrivals) -> dict[str, list[int]]:
    """Requests added at the given steps (arrival[i] for request i); returns each request's tokens."""
    tokens, step = {}, 0
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            prompt, images, params = requests[i]
            engine.add_request(Request(prompt, images, params, request_id=str(i)))
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_tokens[0])
        step += 1
        assert step < 2_000
    return tokens


@pytest.mark.parametrize("attention, num_blocks, block_size, budget", [
    ("gather", 200, 16, 512), ("gather", 14, 4, 16), ("gather", 40, 8, 10), ("sparse", 200, 16, 512),
    ("sparse", 14, 4, 16), ("sparse", 40, 8, 10),
    *(pytest.param("triton", *sizes, marks=TRITON_ON_CPU) for sizes in [(14, 4, 16), (40, 8, 10)]),
], ids=["gather-roomy", "gather-preempting", "gather-chunked", "sparse-roomy", "sparse-preempting",
        "sparse-chunked", "triton-preempting", "triton-chunked"])
def test_continuous_batching_gives_each_request_its_greedy_tokens(
    model, attention, num_blocks, block_size, budget
):
    """On a CPU the Triton kernel runs in Triton's interpreter (tests/conftest.py): ~14 s a case, so it runs
    the two that exercise preemption and chunked prefill over cached context."""
    requests = _requests()
    engine = Engine(model, config=ServingConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=8,
                                                max_batch_tokens=budget, attention=attention))
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i
    assert engine.blocks.num_free == engine.blocks.num_usable  # every block back
    assert sorted(engine.runner.inputs.free_rows) == list(range(8))  # every input row back
    engine.blocks.check()
    if num_blocks < 20:
        assert engine.scheduler.num_preemptions > 0
    if budget == 10:
        assert engine.stats()["preemptions"] == 0


def test_on_a_cpu_the_engine_packs_its_linears_and_serves_the_same_tokens_without(model, monkeypatch):
    """On a CPU the engine's linears run through oneDNN's prepacked weights (serving/packed_linear.py) unless
    pack_weights=False; both serve generate's tokens. A compiled decode or a bfloat16 model cannot pack."""
    import serving.packed_linear

    calls = []
    matmul = serving.packed_linear.packed_matmul
    monkeypatch.setattr(serving.packed_linear, "packed_matmul",
                        lambda *args: calls.append(1) or matmul(*args))
    requests = _requests()
    for pack in (True, False):
        calls.clear()
        engine = Engine(model, config=ServingConfig(num_blocks=200, block_size=16, max_num_seqs=8,
                                                    max_batch_tokens=512, pack_weights=pack))
        tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
        for i, (prompt, images, params) in enumerate(requests):
            assert tokens[str(i)] == _alone(model, prompt, images, params)[0], (pack, i)
        assert bool(calls) == pack
    with pytest.raises(ValueError, match="pack_weights"):
        Engine(model, config=ServingConfig(num_blocks=200, compile_decode=True, pack_weights=True))
    bfloat16 = Engine(copy.deepcopy(model).to(torch.bfloat16), config=ServingConfig(num_blocks=20))
    assert bfloat16.runner.model is bfloat16.model and bfloat16.settings.pack_weights is False


def test_a_float64_model_on_a_cpu_decodes_through_sparse_attention_and_serves_its_greedy_tokens(model):
    """The sparse path takes float32 and float64 (auto picks it for both on a CPU); a bfloat16 model, which
    its kernels refuse, is gathered."""
    model64 = copy.deepcopy(model).double()
    requests = [(_prompt(5 + 9 * i, 70 + i, 0), None, RequestParams(greedy=True, max_tokens=7 + i))
                for i in range(4)]
    engine = Engine(model64, config=ServingConfig(num_blocks=60, block_size=4, max_num_seqs=4,
                                                  max_batch_tokens=16))
    assert engine.settings.attention == "sparse"
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 2])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model64, prompt, images, params)[0], i
    bfloat16 = Engine(copy.deepcopy(model).to(torch.bfloat16), config=ServingConfig(num_blocks=20))
    assert bfloat16.settings.attention == "gather"


def test_a_model_with_fused_projections_serves_the_tokens_of_the_unfused_one(model):
    """load_for_inference fuses the projections of the models that generate.py and the server serve."""
    requests = _requests()
    engine = Engine(fused_copy(model), config=ServingConfig(num_blocks=40, block_size=8, max_num_seqs=8,
                                                            max_batch_tokens=10))
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i


@pytest.mark.parametrize("attention", ["gather", "sparse"])
def test_many_decode_rows_of_many_lengths_keep_their_greedy_tokens(model, monkeypatch, attention):
    """With many sequences of many lengths running, the tokens stay generate's: the eager gathered decode
    sorts its rows into groups that gather only their own longest tables (into one buffer every layer
    reuses); the sparse decode reads each row's context in place (a CPU's default; prompt chunks are
    gathered)."""
    import serving.paged_layout
    import serving.runner

    groups = []
    row_groups = serving.runner.row_groups
    monkeypatch.setattr(serving.runner, "row_groups", lambda lengths: groups.append(row_groups(lengths)) or
                        groups[-1])
    requests = [(_prompt(3 + 7 * i % 60, 50 + i, int(i % 3 == 0)), _images(int(i % 3 == 0), 50 + i),
                 RequestParams(greedy=True, max_tokens=6 + 3 * i % 17)) for i in range(32)]
    sparse_calls = []
    sparse = serving.paged_layout.sparse_paged_attention
    monkeypatch.setattr(serving.paged_layout, "sparse_paged_attention",  # decode calls, with the step's index
                        lambda *args: sparse_calls.append(args[-1] is not None) or sparse(*args))
    engine = Engine(model, config=ServingConfig(  # sparse: the CPU default
        num_blocks=600, block_size=4, max_num_seqs=32, max_batch_tokens=2048,
        attention="auto" if attention == "sparse" else attention))
    # the late ones prefill in steps that decode the others
    tokens = _serve(engine, requests, arrivals=[0] * 26 + [2, 3, 4, 5, 6, 7])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i
    if attention == "gather":  # groups of different widths ran
        assert groups and max(len(set(widths)) for _, widths in groups) >= 3 and not sparse_calls
    else:
        assert sparse_calls and all(sparse_calls) and not groups


def test_the_compiled_decode_forward_serves_the_eager_tokens_compiled_twice_at_start_up(model):
    """compile_decode through the gather path (a CPU's): batches of 1 to 8 rows and tables of changing width;
    compiled as the engine starts, once for many rows (symbolic sizes) and once for one row (and the prompt
    chunks once: compile_prefill follows compile_decode)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    requests = _requests()
    engine = Engine(fused_copy(model), config=ServingConfig(num_blocks=40, block_size=8, max_num_seqs=8,
                                                            max_batch_tokens=10, compile_decode=True))
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # compiled as the engine starts
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i
    # a request alone whose table is one block: one row, a table padded to two columns (a width of one was a
    # new compile in the middle of serving)
    short = [(_prompt(3, 50, 0), None, RequestParams(greedy=True, max_tokens=3))]
    assert _serve(engine, short, arrivals=[0])["0"] == _alone(model, *short[0])[0]
    # rows 1-8, tables 1-5 blocks: no compile while serving
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


def test_compiled_prompt_chunks_serve_the_eager_tokens_through_one_graph_compiled_at_start_up(model):
    """compile_prefill (the CPU's decode kernel beside it): prompt chunks of 1 to 10 tokens, one to several
    sequences a call, with images, all through the one graph compiled as the engine starts (padded calls:
    sizes of 0 and 1, and sizes equal when first seen, would each have compiled another mid-serving), each
    call's tables only as wide as its longest (every column would gather every sequence's whole context)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    requests = _requests()
    engine = Engine(model, config=ServingConfig(num_blocks=40, block_size=8, max_num_seqs=8,
                                                max_batch_tokens=10, compile_prefill=True))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # compiled as the engine starts
    calls, compiled = [], engine.runner.prefill_hidden
    engine.runner.prefill_hidden = lambda *args: calls.append(args[1].shape) or compiled(*args)
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i
    for length in (3, 1):  # one chunk alone: padded with a null one; of one token: a query of two too
        short = [(_prompt(length, 50, 0), None, RequestParams(greedy=True, max_tokens=3))]
        assert _serve(engine, short, arrivals=[0])["0"] == _alone(model, *short[0])[0]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    widest = max(width for _, width in calls)
    assert min(sequences for sequences, _ in calls) >= 2 and 2 <= widest < engine.runner.inputs.max_blocks


def test_requests_held_back_to_join_in_batches_keep_their_greedy_tokens(model):
    requests = _requests()
    engine = Engine(model, config=ServingConfig(num_blocks=200, block_size=8, max_num_seqs=4,
                                                max_batch_tokens=64, admission_batch=3))
    tokens = _serve(engine, requests, arrivals=[0, 0, 1, 3, 3, 4, 8, 9, 15, 15])
    for i, (prompt, images, params) in enumerate(requests):
        assert tokens[str(i)] == _alone(model, prompt, images, params)[0], i
    assert engine.blocks.num_free == engine.blocks.num_usable


def test_n_samples_equal_generate_with_num_samples_under_the_same_seed(model):
    prompt, images = _prompt(13, 7, 1), _images(1, 7)
    params = RequestParams(temperature=1.3, top_k=40, max_tokens=12, n=3, seed=11)
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4))
    (result,) = engine.generate([Request(prompt, images, params)])
    expected = _alone(model, prompt, images, params, generator=torch.Generator().manual_seed(11))
    assert result.token_ids == expected
    assert len({tuple(t) for t in expected}) > 1
    assert engine.blocks.num_free == engine.blocks.num_usable


def test_requests_with_different_settings_share_each_step_and_keep_their_own_tokens(model):
    """One sampling call per step serves greedy rows, seeded rows with temperature / top-k / top-p, and
    unseeded ones: the greedy and the seeded requests each get what generate gives them alone (the seeded
    draws from its own generator, n rows at a time)."""
    seeded = RequestParams(temperature=0.9, top_k=30, top_p=0.85, max_tokens=10, n=2, seed=5)
    requests = [(_prompt(11, 1, 1), _images(1, 1), RequestParams(greedy=True, max_tokens=9)),
                (_prompt(13, 7, 1), _images(1, 7), seeded),
                (_prompt(8, 2, 0), None, RequestParams(temperature=1.5, max_tokens=12)),
                (_prompt(20, 3, 0), None, RequestParams(greedy=True, max_tokens=7))]
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4, max_batch_tokens=64))
    results = engine.generate([Request(prompt, images, params) for prompt, images, params in requests])
    for i in (0, 3):
        assert results[i].token_ids == _alone(model, *requests[i]), i
    generator = torch.Generator().manual_seed(5)
    assert results[1].token_ids == _alone(model, *requests[1], generator=generator)
    assert engine.blocks.num_free == engine.blocks.num_usable


def test_a_repeated_image_and_prompt_reuse_blocks_and_another_image_does_not(model):
    # image placeholders at positions 2-5: the text before them fits no full block of 4
    prompt = _prompt(30, 3, 1)
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4))
    first = engine.generate([Request(prompt, _images(1, 3), RequestParams(greedy=True, max_tokens=4))])
    assert engine.blocks.hits == 0
    again = engine.generate([Request(prompt, _images(1, 3), RequestParams(greedy=True, max_tokens=4))])
    assert engine.blocks.hits == 7 and again[0].token_ids == first[0].token_ids  # blocks 0-6 of 8
    hits = engine.blocks.hits
    other = engine.generate([Request(prompt, _images(1, 4), RequestParams(greedy=True, max_tokens=4))])
    assert engine.blocks.hits == hits  # block 0 holds image tokens: nothing is shared
    assert other[0].token_ids[0] == _alone(model, prompt, _images(1, 4),
                                           RequestParams(greedy=True, max_tokens=4))[0]
    # one full block of text before the image: the only block two images share
    text_first = [7, 8, 9, 10, *prompt]
    engine.generate([Request(text_first, _images(1, 3), RequestParams(greedy=True, max_tokens=2))])
    hits = engine.blocks.hits
    engine.generate([Request(text_first, _images(1, 4), RequestParams(greedy=True, max_tokens=2))])
    assert engine.blocks.hits - hits == 1


def test_abort_frees_every_block(model):
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4))
    for i, (prompt, images, params) in enumerate(_requests()[:4]):
        engine.add_request(Request(prompt, images, params, request_id=str(i)))
    engine.step()
    engine.step()
    for i in range(4):
        engine.abort(str(i))
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_usable
    engine.blocks.check()


def test_requests_that_can_never_be_served_are_refused_at_once(model):
    engine = Engine(model, config=ServingConfig(num_blocks=8, block_size=4))
    with pytest.raises(RequestError, match="exceeds the context"):
        engine.add_request(Request(_prompt(100, 0, 0), None, RequestParams(max_tokens=40)))
    with pytest.raises(RequestError, match="KV-cache blocks"):
        engine.add_request(Request(_prompt(30, 0, 0), None, RequestParams(max_tokens=20)))
    with pytest.raises(RequestError, match="image tokens"):
        engine.add_request(Request(_prompt(10, 0, 1), None, RequestParams(max_tokens=2)))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("params", [RequestParams(greedy=True, max_tokens=8, logprobs=5),
                                    RequestParams(temperature=0.9, max_tokens=8, n=2, seed=2, logprobs=3)],
                         ids=["greedy", "sampled"])
def test_log_probabilities_equal_a_float64_log_softmax_of_the_logits(model, params):
    """Each sampled token's log-probability and the top k's equal a float64 log-softmax of the model's logits
    at that step (computed here in one uncached pass over the prompt and the tokens generated)."""
    prompt, images = _prompt(15, 3, 1), _images(1, 3)
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4))
    (result,) = engine.generate([Request(prompt, images, params),
                                 Request(_prompt(9, 4, 0), None,
                                         RequestParams(greedy=True, max_tokens=8))])[:1]
    for tokens, entries in zip(result.token_ids, result.logprobs):
        with torch.no_grad():
            logits, _ = model(torch.tensor([prompt + tokens]), images)
        reference = logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)  # what each token was drawn from
        assert len(entries) == len(tokens)
        for step, (token, entry) in enumerate(zip(tokens, entries)):
            assert entry.logprob == pytest.approx(reference[step, token].item(), abs=1e-4)
            top = reference[step].topk(params.logprobs)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_without_max_tokens_a_request_gets_all_the_room_the_context_and_the_cache_leave(model):
    """max_tokens=None: the largest count the request is accepted with (brute force over every count)."""
    for num_blocks, block_size, prompt, n in [(8, 4, 10, 1), (8, 4, 10, 2), (30, 4, 5, 3), (400, 8, 30, 1),
                                              (12, 16, 40, 1), (9, 4, 3, 2)]:
        engine = Engine(model, config=ServingConfig(num_blocks=num_blocks, block_size=block_size))
        ids = _prompt(prompt, 0, 0)
        accepted = [m for m in range(1, 200) if _accepts(engine, ids, RequestParams(max_tokens=m, n=n))]
        given = engine.prepare(Request(ids, None, RequestParams(max_tokens=None, n=n))).params.max_tokens
        assert given == max(accepted), (num_blocks, block_size, prompt, n)


def _accepts(engine: Engine, prompt: list[int], params: RequestParams) -> bool:
    try:
        engine.prepare(Request(prompt, None, params))
    except RequestError:
        return False
    return True


def test_structured_answers_validate_and_leave_free_requests_in_the_same_steps_unchanged():
    """20 requests held to a JSON schema (an enum and an integer), sampled at temperature 1, all parse and
    validate; free requests in the same steps get exactly the tokens they get without them (one sampling call,
    a mask per constrained row)."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from serving.requests import Structure
    from tests.models.helpers import base_tokenizer, chat_vlm

    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["colour", "count"], "additionalProperties": False}
    structure = Structure("json_schema", json.dumps(schema))
    held = [Request(f"what is it? {i}", None, RequestParams(temperature=1.0, max_tokens=80, seed=i,
                                                            structure=structure)) for i in range(20)]
    free = [Request("what colour is the sky?", None, RequestParams(greedy=True, max_tokens=12)),
            Request("the sky", None, RequestParams(temperature=0.8, top_k=20, seed=3, max_tokens=12))]
    roomy = ServingConfig(num_blocks=400, block_size=8, max_num_seqs=32)
    mixed = Engine(model, tokenizer, roomy).generate(held + free)
    for result in mixed[:20]:
        jsonschema.validate(json.loads(result.texts[0]), schema)
        assert result.finish_reasons == ["stop"]
    alone = Engine(model, tokenizer, roomy).generate(free)
    assert [r.token_ids for r in mixed[20:]] == [r.token_ids for r in alone]
    choice = Structure("choice", ("yes", "no", "maybe"))
    answers = Engine(model, tokenizer, config=ServingConfig(num_blocks=400, block_size=8)).generate(
        [Request("well?", None, RequestParams(temperature=1.0, seed=s, max_tokens=10, structure=choice))
         for s in range(6)])
    assert {r.texts[0] for r in answers} <= {"yes", "no", "maybe"}
    # regression: written into the grammar as escaped surrogates, unreachable
    emoji = Structure("choice", ("😀", "🙂"))
    (smile,) = Engine(model, tokenizer, config=ServingConfig(num_blocks=400, block_size=8)).generate(
        [Request("well?", None, RequestParams(temperature=1.0, seed=0, max_tokens=10, structure=emoji))])
    assert smile.texts[0] in ("😀", "🙂") and smile.finish_reasons == ["stop"]


def test_an_answer_its_schema_cannot_finish_ends_cut_short_not_with_a_forced_stop_token():
    """Regression: a schema an answer can begin but never finish (its required property is only a choice of
    itself, which every xgrammar compiles; >= 0.2.9 refuses a bare self-reference) allows no token after
    `{"a":`. That row's logits were all masked, the sampler took token 0
    (a stop token of this model) and the answer ended "stop", looking complete; now it ends there, finish
    reason "length", and nothing is drawn from the masked row. A free request in the same steps is
    unchanged."""
    pytest.importorskip("xgrammar")
    from serving.requests import Structure
    from tests.models.helpers import base_tokenizer, chat_vlm

    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/loop"}}, "required": ["a"],
              "$defs": {"loop": {"anyOf": [{"$ref": "#/$defs/loop"}]}}}
    structure = Structure("json_schema", json.dumps(schema))
    stuck = [Request("well?", None, RequestParams(greedy=True, max_tokens=20, structure=structure)),
             Request("well?", None, RequestParams(temperature=1.0, seed=1, n=2, max_tokens=20,
                                                  structure=structure))]
    free = Request("the sky", None, RequestParams(greedy=True, max_tokens=12))
    engine = Engine(model, tokenizer, ServingConfig(num_blocks=400, block_size=8))
    *results, alone = engine.generate([*stuck, free])
    # tokens out counts the tokens appended, not the stuck rows' draws that never were
    assert engine.generation_tokens == sum(len(t) for r in [*results, alone] for t in r.token_ids)
    for result in results:
        assert result.texts == ['{"a":'] * len(result.texts) and set(result.finish_reasons) == {"length"}
        assert not {token for tokens in result.token_ids for token in tokens} & set(model.config.stop_ids)
    assert alone.token_ids == engine.generate([free])[0].token_ids
    assert engine.blocks.num_free == engine.blocks.num_usable
