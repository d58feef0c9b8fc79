"""The batch producer thread (data/prefetch.py): the same items in the same order, never more than its depth
ahead, an error raised where the consumer asks, and a clean stop."""

import itertools
import threading
import time

import pytest

from data.prefetch import prefetched


def test_the_same_items_in_the_same_order():
    with prefetched(iter(range(100)), depth=3) as ahead:
        assert list(ahead) == list(range(100))
        assert next(ahead, None) is None  # ended, and stays ended


def test_it_holds_at_most_depth_items_ahead():
    produced = []

    def counted():
        for item in itertools.count():
            produced.append(item)
            yield item

    with prefetched(counted(), depth=2) as ahead:
        for consumed in range(1, 6):
            next(ahead)
            time.sleep(0.05)  # time for the producer to run as far ahead as it may
            # the queue's 2, and the one that waits to go in
            assert len(produced) <= consumed + 3


def test_an_error_is_raised_to_the_consumer():
    def failing():
        yield 1
        raise ValueError("bad shard")

    with prefetched(failing(), depth=2) as ahead:
        assert next(ahead) == 1
        with pytest.raises(ValueError, match="bad shard"):
            next(ahead)


def test_closing_stops_the_producer():
    before = threading.active_count()
    with prefetched(itertools.count(), depth=2) as ahead:
        next(ahead)
    assert threading.active_count() == before
