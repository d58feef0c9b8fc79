"""train.packing=max_length on a stream (data/stream_batches.py `fill_rows`): each batch is `batch_size` rows
of at most max_length tokens, first-fit decreasing from a window of streamed samples; every sample read is
trained once or still waits in the window, over 2 ranks x 2 workers too; a loader resumed from its batches'
positions packs the same rows; and a filled row gives each of its samples the logits it has alone."""

import dataclasses
from collections import Counter

import pytest
import torch

from data import VQACollator
from data.batches import loader_batches, take_bookkeeping
from data.chat_processors import ChatProcessor
from data.shards import write_shards
from data.stream_batches import WINDOW_BATCHES, StreamedBatches, take_stream
from data.streaming import SlotReader, Source, StreamConfig
from models import VisionLanguageModel
from tests.models.helpers import tiny_vlm_config
from tests.shards import tiny_records
from tests.training.test_finetune import segments

MAX_LENGTH = 110  # the records below are 29, 54 or 79 tokens long: a row holds 79 + 29, 54 + 54 or 3 x 29
ROWS = 3  # batch_size: rows a batch


@pytest.fixture
def config(shapes_tokenizer):
    """A tiny VLM's config on the shapes tokenizer (4 tokens an image)."""
    image_id = ChatProcessor.from_config(tiny_vlm_config(), shapes_tokenizer).image_token_id
    return dataclasses.replace(tiny_vlm_config(vocab_size=len(shapes_tokenizer)), image_token_id=image_id)


@pytest.fixture
def collator(shapes_tokenizer, config):
    return VQACollator.for_encoder(ChatProcessor.from_config(config, shapes_tokenizer), MAX_LENGTH, pack=True)


def _records(count: int) -> list[dict]:
    """`count` records of 1, 2 or 3 turns in turn."""
    records = tiny_records(count, turns=3)
    for i, record in enumerate(records):
        record["texts"] = record["texts"][: i % 3 + 1]
    return records


def _sources(tmp_path, records):
    keys = write_shards(tmp_path, records, files=2, rows_per_group=3)
    return [Source.open(StreamConfig(files=str(tmp_path / "*.parquet")))], keys


def _streamed(sources, collator, workers=2, **options):
    return StreamedBatches(sources, collator, batch_size=ROWS, seed=1, buffer_size=3, policy="skip",
                           num_workers=workers, report=lambda message: None,
                           check_texts=collator.encoder.check_texts, fill_rows=True, **options)


def _batches(sources, collator, count, workers=2, **options):
    """`count` batches (the model's inputs, their stream bookkeeping) from a loader of `workers`."""
    with loader_batches(_streamed(sources, collator, workers, **options), workers, prefetch_factor=2,
                        pin_memory=False, batch_size=None) as loader:
        taken = [next(loader) for _ in range(count)]
    for batch in taken:
        assert take_bookkeeping(batch) == ([], [])
    return [(batch, take_stream(batch)) for batch in taken]


def test_rows_hold_every_sample_read_once_over_two_ranks_of_two_workers(tmp_path, collator, config):
    """Each slot: the keys its batches trained on plus its window's are exactly the keys its reader read (an
    independent reader of the same slot), so none is lost or trained twice; the rows are batch_size rows of
    at most max_length tokens, each sample's ids as the record encodes alone; and the 4 slots, having read
    more than an epoch, have trained on every sample of the dataset or hold it in a window."""
    records = _records(96)
    sources, keys = _sources(tmp_path, records)
    encoded = {key: collator.encode(record)[0] for key, record in zip(keys, records)}
    trained, waiting = Counter(), set()
    for rank in range(2):
        taken = _batches(sources, collator, 12, rank=rank, world_size=2)
        for slot in {stream["slot"] for _, stream in taken}:
            mine = [(batch, stream) for batch, stream in taken if stream["slot"] == slot]
            keys_trained = [key for _, stream in mine for key in stream["keys"]]
            window = [key for _, key in mine[-1][1]["position"]["window"]]
            reader = SlotReader(sources, slot, 4, seed=1, buffer_size=3)
            read = [next(reader)[0] for _ in range(len(keys_trained) + len(window))]
            assert Counter(keys_trained) + Counter(window) == Counter(read)
            assert sum(len(encoded[key]) for key in window) < (WINDOW_BATCHES * ROWS + 1) * MAX_LENGTH
            trained.update(keys_trained)
            waiting.update(window)
            for batch, stream in mine:
                assert batch["input_ids"].shape[0] == ROWS and batch["input_ids"].shape[1] <= MAX_LENGTH
                ids = [segment[0].tolist() for segment in segments(batch, 4, config.image_token_id)]
                assert ids == [encoded[key] for key in stream["keys"]]
    assert set(trained) | waiting == set(keys)  # 6 batches of ~5 samples a slot, 24 samples its epoch


def test_a_resumed_loader_packs_the_same_rows(tmp_path, collator):
    sources, _ = _sources(tmp_path, _records(48))
    expected = _batches(sources, collator, 10)
    consumed = 5  # an odd number: the resumed loader starts at worker 1
    positions = {str(stream["slot"]): stream["position"]
                 for _, stream in _batches(sources, collator, consumed)}
    assert all(position["window"] for position in positions.values())  # samples wait in each window
    resumed = _batches(sources, collator, 10 - consumed, consumed=consumed, positions=positions)
    for (batch, stream), (expected_batch, expected_stream) in zip(resumed, expected[consumed:], strict=True):
        assert stream == expected_stream
        assert all(torch.equal(batch[name], expected_batch[name]) for name in expected_batch)


def test_a_filled_row_gives_each_sample_its_logits_alone(tmp_path, collator, config):
    """float64: the logits of a batch of filled rows, at each sample's positions, equal the sample's own."""
    sources, _ = _sources(tmp_path, _records(24))
    batch, stream = _batches(sources, collator, 1, workers=0)[0]
    assert int(batch["attention_mask"].amax()) > 1  # rows hold several samples
    torch.manual_seed(0)
    model = VisionLanguageModel(config).double().eval()
    with torch.no_grad():
        logits, _ = model(batch["input_ids"], batch["images"].double(), batch["attention_mask"])
        packed = [row[mask == number] for row, mask in zip(logits, batch["attention_mask"])
                  for number in range(1, int(mask.max()) + 1)]
        alone = [model(ids[None], tiles.double())[0][0]
                 for ids, _, tiles in segments(batch, 4, config.image_token_id)]
    assert len(alone) == len(stream["keys"])
    for packed_logits, alone_logits in zip(packed, alone, strict=True):
        torch.testing.assert_close(packed_logits, alone_logits, rtol=1e-10, atol=1e-10)
