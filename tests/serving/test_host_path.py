"""The engine's host path, counted rather than timed: a decode step's tensor operations outside the model do
not grow with the number of running sequences, it reads one thing back from the device (the sampled ids), and
its prefix-cache bookkeeping does not grow with the context. (On a GPU, tests/serving/test_gpu.py checks the
step under CUDA's sync debug mode.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import serving.block_manager
from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestParams
from tests.models.helpers import tiny_vlm

# Operations whose output shape depends on tensor values, or that read a value back: each is a host sync on a
# GPU.
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2",
           "unique_consecutive", "repeat_interleave"}

SETTINGS = {"greedy": RequestParams(greedy=True, max_tokens=60, ignore_eos=True),
            "sampled": RequestParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=60, ignore_eos=True)}


@pytest.fixture(scope="module")
def model():
    return tiny_vlm(seed=2, max_position_embeddings=512)


def _decoding_engine(model, running: int, prompt_length: int, params: RequestParams,
                     attention: str = "auto") -> Engine:
    """An engine with `running` requests past their prompts, every one decoding in the next step."""
    engine = Engine(model, config=ServingConfig(
        num_blocks=running * ((prompt_length + 60) // 8 + 2) + 1, block_size=8, max_num_seqs=128,
        max_batch_tokens=4096, attention=attention))
    for i in range(running):
        engine.add_request(Request([3 + (i + t) % 90 for t in range(prompt_length)], None, params))
    while engine.scheduler.waiting or not all(s.decoding for g in engine.scheduler.running for s in g.live):
        engine.step()
    return engine


class Counter(TorchDispatchMode):
    """Counts the tensor operations run outside the language model's forward (and those that sync)."""

    def __init__(self, language) -> None:
        super().__init__()
        self.outside, self.syncing, self.inside = [], [], False
        language.register_forward_pre_hook(lambda *_: setattr(self, "inside", True))
        language.register_forward_hook(lambda *_: setattr(self, "inside", False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING:
            self.syncing.append(name)
        if not self.inside:
            self.outside.append(name)
        return func(*args, **(kwargs or {}))


def _count_step(model, engine: Engine) -> Counter:
    counter = Counter(model.language)
    with counter:
        outputs = engine.step()
    assert sum(len(o.new_tokens[0]) for o in outputs) == len(engine.scheduler.running)  # a pure decode step
    return counter


# the CPU's two decode paths: rows gathered in groups, and sparse (the default there)
@pytest.mark.parametrize("attention", ["gather", "sparse"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_a_decode_step_runs_as_many_tensor_ops_at_64_sequences_as_at_8(model, settings, attention):
    counts = {}
    for running in (8, 64):
        engine = _decoding_engine(model, running, prompt_length=21, params=SETTINGS[settings],
                                  attention=attention)
        # crossing a block edge included
        counts[running] = [_count_step(model, engine).outside for _ in range(3)]
    assert counts[8] == counts[64]


@pytest.mark.parametrize("attention", ["gather", "sparse"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_a_decode_step_reads_one_thing_back_from_the_device(model, settings, attention, monkeypatch):
    """The sampled ids, with one `tolist()`; nothing else is read back, and no operation whose result's shape
    depends on tensor values runs (on a GPU each would stall the step)."""
    engine = _decoding_engine(model, 16, prompt_length=21, params=SETTINGS[settings], attention=attention)
    reads = []
    for name in ("tolist", "item", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor,
            name,
            lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1],
        )
    for _ in range(3):
        reads.clear()
        counter = _count_step(model, engine)
        assert reads == ["tolist"] and counter.syncing == []


def test_prefix_cache_bookkeeping_per_step_does_not_grow_with_the_context(model, monkeypatch):
    """Over a block's worth of decode steps, a sequence at 24 tokens and one at 440 each hash exactly the one
    block that filled (block_size keys), and register only it."""
    hashed, walked = [], []
    chain_hash, commit = serving.block_manager.chain_hash, serving.block_manager.BlockManager.commit
    monkeypatch.setattr(
        serving.block_manager,
        "chain_hash",
        lambda previous, keys: (hashed.append(len(keys)), chain_hash(previous, keys))[1],
    )

    def counting_commit(self, table, keys, hashes, num_computed, num_registered):
        walked.append(num_computed // self.block_size - num_registered)
        return commit(self, table, keys, hashes, num_computed, num_registered)

    monkeypatch.setattr(serving.block_manager.BlockManager, "commit", counting_commit)
    for prompt_length in (24, 440):
        engine = _decoding_engine(model, 1, prompt_length, SETTINGS["greedy"])
        hashed.clear()
        walked.clear()
        for _ in range(engine.blocks.block_size):
            engine.step()
        assert hashed == [engine.blocks.block_size] and walked == [1], prompt_length
