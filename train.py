"""Train a vision-language model.

    python train.py                        # the tiny default: synthetic shapes, from scratch, CPU
    python train.py --config configs/smollm2-shapes.yaml  # real SmolLM2-135M-Instruct + a small ViT (GPU)
    python train.py --config configs/tiny.yaml --train.max_steps 200 --train.output_dir runs/try1
    python train.py --resume runs/tiny                    # continue from the newest complete checkpoint
    python train.py --init_from runs/tiny --data.source jsonl --data.path mine.jsonl \\
        --train.output_dir runs/tuned                     # fine-tune a run on your data, into runs/tuned
    torchrun --nproc-per-node 8 train.py --config configs/nanovlm-222m.yaml   # DDP on 8 GPUs (see README)
    python train.py --config configs/smolvlm-256m-finetune.yaml  # fine-tune a released VLM (GPU, hub)

Any config field can be set with `--section.field VALUE` (sections: model, data, train; and `--tokenizer`,
`--init_from`: a whole pretrained VLM to start from, with its own tokenizer and chat format).
A run writes checkpoints (`step_NNNNNN/`: model, tokenizer, training state), `metrics.json`, `loss_curve.png`,
`predictions.png` and `heldout_example.png` into `train.output_dir`; a fresh run refuses a directory that
holds another run (`--resume` it, name a new `--train.output_dir`, or `--train.overwrite true`). Ctrl-C or
SIGTERM saves what the run has (in the ViT's pre-training too) and prints the `--resume` command to go on.

This file is the command line only; the library is in training/ (run.py: one run; loop.py: the loop and its
state; setup.py: model and tokenizer) and data/ (sampler.py: the resumable batch sampler).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from training.signals import end_at_once

if __name__ == "__main__":  # before the imports below (~4 s): a Ctrl-C during them is one line too
    end_at_once()

from models import TinyVLMError  # noqa: E402
from training.checkpoint import RUN_CONFIG  # noqa: E402
from training.config import RunConfig, load_run_config, parse_overrides  # noqa: E402
from training.data_check import check_data  # noqa: E402
from training.distributed import lost_contact  # noqa: E402
from training.run import train  # noqa: E402
from training.run_dir import resume_point  # noqa: E402
from typed_config import one_line, settings_help  # noqa: E402

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"


def _parser(asked_help: bool) -> argparse.ArgumentParser:
    """The command line; with -h, every setting listed after the options (only then: listing them loads and
    checks configs/tiny.yaml)."""
    epilog = None
    if asked_help:
        settings = "\n".join(settings_help(load_run_config(DEFAULT_CONFIG, {})))
        epilog = f"settings (--section.field VALUE; values as configs/tiny.yaml sets them):\n{settings}"
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    parser.add_argument("--config", help="YAML run config (default: configs/tiny.yaml)")
    parser.add_argument("--resume", type=Path,
                        help="a run directory or checkpoint to continue from (a run stopped in its ViT's "
                        "pre-training continues that); the run goes on in the checkpoint's run directory")
    parser.add_argument("--check-data", action="store_true",
                        help="read and encode every record as training would "
                        "and report what it would meet (bad records by cause, token lengths, what max_length "
                        "drops); train nothing; exit 1 where training would stop on the data")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Train (or resume) as the command line says; the exit code: 0 done or stopped by a signal after a
    checkpoint, 2 a clear error (bad config, data or checkpoint, a resume with nothing left to train), 3 lost
    contact with the other ranks, 130 interrupted with nothing saved (a signal during the start-up, or a
    second one)."""
    parser = _parser(
        asked_help=any(arg in ("-h", "--help") for arg in (sys.argv[1:] if argv is None else argv))
    )
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        if args.resume:
            if args.check_data:
                parser.error("--check-data checks the data before a run starts: leave --resume out")
            checkpoint = resume_point(args.resume)
            # The run goes on where its checkpoint lies, not where it was first written: a copied or moved run
            # must not write into (and prune the checkpoints of) the original. --train.output_dir still wins.
            config = RunConfig.from_json(checkpoint / RUN_CONFIG).replace(
                {"train.output_dir": str(checkpoint.parent), **overrides})
            train(config, resume=checkpoint)
        else:
            config_path = args.config or DEFAULT_CONFIG
            # --init_from over the default recipe: its data and training, the start's own model
            keep_model = bool(args.config) or "init_from" not in overrides
            config = load_run_config(config_path, overrides, keep_model=keep_model)
            if args.check_data:
                return check_data(config)
            train(config)
    except TinyVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopped at once; nothing saved since the last checkpoint", file=sys.stderr)
        return 130
    except Exception as e:
        if not lost_contact(e):
            raise
        # another rank died or hung: torchrun reports which
        print(f"error: lost contact with the other ranks ({type(e).__name__}: {one_line(e, 300)})",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
