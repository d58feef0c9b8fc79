"""A run config small enough to train in seconds on a CPU."""

from training.config import RunConfig, load_run_config

SMALL = {
    "model.vision.image_size": "32", "model.vision.patch_size": "8", "model.vision.hidden_size": "32",
    "model.vision.intermediate_size": "64", "model.vision.num_layers": "1", "model.vision.num_heads": "2",
    "model.projector.pixel_shuffle_factor": "1",  # 4x4 patches -> 16 image tokens
    "model.language.hidden_size": "48", "model.language.intermediate_size": "96",
    "model.language.num_layers": "2", "model.language.num_heads": "4", "model.language.num_kv_heads": "2",
    "data.shapes.image_size": "32", "data.shapes.num_train": "256", "data.shapes.num_validation": "16",
    "train.batch_size": "8", "train.eval_questions": "8", "train.eval_batches": "1",
    "train.warmup_steps": "2", "train.log_every": "1", "train.device": "cpu", "train.lr_projector": "0.01",
    "train.lr_vision": "0.01", "train.lr_language": "0.01", "train.vision_pretrain_steps": "0",
    "train.min_lr_tail_fraction": "0",  # the cosine over all of max_steps (tiny.yaml ends it 20% before)
}

# A 3x3 patch grid, so that the ViT can be pre-trained on the scenes' cells; the ViT then stays frozen.
PRETRAINED_VIT = {"model.vision.image_size": "48", "model.vision.patch_size": "16",
                  "data.shapes.image_size": "48", "model.projector.pixel_shuffle_factor": "1",
                  "train.vision_pretrain_steps": "3", "train.vision_pretrain_batch_size": "8",
                  "train.lr_vision": "0"}


def small_config(tmp_path, **overrides) -> RunConfig:
    return load_run_config("configs/tiny.yaml", {**SMALL, "train.output_dir": str(tmp_path), **overrides})
