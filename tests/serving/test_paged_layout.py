"""The paged layout through the model's blocks: packed sequences in a shared pool against plain passes, for
every kernel."""

import pytest
import torch

from models import LanguageConfig, LanguageModel
from serving.paged_layout import PAGED_LAYOUTS
from tests.models.helpers import TRITON_ON_CPU


@pytest.mark.parametrize("attention", ["gather", "sparse", pytest.param("triton", marks=TRITON_ON_CPU)])
def test_paged_layout_equals_one_uncached_pass_per_sequence(attention):
    """Sequences at different points of their own (chunks of 5, 3, then 1 token), packed into one row without
    padding, write to scattered pool blocks through their block tables and attend over them: each token's
    hidden state equals a plain pass over its sequence alone. On a CPU the Triton kernel runs in Triton's
    interpreter."""
    torch.manual_seed(0)
    config = LanguageConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
                            num_kv_heads=2, max_position_embeddings=64)
    model = LanguageModel(config).eval()
    block_size, lengths = 4, [13, 6, 9]
    sequences = [torch.randint(0, 64, (n,)) for n in lengths]
    free = torch.randperm(30)[:15].add(1).tolist()  # scattered blocks, never the null block
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    pools = [{"key": torch.zeros(31, block_size, 2, 8), "value": torch.zeros(31, block_size, 2, 8)}
             for _ in range(config.num_layers)]
    done, outputs = [0, 0, 0], [[], [], []]
    with torch.no_grad():
        for chunk in (5, 3, 1, 5, 1, 1, 1):
            rows = [(r, min(chunk, n - done[r])) for r, n in enumerate(lengths) if done[r] < n]
            if not rows:
                break
            positions = torch.cat([torch.arange(done[r], done[r] + count) for r, count in rows])
            owner = torch.cat([torch.full((count,), r) for r, count in rows])
            ids = torch.stack([sequences[r][p] for r, p in zip(owner.tolist(), positions.tolist())])
            blocks = torch.tensor(
                [tables[r][p // block_size] for r, p in zip(owner.tolist(), positions.tolist())]
            )
            table = torch.zeros(len(rows), max(len(t) for t in tables), dtype=torch.long)
            for i, (r, _) in enumerate(rows):
                table[i, : len(tables[r])] = torch.tensor(tables[r])
            counts = torch.tensor([count for _, count in rows])
            layout = PAGED_LAYOUTS[attention](
                table, blocks * block_size + positions % block_size, positions,
                torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]),
                torch.tensor([done[r] + count for r, count in rows]), int(counts.max()),
            )
            hidden, _ = model(
                model.token_embedding(ids)[None], kv_cache=[{**pool, "layout": layout} for pool in pools]
            )
            start = 0
            for r, count in rows:
                outputs[r].append(hidden[0, start : start + count])
                start += count
                done[r] += count
        for r, ids in enumerate(sequences):
            expected, _ = model(model.token_embedding(ids[None]))
            torch.testing.assert_close(torch.cat(outputs[r])[None], expected, atol=1e-5, rtol=0)
