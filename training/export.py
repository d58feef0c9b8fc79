"""Turn a sharded (FSDP2) checkpoint into the ordinary `save_pretrained` layout, in one process, no GPU needed.

    python -m training.export runs/big/step_001000            # adds model.safetensors next to the shards
    python -m training.export runs/big/step_001000 --out exported/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from models import CheckpointError, ConfigError, VisionLanguageModel, VLMConfig
from models.checkpoints import SHARDED
from models.config import one_line
from training.distributed import read_sharded_weights


def export(checkpoint: Path, out: Path | None = None) -> Path:
    """Write config.json + model.safetensors (and the tokenizer files) of a sharded checkpoint into `out`."""
    if not (checkpoint / SHARDED).is_dir():
        raise CheckpointError(f"{checkpoint}: not a sharded checkpoint (no {SHARDED}/ directory)")
    out = out or checkpoint
    model = VisionLanguageModel(VLMConfig.from_json(checkpoint / "config.json"))
    read_sharded_weights(checkpoint / SHARDED, model)
    model.save_pretrained(out)
    if out != checkpoint:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_NNNNNN directory written with train.parallel=fsdp")
    parser.add_argument("--out", type=Path, help="where to write (default: into the checkpoint itself)")
    args = parser.parse_args(argv)
    try:
        print(f"exported {export(args.checkpoint, args.out)}")
    except (CheckpointError, CheckpointException, ConfigError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
