"""What a finished run leaves in its output directory: exact-match scores and metrics.json, the loss curve,
the prediction grid and one held-out image (and clip) for the demo."""

from __future__ import annotations

import json
import sys

from data import CheckedRecords
from data.video import write_video
from models import VisionLanguageModel
from training.evaluate import answer, exact_match, save_loss_curve, save_prediction_grid
from training.loop import Trainer, TrainState, peak_memory_mib
from training.run_dir import METRICS

GRID_EXAMPLES = 16


def write_results(model: VisionLanguageModel, trainer: Trainer, state: TrainState,
                  validation_records: CheckedRecords) -> dict:
    """Score `model` (the trained model, unwrapped) on held-out questions asked through the run's chat
    processor, write the artifacts; return the metrics. A stop signal (`trainer.stop`) ends the scoring after
    its batch: metrics.json is then written without held-out scores, saying so."""
    train_config, output_dir = trainer.config.train, trainer.output_dir
    metrics = {**state.summary(), "peak_memory_mib": round(peak_memory_mib(trainer.device)),
               "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    model.to(trainer.device)
    count = min(train_config.eval_questions, len(validation_records))
    records = [r for r in map(validation_records.__getitem__, range(count)) if r]
    stop = trainer.stop
    if records:
        predictions = answer(model, trainer.processor.tokenizer, trainer.processor, records, trainer.device,
                             stopped=lambda: stop.requested is not None)
    if stop.requested:
        metrics["stopped_by"] = f"{stop.requested} during the final evaluation"
        print(f"{stop.requested}: stopped during the final evaluation; the model is saved "
              f"(step_{state.step:06d}), metrics.json has no held-out scores", file=sys.stderr, flush=True)
    elif records:
        metrics.update(exact_match(records, predictions))
        save_prediction_grid(records[:GRID_EXAMPLES], predictions[:GRID_EXAMPLES],
                             output_dir / "predictions.png")
        with_image = [r for r in records if r["images"]]
        circles = [r for r in with_image if "circle" in json.dumps(r["texts"])]
        example = (circles or with_image or [None])[0]
        if example:
            example["images"][0].save(output_dir / "heldout_example.png")
        clips = [r for r in records if r.get("video")]
        clip = ([r for r in clips if "circle" in json.dumps(r["texts"])] or clips or [None])[0]
        if clip:  # for `generate.py --video`: the clip read back gives the very frames
            write_video(clip["video"], output_dir / "heldout_example.mp4", trainer.config.model.video.fps)
    save_loss_curve(state.history, state.validation, output_dir / "loss_curve.png")
    (output_dir / METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
    if trainer.wandb_run:
        trainer.wandb_run.log({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        trainer.wandb_run.finish()
    print(json.dumps(metrics, indent=2))
    return metrics
