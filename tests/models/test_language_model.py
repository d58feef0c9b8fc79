"""The language model against transformers' Llama, and the contracts of its blocks and KV cache."""

from collections import Counter
from copy import deepcopy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import CheckpointError, LanguageConfig, LanguageModel
from models.attention import causal_mask, positions_and_mask
from models.kv_cache import CacheCapacityError, Growing, Preallocated, allocate, with_layout
from models.language_model import apply_rotary
from tests.models.helpers import fused_copy, save_tiny_llama


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def llama_pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    reference = save_tiny_llama(directory, tie=request.param)
    return reference, LanguageModel.from_pretrained(directory).eval()


def test_logits_match_transformers(llama_pair):
    reference, ours = llama_pair
    ids = torch.randint(0, 128, (2, 40))
    fused = fused_copy(ours)
    with torch.no_grad():
        expected = reference(ids).logits
        hidden, _ = ours(ours.token_embedding(ids))
        actual = ours.head(hidden)
        actual_fused = fused.head(fused(fused.token_embedding(ids))[0])
    assert (
        ours.config.num_kv_heads == 2
        and ours.config.tie_word_embeddings == reference.config.tie_word_embeddings
    )
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(actual_fused, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(actual_fused, actual, atol=1e-5, rtol=0)


def test_left_padded_logits_match_transformers(llama_pair):
    """With an attention mask, positions restart at each row's first real token, as in transformers."""
    reference, ours = llama_pair
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        actual = ours.head(ours(ours.token_embedding(ids), attention_mask=mask)[0])
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=1e-4, rtol=0)


def test_tied_head_shares_the_embedding(llama_pair):
    _, ours = llama_pair
    assert (ours.head.weight is ours.token_embedding.weight) == ours.config.tie_word_embeddings


def test_block_contract_split_equals_one_pass(llama_pair):
    """A block called on the first part, then with the returned dict and start_pos on the rest, equals one
    pass over the whole sequence; without a cache it returns the dict of the call's own K/V."""
    _, model = llama_pair
    block = model.blocks[0]
    x = torch.randn(2, 11, model.config.hidden_size)
    positions = torch.arange(11).expand(2, 11)
    cos, sin = model.rotary(positions)
    with torch.no_grad():
        whole, own = block(x, cos, sin)
        assert own["layout"] == Growing() and own["key"].shape == (2, 2, 11, 8)
        cache = allocate(2, 2, 11, 8, torch.float32, torch.device("cpu"))
        first, cache = block(x[:, :7], cos[:, :, :7], sin[:, :, :7], kv_cache=cache)
        second, cache = block(x[:, 7:], cos[:, :, 7:], sin[:, :, 7:], kv_cache=cache, start_pos=7)
        first_grown, grown = block(x[:, :7], cos[:, :, :7], sin[:, :, :7])
        second_grown, grown = block(x[:, 7:], cos[:, :, 7:], sin[:, :, 7:], kv_cache=grown, start_pos=7)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["key"], own["key"], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([first_grown, second_grown], 1), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(grown["key"], own["key"], atol=1e-6, rtol=0)


def test_each_layout_takes_only_its_own_kind_of_position(llama_pair):
    """The layout says how a cache is written: an int start_pos for a plain preallocated cache, a 0-dim tensor
    for a shape-static one, and a growing cache continues where it ends."""
    _, model = llama_pair
    block = model.blocks[0]
    x = torch.randn(1, 3, model.config.hidden_size)
    cos, sin = model.rotary(torch.arange(3).expand(1, 3))
    with torch.no_grad():
        with pytest.raises(TypeError, match="int start_pos"):
            block(x, cos, sin, kv_cache=allocate(1, 2, 8, 8, torch.float32, torch.device("cpu")),
                  start_pos=torch.tensor(0))
        with pytest.raises(TypeError, match="0-dim device tensor"):
            block(x, cos, sin,
                  kv_cache=allocate(1, 2, 8, 8, torch.float32, torch.device("cpu"), shape_static=True))
        _, grown = block(x, cos, sin)
        with pytest.raises(ValueError, match="continues at that position"):
            block(x, cos, sin, kv_cache=grown, start_pos=2)


def test_a_full_cache_refuses_more_tokens_instead_of_growing(llama_pair):
    """Regression: a write past a preallocated cache's end grew a private copy that decode_step threw away, so
    the step attended to zeros. Now it is a clear error, whoever keeps the returned cache."""
    _, model = llama_pair
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        cache = model.allocate_kv_cache(2, 8)
        model(model.token_embedding(ids), kv_cache=cache)
        with pytest.raises(CacheCapacityError, match="cache of 8 slots"):
            model(model.token_embedding(ids[:, :1]), kv_cache=cache, start_pos=8)


def test_prefill_equals_token_by_token(llama_pair):
    """Logits of a one-pass prefill equal those of feeding the same tokens one at a time through the cache."""
    _, model = llama_pair
    ids = torch.randint(0, 128, (3, 16))
    with torch.no_grad():
        embeddings = model.token_embedding(ids)
        prefill, _ = model(embeddings, kv_cache=model.allocate_kv_cache(3, 16))
        cache, steps = model.allocate_kv_cache(3, 16), []
        for t in range(16):
            hidden, cache = model(embeddings[:, t : t + 1], kv_cache=cache, start_pos=t)
            steps.append(hidden)
    torch.testing.assert_close(model.head(torch.cat(steps, 1)), model.head(prefill), atol=1e-4, rtol=0)


def test_cache_is_written_in_place_and_tensor_start_pos_matches_int(llama_pair):
    _, model = llama_pair
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        embeddings = model.token_embedding(ids)
        cache = model.allocate_kv_cache(2, 12)
        storage = [c["key"].data_ptr() for c in cache]
        _, cache = model(embeddings[:, :8], kv_cache=cache)
        by_int, _ = model(embeddings[:, 8:], kv_cache=[dict(c) for c in cache], start_pos=8)
        static = with_layout(cache, Preallocated(shape_static=True))
        by_tensor, cache = model(embeddings[:, 8:], kv_cache=static, start_pos=torch.tensor(8))
    assert [c["key"].data_ptr() for c in cache] == storage
    torch.testing.assert_close(by_tensor, by_int, atol=1e-5, rtol=0)


def test_causal_mask():
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 2, 4, torch.device("cpu")), expected)


def test_resize_token_embeddings_keeps_old_rows(llama_pair):
    _, model = llama_pair
    model = LanguageModel(model.config)
    model.load_state_dict(llama_pair[1].state_dict())
    old = model.token_embedding.weight.detach().clone()
    model.resize_token_embeddings(130)
    assert model.token_embedding.weight.shape == (130, 64) and model.head.weight.shape == (130, 64)
    assert model.config.vocab_size == 130
    torch.testing.assert_close(model.token_embedding.weight[:128], old)
    torch.testing.assert_close(model.token_embedding.weight[128], old.mean(0))


def test_unsupported_checkpoint_is_refused(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                attention_bias=True).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="attention_bias"):
        LanguageModel.from_pretrained(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        LanguageModel.from_pretrained(tmp_path / "nothing-here")


def test_packed_sequences_equal_separate_passes(llama_pair):
    """Rows that pack several sequences (mask 1, 1, ..., 2, ..., 0 for padding) give each sequence the logits
    it gets alone: positions restart at 0 and no token sees another sequence."""
    _, ours = llama_pair
    rows = [[4, 6, 3], [9, 5]]  # the sequences' lengths in each row
    ids = torch.randint(0, 128, (2, 15))
    mask = torch.tensor([[n for n, length in enumerate(row, 1) for _ in range(length)] + [0] * (15 - sum(row))
                         for row in rows])
    with torch.no_grad():
        packed = ours.head(ours(ours.token_embedding(ids), attention_mask=mask)[0])
        for r, row in enumerate(rows):
            start = 0
            for length in row:
                alone = ours.head(ours(ours.token_embedding(ids[r : r + 1, start : start + length]))[0])
                torch.testing.assert_close(packed[r : r + 1, start : start + length], alone, atol=1e-5,
                                           rtol=0)
                start += length
    # Rotary attention sees only relative positions, so the logits cannot show where positions start: check
    # them.
    positions, _ = positions_and_mask(mask, 0, 2, 15, 15, ids.device)
    assert (positions[0, :13].tolist() == [*range(4), *range(6), *range(3)]
            and positions[1, :14].tolist() == [*range(9), *range(5)])


def test_rotary_keeps_float32_precision_after_a_bfloat16_round_trip(llama_pair):
    """Regression: the cos/sin tables were buffers, so `model.to(bfloat16).float()` rounded them for good. Now
    they are computed in float32 from the positions (checked against float64) and the round trip changes
    nothing."""
    _, model = llama_pair
    positions = torch.tensor([[0, 1, 2, 250]])
    cos, sin = model.rotary(positions)
    dim = model.config.head_dim
    inv_freq = 1.0 / model.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions[0, :, None].double() * inv_freq
    torch.testing.assert_close(cos[0, 0].double(), torch.cat([angles, angles], -1).cos(), atol=1e-6, rtol=0)
    # rotate_half's sign is carried by sin's first half (apply_rotary)
    torch.testing.assert_close(sin[0, 0].double(), torch.cat([-angles, angles], -1).sin(), atol=1e-6, rtol=0)
    round_trip = deepcopy(model).to(torch.bfloat16).float()
    round_trip.load_state_dict(model.state_dict())  # the weights at full precision again
    ids = torch.randint(0, 128, (2, 30))
    with torch.no_grad():
        expected = model.head(model(model.token_embedding(ids))[0])
        actual = round_trip.head(round_trip(round_trip.token_embedding(ids))[0])
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_queries_and_keys_exactly_as_transformers(llama_pair, dtype):
    """Bit for bit, transformers' Llama rotary (its rotate_half: a negation and a cat) and ours (the sign in
    sin, one roll; cos and sin cast to the model's dtype once a forward), in float32 and bfloat16: the
    rewrite that saves six kernels a layer changes no number."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    reference, ours = llama_pair
    positions = torch.tensor([[0, 1, 2, 17, 250, 1000], [5, 6, 7, 8, 9, 10]])
    heads, dim = ours.config.num_heads, ours.config.head_dim
    q = torch.randn(2, heads, 6, dim).to(dtype)
    k = torch.randn(2, ours.config.num_kv_heads, 6, dim).to(dtype)
    cos, sin = LlamaRotaryEmbedding(reference.config)(q, positions)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    ours_cos, ours_sin = ours.rotary(positions, dtype)
    assert torch.equal(apply_rotary(q, ours_cos, ours_sin), expected[0])
    assert torch.equal(apply_rotary(k, ours_cos, ours_sin), expected[1])


class _Ops(TorchDispatchMode):
    """The tensor operations a call runs that compute (on a GPU, each a kernel): not views or allocations."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ("empty", "empty_strided", "_unsafe_view"):
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


def _decode_step_ops(layers: int) -> Counter:
    """The operations of one bfloat16 decode step (a preallocated cache) of a `layers`-layer model."""
    config = LanguageConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    model = LanguageModel(config).eval().to(torch.bfloat16)
    cache = model.allocate_kv_cache(1, 8)
    with torch.no_grad():
        model(model.token_embedding(torch.tensor([[1, 2, 3]])), kv_cache=cache)
        with _Ops() as ops:
            model(model.token_embedding(torch.tensor([[4]])), kv_cache=cache, start_pos=3)
    return ops.names


def test_a_layer_of_a_bfloat16_decode_step_casts_only_in_its_norms_and_rotates_in_four_ops():
    """Each operation of a layer is a kernel a graphed GPU decode step replays (~3 us each on an H100, the
    step's cost: benchmarks/results/fast-paths-cuda.md). Counted as one layer more adds (a CPU proxy): the
    rotary tables are cast once a forward, not per layer (they were four casts a layer), and q and k rotate
    in a multiply, a roll, a multiply and an add each (rotate_half's negation and cat were one more)."""
    two, three = _decode_step_ops(2), _decode_step_ops(3)
    layer = three - two
    assert layer["_to_copy"] <= 4, layer  # RMSNorm's float32 up and back, twice
    assert layer["cat"] == layer["neg"] == 0 and layer["roll"] == 2, layer  # 47 -> 41 in all on torch 2.14


def test_sharded_checkpoints_load_through_their_index(tmp_path):
    """A checkpoint saved in shards (model.safetensors.index.json + model-0000N-of-0000M.safetensors) loads
    whole."""
    reference = save_tiny_llama(tmp_path / "whole", tie=False)
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = LanguageModel.from_pretrained(tmp_path / "sharded").eval()
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours.head(ours(ours.token_embedding(ids))[0]), reference(ids).logits,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_gives_the_dense_masks_logits(llama_pair, compiled):
    """forward(flex_attention=True) (train.flex_attention): packed and padded rows through FlexAttention's
    block mask give the logits of SDPA under the dense mask (itself checked against separate passes above),
    compiled as one graph too. Forward only: FlexAttention has no backward pass on a CPU (a GPU test checks
    the gradients), and a CPU runs its unfused reference, which skips no tile."""
    _, ours = llama_pair
    rows = [[40, 61, 30], [90, 50]]  # the sequences' lengths in each row, across flex's 128-token tiles
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[n for n, length in enumerate(row, 1) for _ in range(length)]
                         + [0] * (150 - sum(row)) for row in rows])
    torch._dynamo.reset()
    forward = torch.compile(ours, fullgraph=True, backend="aot_eager") if compiled else ours
    with torch.no_grad():
        dense = ours.head(ours(ours.token_embedding(ids), attention_mask=mask)[0])
        flex = ours.head(forward(ours.token_embedding(ids), attention_mask=mask, flex_attention=True)[0])
    torch.testing.assert_close(flex, dense, atol=5e-5, rtol=0)  # float32 sums in another order

