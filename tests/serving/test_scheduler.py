"""The scheduler's admission policy: while sequences decode, waiting requests join in batches of
`admission_batch` seats (or what the queue wants, if less), or after MAX_HELD_STEPS held steps; with nothing
decoding they join at once. Each request's tokens stay generate's (tests/serving/test_engine.py holds the
engine to that with held admissions)."""

import pytest

from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestParams
from serving.scheduler import MAX_HELD_STEPS
from serving.sequence import Status
from tests.models.helpers import tiny_vlm


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(seed=1)


def _request(name: str, max_tokens: int) -> Request:
    return Request([5 + i % 50 for i in range(8)], None, RequestParams(greedy=True, max_tokens=max_tokens,
                                                                        ignore_eos=True), request_id=name)


def _steps_until_admitted(engine: Engine, names: list[str], limit: int = 100) -> dict[str, int]:
    """The step (counting from 1) in which each named request left the queue."""
    admitted: dict[str, int] = {}
    for number in range(1, limit):
        engine.step()
        for name in names:
            if name not in admitted and engine.groups[name].status is Status.RUNNING:
                admitted[name] = number
        if len(admitted) == len(names):
            return admitted
    raise AssertionError(f"only {admitted} admitted in {limit} steps")


def _engine(model, admission_batch: int) -> Engine:
    return Engine(model, config=ServingConfig(num_blocks=64, block_size=4, max_num_seqs=4,
                                              max_batch_tokens=64, admission_batch=admission_batch))


def test_waiting_requests_join_together_once_enough_seats_are_free(model):
    engine = _engine(model, admission_batch=2)
    for name, max_tokens in [("a", 3), ("b", 6), ("c", 30), ("d", 30), ("e", 5), ("f", 5)]:
        engine.add_request(_request(name, max_tokens))
    # step 1 admits a-d (nothing decodes yet); a's last token is sampled in step 3, b's in step 6: e and f
    # wait for b's seat, then join together in step 7
    assert _steps_until_admitted(engine, ["e", "f"]) == {"e": 7, "f": 7}


def test_one_seat_at_a_time_without_held_admissions(model):
    engine = _engine(model, admission_batch=1)
    for name, max_tokens in [("a", 3), ("b", 6), ("c", 30), ("d", 30), ("e", 5), ("f", 5)]:
        engine.add_request(_request(name, max_tokens))
    assert _steps_until_admitted(engine, ["e", "f"]) == {"e": 4, "f": 7}


def test_a_held_request_joins_after_max_held_steps(model):
    engine = _engine(model, admission_batch=2)
    for name, max_tokens in [("a", 3), ("b", 60), ("c", 60), ("d", 60), ("e", 5), ("f", 5)]:
        engine.add_request(_request(name, max_tokens))
    # a's seat frees after step 3; steps 4 .. 3 + MAX_HELD_STEPS hold e back, the next admits it
    assert _steps_until_admitted(engine, ["e"]) == {"e": 4 + MAX_HELD_STEPS}


def test_a_short_queue_joins_as_soon_as_its_seats_are_free(model):
    engine = _engine(model, admission_batch=4)
    for name, max_tokens in [("a", 3), ("b", 30), ("c", 30), ("d", 30), ("e", 5)]:
        engine.add_request(_request(name, max_tokens))
    assert _steps_until_admitted(engine, ["e"]) == {"e": 4}  # e wants one seat: a's


def test_admission_batch_is_checked(model):
    with pytest.raises(ValueError, match="admission_batch must be in 1..max_num_seqs"):
        _engine(model, admission_batch=5)


def test_may_preempt_is_false_only_where_the_next_schedule_preempts_nothing(model):
    """Overlapped steps read the step before first when the next step's decodes might not all find a block
    (Scheduler.may_preempt). With fewer free blocks than seats it counts only the decodes whose next token
    needs a block (a new one, or a copy of a shared last one): whenever it says no, the step preempts
    nothing, and it does say no with fewer free blocks than seats."""
    engine = Engine(model, config=ServingConfig(num_blocks=14, block_size=4, max_num_seqs=4,
                                                max_batch_tokens=64, overlap=True))
    for name in "abcdef":
        engine.add_request(_request(name, 12))
    scheduler = engine.scheduler
    tight = 0
    while engine.has_unfinished():
        may, before = scheduler.may_preempt(), scheduler.num_preemptions
        tight += not may and engine.blocks.num_free < scheduler.seats
        engine.step()
        assert may or scheduler.num_preemptions == before
    assert scheduler.num_preemptions > 0 and tight > 0
