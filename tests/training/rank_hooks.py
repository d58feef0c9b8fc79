"""train.py with test hooks, for torchrun in tests/training/test_distributed.py (a hook in the test process
cannot reach the ranks):

    TINYVLM_TEST_HANG_RANK=r   rank r hangs in the step after its first: sleeps, alive, in no collective
                               (SIGTERM ends it)
    TINYVLM_TEST_DUMP_WEIGHTS  every rank saves its weights before and after training, as
                               train.output_dir/rank{r}_{before,after}.safetensors
    TINYVLM_TEST_COUNT_LEFTOVERS  every rank prints how many FSDP2 modules are alive when it destroys its
                                  process group
"""

import gc
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

from safetensors.torch import save_file  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import train  # noqa: E402
from training import distributed, loop  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def _hang_after_first_step(step):
    def hanging_step(*args, **kwargs):
        if calls:
            print(f"rank {RANK} hangs", flush=True)
            # torchrun's SIGTERM ends it: train.py's handler would only ask for a stop at the next step, and
            # torchrun waits 30 s for that before it sends SIGKILL.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(60)
        calls.append(1)
        return step(*args, **kwargs)

    calls = []
    return hanging_step


def _dumping_weights(run):
    def run_and_dump(trainer, state):
        _dump(trainer, "before")
        stopped_by = run(trainer, state)
        _dump(trainer, "after")
        return stopped_by

    return run_and_dump


def _counting_leftovers(destroy):
    def count_and_destroy(*args, **kwargs):
        alive = sum(isinstance(o, FSDPModule) for o in gc.get_objects())
        print(f"rank {RANK} destroys its process group with {alive} FSDP2 modules alive", flush=True)
        destroy(*args, **kwargs)

    return count_and_destroy


def _dump(trainer, when: str) -> None:
    trainer.output_dir.mkdir(parents=True, exist_ok=True)
    model = distributed.unwrap(trainer.model)
    weights = {name: p.detach().clone().contiguous() for name, p in model.named_parameters()}
    save_file(weights, trainer.output_dir / f"rank{RANK}_{when}.safetensors")


if __name__ == "__main__":
    if os.environ.get("TINYVLM_TEST_HANG_RANK") == str(RANK):
        loop.train_step = _hang_after_first_step(loop.train_step)
    if os.environ.get("TINYVLM_TEST_DUMP_WEIGHTS"):
        loop.run = _dumping_weights(loop.run)
    if os.environ.get("TINYVLM_TEST_COUNT_LEFTOVERS"):
        distributed.dist.destroy_process_group = _counting_leftovers(distributed.dist.destroy_process_group)
    sys.exit(train.main())
