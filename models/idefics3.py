"""SmolVLM / Idefics3 checkpoints (transformers format; SmolVLM2's, model_type "smolvlm", with their video
sampling) as tinyvlm models, and tinyvlm models as Idefics3 (or, with video, SmolVLM2) checkpoints.

    model = VisionLanguageModel.from_pretrained("HuggingFaceTB/SmolVLM-256M-Instruct")   # dispatches here
    python -m training.export --format idefics3 runs/tiny/step_002000 exported/           # the way back

An Idefics3 model is a SigLIP vision tower, a pixel-shuffle connector and a Llama text model: tinyvlm's own
three modules, so loading is a mapping of config fields and weight names, and export is the same mapping
reversed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from models.config import ProjectorConfig, VLMConfig
from models.llama import HF_LLAMA_KEYS
from models.llama import config_from_hf as language_config_from_hf
from models.siglip import HF_SIGLIP_KEYS
from models.siglip import config_from_hf as vision_config_from_hf
from models.split_config import SplitConfig, VideoConfig
from models.weights import CheckpointError, atomic_write, read_json, read_weights, rename_keys

if TYPE_CHECKING:
    from models.vision_language_model import VisionLanguageModel

# Idefics3's parts: (its prefix, the prefix the SigLIP / Llama renaming rules expect, tinyvlm's prefix, the
# rules).
PARTS = (("model.vision_model.", "", "vision.", HF_SIGLIP_KEYS),
         ("model.connector.modality_projection.", "", "projector.", []),
         ("model.text_model.", "model.", "language.", HF_LLAMA_KEYS),
         ("lm_head.", "lm_head.", "language.", HF_LLAMA_KEYS))
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, as preprocessor_config.json stores it


def full_config(hf: dict) -> dict:
    """An Idefics3 (or SmolVLM2) config.json with every default filled in by transformers (hub configs list
    only what differs)."""
    from transformers import Idefics3Config, SmolVLMConfig

    return (SmolVLMConfig if hf.get("model_type") == "smolvlm" else Idefics3Config).from_dict(hf).to_dict()


def video_config(video_processor: dict | None) -> VideoConfig:
    """SmolVLM2's video sampling (`video_sampling`: fps, max_frames, video_size; a `size` beside it wins, as
    transformers' SmolVLMVideoProcessor has it); the defaults without one."""
    sampling = (video_processor or {}).get("video_sampling")
    if not sampling:
        return VideoConfig()
    size = video_processor.get("size", sampling.get("video_size", {}))
    return VideoConfig(fps=sampling.get("fps", VideoConfig.fps),
                       max_frames=sampling.get("max_frames", VideoConfig.max_frames),
                       max_side=size.get("longest_edge", VideoConfig.max_side))


def set_video_sampling(video_processor, video: VideoConfig) -> None:
    """Give transformers' SmolVLMVideoProcessor our sampling (`video_config`'s reverse: what it saves and
    samples with)."""
    size = {"longest_edge": video.max_side}
    video_processor.video_sampling = {"fps": video.fps, "max_frames": video.max_frames, "video_size": size}
    video_processor.fps, video_processor.num_frames, video_processor.size = video.fps, video.max_frames, size


def config_from_idefics3(hf: dict, preprocessor: dict | None = None, generation: dict | None = None,
                         video_processor: dict | None = None) -> VLMConfig:
    """Our config for an Idefics3 / SmolVLM2 `config.json` (+ its image and video processors' settings and
    generation_config.json)."""
    hf = full_config(hf)
    vision = hf["vision_config"]
    if vision.get("model_type") not in ("idefics3_vision", "smolvlm_vision"):
        raise CheckpointError(f"unsupported Idefics3 variant: vision model_type {vision.get('model_type')!r}")
    preprocessor = preprocessor or {}
    vision_config = vision_config_from_hf({**vision, "model_type": "siglip_vision_model"}, preprocessor)
    text = {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
    language = language_config_from_hf(text)
    generation = generation or {}
    stop = generation.get("eos_token_id", language.eos_token_id)
    tile = preprocessor.get("max_image_size", {}).get("longest_edge", vision_config.image_size)
    if tile != vision_config.image_size:
        raise CheckpointError(f"unsupported Idefics3 variant: max_image_size.longest_edge {tile} differs "
                              f"from the vision tower's image_size {vision_config.image_size}")
    resample = preprocessor.get("resample", LANCZOS)
    if resample != LANCZOS:
        raise CheckpointError(f"unsupported Idefics3 variant: resample {resample} (only LANCZOS, 1)")
    splitting = SplitConfig(enabled=bool(preprocessor.get("do_image_splitting", False)),
                            max_image_size=preprocessor.get("size", {}).get("longest_edge", 4 * tile),
                            layout="idefics3", resample="lanczos")
    return VLMConfig(vision=vision_config, projector=ProjectorConfig(pixel_shuffle_factor=hf["scale_factor"]),
                     language=language, splitting=splitting, video=video_config(video_processor),
                     image_token_id=hf["image_token_id"],
                     image_position="before_text",
                     stop_token_ids=tuple(stop if isinstance(stop, list) else [] if stop is None else [stop]))


def to_tinyvlm_key(key: str) -> str:
    """An Idefics3 weight name as tinyvlm's (a name outside the four parts is kept, so load_checked reports
    it)."""
    for prefix, hf_prefix, ours, rules in PARTS:
        if key.startswith(prefix):
            return ours + next(iter(rename_keys({hf_prefix + key.removeprefix(prefix): None}, rules)))
    return key


def _optional_json(path: Path) -> dict | None:
    return read_json(path) if path.is_file() else None


def image_processor_config(path: Path) -> dict | None:
    """The image processor's settings: preprocessor_config.json (transformers 4), or the `image_processor`
    entry of processor_config.json (transformers 5)."""
    return (_optional_json(path / "preprocessor_config.json")
            or (_optional_json(path / "processor_config.json") or {}).get("image_processor"))


def video_processor_config(path: Path) -> dict | None:
    """The video processor's settings: video_preprocessor_config.json, the `video_processor` entry of
    processor_config.json (transformers 5), or the image processor's (SmolVLM2's first releases kept
    `video_sampling` there)."""
    return (_optional_json(path / "video_preprocessor_config.json")
            or (_optional_json(path / "processor_config.json") or {}).get("video_processor")
            or image_processor_config(path))


def read_idefics3(
    path: Path, hf_config: dict, allow_pickle: bool = False
) -> tuple[VLMConfig, dict[str, torch.Tensor]]:
    """The tinyvlm config and weights (tinyvlm's names) of the Idefics3 checkpoint directory `path`."""
    generation = _optional_json(path / "generation_config.json")
    config = config_from_idefics3(hf_config, image_processor_config(path), generation,
                                  video_processor_config(path))
    weights = {to_tinyvlm_key(k): v for k, v in read_weights(path, allow_pickle).items()}
    if config.language.tie_word_embeddings:
        weights.pop("language.head.weight", None)
    return config, weights


def idefics3_config(config: VLMConfig, video: bool = False):
    """transformers' Idefics3Config (SmolVLMConfig with `video`: the same model, which transformers' SmolVLM2
    classes run) for a tinyvlm config, or a CheckpointError naming the field Idefics3 lacks."""
    from transformers import Idefics3Config, SmolVLMConfig

    misfits = {
        # Idefics3 has no per-token embedding
        "projector.position_embedding": config.projector.position_embedding,
        "image_position": config.image_position != "before_text",
        "image_token_id": config.image_token_id is None,
        "splitting.layout": config.splitting.enabled and config.splitting.layout != "idefics3",
        "splitting.resample": config.splitting.enabled and config.splitting.resample != "lanczos",
    }
    if bad := [name for name, misfit in misfits.items() if misfit]:
        raise CheckpointError(f"this model does not fit the Idefics3 architecture: {', '.join(bad)} "
                              f"({', '.join(f'{n}={_field(config, n)!r}' for n in bad)})")
    vision, language = config.vision, config.language
    return (SmolVLMConfig if video else Idefics3Config)(
        vision_config=dict(
            model_type="smolvlm_vision" if video else "idefics3_vision",
            hidden_size=vision.hidden_size,
            intermediate_size=vision.intermediate_size,
            num_hidden_layers=vision.num_layers,
            num_attention_heads=vision.num_heads,
            num_channels=vision.num_channels,
            image_size=vision.image_size,
            patch_size=vision.patch_size,
            layer_norm_eps=vision.layer_norm_eps,
            hidden_act="gelu_pytorch_tanh",
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=language.vocab_size,
            hidden_size=language.hidden_size,
            intermediate_size=language.intermediate_size,
            num_hidden_layers=language.num_layers,
            num_attention_heads=language.num_heads,
            num_key_value_heads=language.num_kv_heads,
            head_dim=language.head_dim,
            max_position_embeddings=language.max_position_embeddings,
            rope_theta=language.rope_theta,
            rms_norm_eps=language.rms_norm_eps,
            tie_word_embeddings=language.tie_word_embeddings,
            eos_token_id=language.eos_token_id,
        ),
        scale_factor=config.projector.pixel_shuffle_factor,
        image_token_id=config.image_token_id,
        tie_word_embeddings=language.tie_word_embeddings,
        architectures=[f"{'SmolVLM' if video else 'Idefics3'}ForConditionalGeneration"],
    )


def _field(config: VLMConfig, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def export_idefics3(model: VisionLanguageModel, out: Path, video: bool = False) -> None:
    """Write `model` as a transformers Idefics3 checkpoint (SmolVLM2's with `video`: its processor, written
    beside, carries the video sampling): config.json, model.safetensors (Idefics3's weight names),
    generation_config.json (the stop tokens) and preprocessor_config.json (the image splitting settings)."""
    import json

    from safetensors.torch import save_file
    from transformers import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration

    hf_config = idefics3_config(model.config, video)
    with torch.device("meta"):  # the names transformers expects, without allocating its weights
        model_class = SmolVLMForConditionalGeneration if video else Idefics3ForConditionalGeneration
        names = list(model_class(hf_config).state_dict())
    ours = model.state_dict()
    tensors = {name: ours[to_tinyvlm_key(name)].detach().contiguous().cpu() for name in names
               if not (hf_config.tie_word_embeddings and name == "lm_head.weight")}
    vision, splitting = model.config.vision, model.config.splitting
    files = {
        "config.json": hf_config.to_dict(),
        "generation_config.json": {"eos_token_id": model.config.stop_ids, "bos_token_id": None},
        "preprocessor_config.json": {
            "image_processor_type": f"{'SmolVLM' if video else 'Idefics3'}ImageProcessor",
            "do_image_splitting": splitting.enabled,
            "size": {"longest_edge": splitting.max_image_size if splitting.enabled else vision.image_size},
            "max_image_size": {"longest_edge": vision.image_size},
            "resample": LANCZOS,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(vision.image_mean),
            "image_std": list(vision.image_std),
            "do_pad": True,
            "do_convert_rgb": True,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    for name, content in files.items():
        atomic_write(out / name,
                     lambda tmp, content=content: tmp.write_text(json.dumps(content, indent=2) + "\n"))
