"""First-fit-decreasing packing of a batch's samples into rows."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from data.packing import pack_rows


@given(lengths=st.lists(st.integers(1, 60), max_size=40), extra=st.integers(0, 30))
def test_every_sample_lands_in_one_row_that_holds_it(lengths, extra):
    capacity = max(lengths, default=0) + extra
    rows = pack_rows(lengths, capacity)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    load = [sum(lengths[i] for i in row) for row in rows]
    assert all(0 < total <= capacity for total in load)
    # First fit never leaves two rows that one row could hold: a later row's samples would have fitted the
    # earlier one.
    assert all(a + b > capacity for i, a in enumerate(load) for b in load[i + 1 :])


def test_longest_first_and_default_capacity():
    # 19 tokens in rows of 6 (the longest sample): 4 rows at least, and first-fit decreasing finds 4.
    assert pack_rows([2, 6, 3, 3, 4, 1]) == [[1], [4, 0], [2, 3], [5]]
    assert pack_rows([]) == []


def test_a_sample_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([3, 9], capacity=8)
