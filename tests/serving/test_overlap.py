"""Overlapped steps (ServingConfig.overlap: the host schedules and launches step N + 1 before it reads step
N's sampled ids) against `generate` on each request alone and against the same engine reading every step at
once: the same tokens and finish reasons with samples ending at different steps (stop tokens, max_tokens),
preemption, chunked prefill, n seeded samples, log-probabilities, prefix caching and aborts."""

import dataclasses

import pytest
import torch

from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestParams
from serving.runner import SampledIds
from tests.models.helpers import tiny_vlm
from tests.serving.test_engine import _alone, _images, _prompt, _requests, _serve

ARRIVALS = [0, 0, 1, 3, 3, 4, 8, 9, 15, 15]


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(seed=1)


def _stopping_requests(model):
    """The ten requests of tests/serving/test_engine.py, each but two given its own third greedy token as a
    stop token, so samples end at many different steps, by stop token and by max_tokens."""
    requests = []
    for i, (prompt, images, params) in enumerate(_requests()):
        if i % 5:
            third = _alone(model, prompt, images, params)[0][2:3]
            params = dataclasses.replace(params, stop_token_ids=tuple(third))
        requests.append((prompt, images, params))
    return requests


@pytest.fixture
def no_preemption_while_in_flight(monkeypatch):
    """Fails the test if a request is preempted while one of its samples waits on a token in flight (its
    blocks and its position would be taken from under the step computing it)."""
    from serving.scheduler import Scheduler

    preempt = Scheduler._preempt

    def checked(self, group, step):
        assert not any(sequence.unread for sequence in group.live), "preempted with a token in flight"
        preempt(self, group, step)

    monkeypatch.setattr(Scheduler, "_preempt", checked)


@pytest.mark.parametrize("attention, num_blocks, block_size, budget", [
    ("gather", 200, 16, 512), ("sparse", 200, 16, 512), ("gather", 14, 4, 16), ("sparse", 14, 4, 16),
    ("sparse", 40, 8, 10)], ids=["gather-roomy", "sparse-roomy", "gather-preempting", "sparse-preempting",
                                 "sparse-chunked"])
def test_overlapped_steps_give_each_request_its_greedy_tokens(
    model, attention, num_blocks, block_size, budget, no_preemption_while_in_flight
):
    requests = _stopping_requests(model)
    results = {}
    for overlap in (False, True):
        engine = Engine(model, config=ServingConfig(num_blocks=num_blocks, block_size=block_size,
                                                    max_num_seqs=8, max_batch_tokens=budget,
                                                    attention=attention, overlap=overlap))
        results[overlap] = _serve(engine, requests, ARRIVALS)
        stats = engine.stats()
        # serial steps have nothing unread to read first; overlapped ones read first only where the cache
        # might preempt: never with 200 blocks, at times with 14
        assert stats["steps"] > 0
        if not overlap or num_blocks == 200:
            assert stats["steps_read_first"] == 0
        elif num_blocks < 20:
            assert 0 < stats["steps_read_first"] < stats["steps"]
        assert engine.blocks.num_free == engine.blocks.num_usable  # every block back
        assert sorted(engine.runner.inputs.free_rows) == list(range(8))  # every input row back
        engine.blocks.check()
        if num_blocks < 20:
            assert engine.scheduler.num_preemptions > 0
    for i, (prompt, images, params) in enumerate(requests):
        assert results[True][str(i)] == _alone(model, prompt, images, params)[0], i
    assert results[True] == results[False]
    stopped = [i for i, (_, _, params) in enumerate(requests) if params.stop_token_ids
               and results[True][str(i)][-1] in params.stop_token_ids]
    assert len(stopped) >= 5  # samples did end by their stop tokens, before max_tokens


def test_each_step_launches_before_it_reads_the_step_before(model, monkeypatch):
    """Overlapped, the sampled ids of step N are read after step N + 1 is launched; read at once, before."""
    log, kept = [], []  # kept alive: no id is reused
    make, read = SampledIds.__init__, SampledIds.read

    def made(self, *args):
        make(self, *args)
        kept.append(self)
        log.append(("launch", id(self)))

    def reading(self):
        log.append(("read", id(self)))
        return read(self)

    monkeypatch.setattr(SampledIds, "__init__", made)
    monkeypatch.setattr(SampledIds, "read", reading)
    prompt, images, params = _requests()[1]
    for overlap in (False, True):
        log.clear()
        engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4, overlap=overlap))
        (result,) = engine.generate([Request(prompt, images, params)])
        assert result.token_ids[0] == _alone(model, prompt, images, params)[0]
        launches = [handle for kind, handle in log if kind == "launch"]
        assert len(launches) == params.max_tokens == len(result.token_ids[0])  # the prompt's, then decodes
        if overlap:  # launch 1, then (launch k + 1, read k) ..., then read the last
            expected = [("launch", launches[0])]
            for k in range(1, len(launches)):
                expected += [("launch", launches[k]), ("read", launches[k - 1])]
            expected.append(("read", launches[-1]))
        else:
            expected = [(kind, handle) for handle in launches for kind in ("launch", "read")]
        assert log == expected


def test_samples_ending_by_max_tokens_cost_no_extra_rows_and_one_filling_the_context_ends_there(
    model, monkeypatch
):
    """The host knows where max_tokens ends a sample before it reads the last token, so an overlapped step
    never runs a row past it: the decode rows computed equal those of steps read at once. (A sample ended by
    a stop token costs one row: its token is read after the next step is launched.)"""
    context = model.config.language.max_position_embeddings
    requests = [Request(_prompt(context - 6, 4, 0), None, RequestParams(greedy=True, max_tokens=6,
                                                                         ignore_eos=True))]
    requests += [Request(prompt, images, dataclasses.replace(params, ignore_eos=True))
                 for prompt, images, params in _requests()[:5]]
    rows = {}
    for overlap in (False, True):
        engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=16, overlap=overlap))
        forward = engine.runner.forward
        rows[overlap] = 0

        def counted(decodes, prefills, overlap=overlap, forward=forward):
            rows[overlap] += len(decodes)
            return forward(decodes, prefills)

        monkeypatch.setattr(engine.runner, "forward", counted)
        results = engine.generate(requests)
        assert results[0].token_ids[0] == _alone(model, requests[0].prompt, None, requests[0].params)[0]
        assert all(result.finish_reasons == ["length"] for result in results)
    assert rows[True] == rows[False] == sum(request.params.max_tokens - 1 for request in requests)


def test_seeded_samples_log_probabilities_and_prefix_hits_equal_reading_each_step_at_once(model):
    seeded = RequestParams(temperature=0.9, top_k=30, top_p=0.85, max_tokens=10, n=3, seed=5, logprobs=3)
    requests = [Request(_prompt(30, 3, 1), _images(1, 3), RequestParams(greedy=True, max_tokens=9)),
                Request(_prompt(13, 7, 1), _images(1, 7), seeded),
                Request(_prompt(30, 3, 1), _images(1, 3),
                        RequestParams(greedy=True, max_tokens=4, logprobs=2)),
                Request(_prompt(20, 3, 0), None, RequestParams(temperature=1.5, top_p=0.9, max_tokens=7,
                                                               seed=9, n=2))]
    outcomes = {}
    for overlap in (False, True):
        engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4, max_batch_tokens=64,
                                                    overlap=overlap))
        first = engine.generate(requests[:2])
        again = engine.generate(requests[2:])  # the first request's prompt blocks are found in the cache
        outcomes[overlap] = [(r.token_ids, r.finish_reasons, r.cached_tokens) for r in first + again], \
            engine.blocks.hits, [r.logprobs for r in first + again]
        assert engine.blocks.num_free == engine.blocks.num_usable
    assert outcomes[True][:2] == outcomes[False][:2]
    assert outcomes[True][1] > 0
    generator = torch.Generator().manual_seed(5)
    assert outcomes[True][0][1][0] == _alone(model, requests[1].prompt, requests[1].images, seeded,
                                             generator=generator)
    # a step's rows differ between the two (an overlapped step runs a stopped sample's row): float32 rounding
    for result, reference in zip(outcomes[True][2], outcomes[False][2]):
        for entries, reference_entries in zip(result or [], reference or []):
            assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in reference_entries],
                                                                 abs=1e-5)
            for entry, reference_entry in zip(entries, reference_entries):
                assert [t for t, _ in entry.top] == [t for t, _ in reference_entry.top]
                assert [v for _, v in entry.top] == pytest.approx([v for _, v in reference_entry.top],
                                                                  abs=1e-5)


def test_a_request_aborted_while_its_step_is_unread_frees_everything_and_a_newcomer_takes_its_seat(model):
    """Aborted while a step that samples it is unread, a request's seat and blocks go at once to a request
    added in the same breath (the unread row's token, written to that seat on the device, is never read by
    it); everyone keeps generate's tokens."""
    requests, newcomer = _requests()[:4], _requests()[7]
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4, max_num_seqs=4, overlap=True))
    for i, (prompt, images, params) in enumerate(requests):
        engine.add_request(Request(prompt, images, params, request_id=str(i)))
    tokens = {}
    for step in range(60):
        if step == 4:
            unread = [sequence.group.request_id for sequence in engine.unread_step.sampled_sequences]
            assert "1" in unread
            seat = engine.groups["1"].sequences[0].row
            engine.abort("1")
            engine.add_request(Request(newcomer[0], newcomer[1], newcomer[2], request_id="new"))
        for output in engine.step():
            assert output.request_id != "1" or step < 4
            tokens.setdefault(output.request_id, []).extend(output.new_tokens[0])
        if step == 4:
            assert engine.groups["new"].sequences[0].row == seat
        if not engine.has_unfinished():
            break
    for i in (0, 2, 3):
        assert tokens[str(i)] == _alone(model, *requests[i])[0], i
    assert tokens["new"] == _alone(model, *newcomer)[0]
    assert engine.blocks.num_free == engine.blocks.num_usable
    assert sorted(engine.runner.inputs.free_rows) == list(range(engine.settings.max_num_seqs))
    engine.blocks.check()


def test_n_samples_ending_by_a_stop_token_at_different_steps_equal_generate_under_the_same_seed(model):
    base = RequestParams(temperature=1.3, top_k=40, max_tokens=14, n=4, seed=11)
    prompt = _prompt(10, 4, 0)
    drawn = _alone(model, prompt, None, base, generator=torch.Generator().manual_seed(11))
    params = dataclasses.replace(base, stop_token_ids=(drawn[0][3],))  # the first sample's 4th token
    expected = _alone(model, prompt, None, params, generator=torch.Generator().manual_seed(11))
    assert len({len(tokens) for tokens in expected}) > 1  # they end at different steps
    other = Request(_prompt(14, 5, 1), _images(1, 5), RequestParams(greedy=True, max_tokens=12))
    engine = Engine(model, config=ServingConfig(num_blocks=80, block_size=4, overlap=True))
    first, second = engine.generate([Request(prompt, None, params), other])
    assert first.token_ids == expected
    assert second.token_ids[0] == _alone(model, other.prompt, other.images, other.params)[0]
    assert engine.blocks.num_free == engine.blocks.num_usable


def test_blocks_filled_by_overlapped_decodes_are_found_by_a_continuation(model):
    """A prompt that continues an answer (its prompt + its tokens) finds the blocks the answer's decodes
    filled, as many as with steps read at once: an overlapped decode's block is registered when its last
    token is read (registered before, its hash would chain over a token not yet known)."""
    first = Request(_prompt(9, 3, 0), None, RequestParams(greedy=True, max_tokens=23, ignore_eos=True))
    params = RequestParams(greedy=True, max_tokens=6, ignore_eos=True)
    cached = {}
    for overlap in (False, True):
        engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4, overlap=overlap))
        (answer,) = engine.generate([first])
        continuation = first.prompt + answer.token_ids[0][:-1]
        (result,) = engine.generate([Request(continuation, None, params)])
        assert result.token_ids[0] == _alone(model, continuation, None, params)[0]
        cached[overlap] = result.cached_tokens
    assert cached[True] == cached[False] == 28  # every full block but the one with the last prompt token


def test_a_failed_step_ends_every_stream_even_one_whose_end_its_read_had_found(model):
    """Regression: a step that read the step before first (the cache might preempt), finishing request A,
    and then failed to launch lost A's last output; the server failed only the requests the engine still
    held, so A's stream waited forever and counted against max_in_flight."""
    import asyncio

    from serving.async_engine import AsyncEngine, EngineFailure

    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4, overlap=True))
    engine.scheduler.may_preempt = lambda: True
    launch, armed = engine._launch, [True]

    def failing():
        if armed[0] and len(engine.groups) < 2:  # A has just ended
            armed[0] = False
            raise RuntimeError("simulated")
        return launch()

    engine._launch = failing
    groups = [engine.prepare(Request(_prompt(8 + i, i, 0), None,
                                     RequestParams(greedy=True, max_tokens=tokens, ignore_eos=True),
                                     request_id=name))
              for i, (name, tokens) in enumerate([("A", 3), ("B", 40)])]

    async def last_items():
        async_engine = AsyncEngine(engine)
        streams = [async_engine.submit(group) for group in groups]
        ends = []
        try:
            for stream in streams:
                while True:
                    item = await asyncio.wait_for(stream.get(), timeout=10)
                    if isinstance(item, EngineFailure) or item.finished:
                        ends.append(item)
                        break
            return ends, async_engine.stats()["in_flight"]
        finally:
            async_engine.shutdown()

    ends, in_flight = asyncio.run(last_items())
    assert not armed[0] and len(ends) == 2 and in_flight == 0


def test_requests_with_a_grammar_are_read_before_the_next_step_and_keep_their_answers():
    """A grammar's mask for the next token needs the last one read: while a constrained request runs, each
    step is read before the next is scheduled; answers and the free request's tokens equal the engine's
    read at once."""
    pytest.importorskip("xgrammar")
    from serving.requests import Structure
    from tests.models.helpers import base_tokenizer, chat_vlm

    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    choice = Structure("choice", ("yes", "no", "maybe so"))
    requests = [Request("well?", None,
                        RequestParams(temperature=1.0, seed=s, max_tokens=10, structure=choice))
                for s in range(4)]
    requests.append(Request("the sky", None, RequestParams(greedy=True, max_tokens=12)))
    engines = {overlap: Engine(model, tokenizer, ServingConfig(num_blocks=400, block_size=8, overlap=overlap))
               for overlap in (False, True)}
    results = {overlap: engine.generate(requests) for overlap, engine in engines.items()}
    stats = engines[True].stats()
    assert 0 < stats["steps_read_first"] < stats["steps"]  # the first step has nothing to read
    assert [(r.token_ids, r.finish_reasons) for r in results[True]] == \
        [(r.token_ids, r.finish_reasons) for r in results[False]]
    assert {r.texts[0] for r in results[True][:4]} <= {"yes", "no", "maybe so"}


def test_the_server_streams_answers_of_overlapped_steps_and_ends_them_at_stop_strings():
    """Served through the OpenAI API with overlapped steps: concurrent streamed answers and an answer cut by a
    stop string (its request aborted by the server while a step of it may be in flight) are what `generate`
    gives alone, and every block comes back."""
    pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from tests.serving.test_server import _alone as _answer
    from tests.serving.test_server import _idle, _message, check_a_stop_string_ends_the_answer, serving

    with serving(overlap=True) as (server, client, model, tokenizer, engine):
        assert engine.settings.overlap
        questions = ["what colour is the sky?", "blue", "name a shape", "count to three"]
        expected = [_answer(model, tokenizer, question, [], 10, greedy=True)[0] for question in questions]

        def stream(question: str) -> str:
            chunks = client.chat.completions.create(model="tiny", messages=_message(question), max_tokens=10,
                                                    temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(stream, questions)) == expected
        check_a_stop_string_ends_the_answer(client, model, tokenizer)
        _idle(engine)


def test_pixels_are_pinned_when_prepared_for_a_model_on_a_gpu_and_only_then(model, monkeypatch):
    """The logic that chooses the GPU path, on a CPU: a request's pixels are pinned when it is prepared for
    a model on CUDA (so that the step starting it copies them without waiting for the device), never for a
    model on a CPU. Pinning itself is faked (it needs a GPU)."""
    pinned = []

    def pin(tensor):
        pinned.append(tensor)
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    prompt, images, params = _requests()[0]
    engine = Engine(model, config=ServingConfig(num_blocks=64, block_size=4))
    assert engine.prepare(Request(prompt, images, params)).images is images and not pinned
    engine.model.device = torch.device("cuda")  # what the engine checks; nothing runs on it here
    group = engine.prepare(Request(prompt, images, params))
    assert pinned == [images] and group.images is not images and torch.equal(group.images, images)
