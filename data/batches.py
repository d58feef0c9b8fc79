"""The training DataLoader: records read, checked, processed and collated in worker processes (or in this one
when there are none), each batch bringing back which of its records were bad or too long.

Counters kept in a worker die with it and never reach the training process, so each batch carries its own
bookkeeping instead: `take_bookkeeping` pops it in the training process. A data error raised in a worker (a
bad record under data.on_bad_record=fail) travels the same way and is raised there as it was, with its
one-line message.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from data.bad_records import CheckedRecords
from data.collator import VQACollator
from models.errors import TinyVLMError

BAD = "bad_record_indices"
TOO_LONG = "too_long_record_indices"
ERROR = "error"


class _Indexed(Dataset):
    """A batch of `CheckedRecords` read at once, with the indices asked for; an error is kept, not raised."""

    def __init__(self, records: CheckedRecords) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitems__(self, indices: list[int]) -> tuple[list[int], list[dict[str, Any] | None],
                                                        TinyVLMError | None]:
        try:
            return indices, self.records.__getitems__(indices), None
        except TinyVLMError as e:
            return indices, [], e


class _Collate:
    """`VQACollator` on a read batch, adding the dataset indices of its bad (None) and too-long records."""

    def __init__(self, collator: VQACollator) -> None:
        self.collator = collator

    def __call__(self,
                 read: tuple[list[int], list[dict[str, Any] | None], TinyVLMError | None]) -> dict[str, Any]:
        indices, records, error = read
        if error is not None:
            return {ERROR: error}
        batch, too_long = self.collator.collate(records)
        return {**batch, BAD: [i for i, record in zip(indices, records) if record is None],
                TOO_LONG: [indices[position] for position in too_long]}


def _ignore_ctrl_c(worker_id: int) -> None:
    """Ctrl-C sends SIGINT to every process of the terminal's group: workers leave it to the training process,
    which finishes its step and saves (training/signals.py), then shuts them down. SIGTERM keeps its default:
    it is how multiprocessing ends a worker that does not stop by itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def training_batches(records: CheckedRecords, sampler: Sampler[list[int]], collator: VQACollator,
                     num_workers: int, prefetch_factor: int,
                     pin_memory: bool) -> Iterator[Iterator[dict[str, Any]]]:
    """Batches of `records` in `sampler`'s order, whatever the number of workers; see `take_bookkeeping`."""
    with loader_batches(_Indexed(records), num_workers, prefetch_factor, pin_memory, batch_sampler=sampler,
                        collate_fn=_Collate(collator)) as batches:
        yield batches


@contextlib.contextmanager
def loader_batches(dataset: Dataset | IterableDataset, num_workers: int, prefetch_factor: int,
                   pin_memory: bool, **loader_options: Any) -> Iterator[Iterator[dict[str, Any]]]:
    """The batches of a DataLoader over `dataset` with `num_workers` worker processes (0: this process reads).

    The worker processes end with the block. Left to the garbage collector, they outlived the run, and
    collecting them later stalled the process ~5 s a worker: a collected reference cycle can close the
    workers' queues before the loader tells them to stop, so each is waited for until its timeout."""
    if num_workers:
        # tokenizers' warning on fork, and its deadlock risk
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workers = {"prefetch_factor": prefetch_factor, "persistent_workers": True,
               "worker_init_fn": _ignore_ctrl_c} if num_workers else {}
    batches = iter(DataLoader(dataset, num_workers=num_workers, pin_memory=pin_memory, **loader_options,
                              **workers))
    try:
        yield batches
    finally:
        if num_workers:
            batches._shutdown_workers()  # what the iterator's __del__ does; PyTorch has no public close


def take_bookkeeping(batch: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Pop a loader batch's bookkeeping, leaving the model's inputs: the dataset indices of its bad records
    and of its too-long ones. A data error met while reading the batch is raised here."""
    if ERROR in batch:
        raise batch[ERROR]
    return batch.pop(BAD), batch.pop(TOO_LONG)

