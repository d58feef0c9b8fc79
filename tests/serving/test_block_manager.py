"""The block manager under random workloads (hypothesis): ref counts, free + used = total, no leaks, and every
sequence reads back exactly its own tokens through its block table (prefix reuse and copy-on-write
included)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.block_manager import NULL_BLOCK, BlockManager


class Simulation:
    """A block manager plus a model of the pool's contents: writes go where the tables say."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.slots: dict[int, object] = {}
        self.sequences: list[dict] = []

    def write(self, table: list[int], position: int, key) -> None:
        size = self.manager.block_size
        self.slots[table[position // size] * size + position % size] = key

    def read(self, table: list[int], count: int) -> list:
        size = self.manager.block_size
        return [self.slots.get(table[p // size] * size + p % size) for p in range(count)]

    def add(self, keys: list) -> bool:
        hashes: list[int] = []
        allocated = self.manager.allocate_prompt(keys, hashes)
        if allocated is None:
            return False
        table, cached = allocated
        assert cached < len(keys) and cached % self.manager.block_size == 0
        assert self.read(table, cached) == keys[:cached], "a prefix hit with other tokens"
        for position in range(cached, len(keys)):
            self.write(table, position, keys[position])
        registered = self.manager.commit(table, keys, hashes, len(keys), 0)
        self.sequences.append({"keys": list(keys), "table": table, "hashes": hashes,
                               "registered": registered})
        return True

    def fork(self, index: int) -> None:
        parent = self.sequences[index]
        table = self.manager.fork(parent["table"])
        self.sequences.append({"keys": list(parent["keys"]), "table": table, "hashes": list(parent["hashes"]),
                               "registered": parent["registered"]})

    def append(self, index: int, key) -> bool:
        sequence = self.sequences[index]
        table, position = sequence["table"], len(sequence["keys"])
        if not self.manager.can_append(table, position):
            return False
        copy = self.manager.append_slot(table, position)
        if copy:
            size = self.manager.block_size
            source, destination = copy
            for offset in range(size):
                if source * size + offset in self.slots:
                    self.slots[destination * size + offset] = self.slots[source * size + offset]
        assert self.manager.blocks[table[-1]].ref_count == 1, "a write into a shared block"
        self.write(table, position, key)
        sequence["keys"].append(key)
        sequence["registered"] = self.manager.commit(table, sequence["keys"], sequence["hashes"],
                                                     len(sequence["keys"]), sequence["registered"])
        return True

    def release(self, index: int) -> None:
        self.manager.release(self.sequences.pop(index)["table"])

    def check(self) -> None:
        manager = self.manager
        manager.check()
        used = {block for s in self.sequences for block in s["table"]}
        assert NULL_BLOCK not in used
        assert manager.num_free + len(used) == manager.num_usable
        for s in self.sequences:
            assert len(s["table"]) == manager.blocks_for(len(s["keys"]))
            assert self.read(s["table"], len(s["keys"])) == s["keys"]
        for block in used:
            holders = sum(s["table"].count(block) for s in self.sequences)
            assert manager.blocks[block].ref_count == holders


operation = st.one_of(
    st.tuples(st.just("add"), st.lists(st.sampled_from("abc") | st.tuples(st.just("img"), st.integers(0, 3)),
                                       min_size=1, max_size=12)),
    st.tuples(st.just("fork"), st.integers(0, 100)),
    st.tuples(st.just("append"), st.integers(0, 100), st.sampled_from("abcd")),
    st.tuples(st.just("release"), st.integers(0, 100)),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4), st.integers(3, 16), st.lists(operation, max_size=60))
def test_random_workloads_keep_the_invariants(block_size, num_blocks, operations):
    sim = Simulation(num_blocks, block_size)
    for op in operations:
        if op[0] == "add":
            sim.add(op[1])
        elif sim.sequences and op[0] == "fork":
            sim.fork(op[1] % len(sim.sequences))
        elif sim.sequences and op[0] == "append":
            sim.append(op[1] % len(sim.sequences), op[2])
        elif sim.sequences and op[0] == "release":
            sim.release(op[1] % len(sim.sequences))
        sim.check()
    while sim.sequences:
        sim.release(0)
    sim.check()
    assert sim.manager.num_free == sim.manager.num_usable  # no leaks


def test_a_repeated_prompt_reuses_its_full_blocks_and_recomputes_the_last():
    sim = Simulation(num_blocks=20, block_size=4)
    prompt = list("abcdefghij")  # two full blocks, then 2 tokens
    assert sim.add(prompt)
    assert sim.manager.hits == 0
    assert sim.add(prompt)
    assert sim.manager.hits == 2 and sim.sequences[1]["table"][:2] == sim.sequences[0]["table"][:2]
    # exactly two full blocks: the second holds the last token, so it is computed again
    exact = list("abcdefgh")
    assert sim.add(exact)
    assert sim.sequences[2]["table"][0] == sim.sequences[0]["table"][0]
    assert sim.sequences[2]["table"][1] != sim.sequences[0]["table"][1]


def test_another_image_shares_nothing_past_the_text_before_it():
    sim = Simulation(num_blocks=20, block_size=2)
    text = ["q", "w"]
    first = text + [("img-A", i) for i in range(4)] + ["x"]
    second = text + [("img-B", i) for i in range(4)] + ["x"]
    sim.add(first)
    hits = sim.manager.hits
    sim.add(second)
    assert sim.manager.hits - hits == 1  # the text block only
    assert sim.sequences[1]["table"][1:] != sim.sequences[0]["table"][1:]


def test_a_prompt_that_does_not_fit_takes_nothing():
    manager = BlockManager(num_blocks=3, block_size=2)
    assert manager.allocate_prompt(list("abcde"), []) is None
    assert manager.num_free == 2
    with pytest.raises(ValueError):
        BlockManager(num_blocks=1, block_size=2)
