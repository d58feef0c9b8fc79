"""Typed configs for the vision tower, projector, language model and VLM (the engine: typed_config.py)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from models.split_config import SplitConfig, VideoConfig
from typed_config import Config, check

ImagePosition = Literal["before_text", "after_text"]


@dataclasses.dataclass
class VisionConfig(Config):
    """A SigLIP-style ViT (defaults: SigLIP-B/16 at 224 px)."""

    image_size: int = 224  # input side in pixels (images are resized to it; one tile when splitting)
    patch_size: int = 16  # side of a square patch in pixels: (image_size / patch_size)^2 patch tokens
    hidden_size: int = 768  # width of the ViT's tokens
    intermediate_size: int = 3072  # width of each MLP's hidden layer
    num_layers: int = 12  # transformer blocks
    num_heads: int = 12  # attention heads per block
    num_channels: int = 3  # colour channels of the input
    layer_norm_eps: float = 1e-6  # epsilon of each LayerNorm
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)  # per-channel mean subtracted from pixels in [0, 1]
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)  # per-channel standard deviation the pixels are divided by
    pretrained: str | None = None  # SigLIP checkpoint to load: local directory or hub id

    def __post_init__(self) -> None:
        self.check_at_least("vision", 1,
                            ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_layers",
                             "num_heads", "num_channels"))
        check(self.image_size % self.patch_size == 0,
              f"vision.image_size ({self.image_size}) must be divisible by vision.patch_size "
              f"({self.patch_size})")
        check(self.hidden_size % self.num_heads == 0,
              f"vision.hidden_size ({self.hidden_size}) must be divisible by vision.num_heads "
              f"({self.num_heads})")
        check(len(self.image_mean) == len(self.image_std) == self.num_channels,
              f"vision.image_mean and vision.image_std need {self.num_channels} values each")
        check(all(s > 0 for s in self.image_std), "vision.image_std values must be positive")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size**2


@dataclasses.dataclass
class ProjectorConfig(Config):
    """Pixel shuffle by `pixel_shuffle_factor` (fewer, wider patch tokens), then a linear map to the LM width,
    plus (with `position_embedding`) a learned embedding per image token, which tells the LM where each token
    came from."""

    pixel_shuffle_factor: int = 2  # merge factor x factor neighbouring patches into one image token
    position_embedding: bool = False  # add a learned embedding per image token (which cell it shows)

    def __post_init__(self) -> None:
        check(self.pixel_shuffle_factor >= 1,
              f"projector.pixel_shuffle_factor must be >= 1, got {self.pixel_shuffle_factor}")


@dataclasses.dataclass
class LanguageConfig(Config):
    """A Llama-style decoder (defaults: SmolLM2-135M)."""

    vocab_size: int = 49152  # token embeddings (training sets it from the tokenizer)
    hidden_size: int = 576  # width of the residual stream
    intermediate_size: int = 1536  # width of each SwiGLU MLP's hidden layer
    num_layers: int = 30  # decoder blocks
    num_heads: int = 9  # query heads per block
    # key/value heads per block (grouped-query attention: num_heads / num_kv_heads share one)
    num_kv_heads: int = 3
    max_position_embeddings: int = 8192  # the context length
    rope_theta: float = 100000.0  # base of the rotary position embedding's frequencies
    rms_norm_eps: float = 1e-5  # epsilon of each RMSNorm
    tie_word_embeddings: bool = True  # the output head reuses the token embedding matrix
    # the tokenizer's end-of-sequence id (training sets it from the tokenizer)
    eos_token_id: int | None = None
    # Llama checkpoint: local directory, hub id, .gguf path or package://pkg/file.gguf
    pretrained: str | None = None

    def __post_init__(self) -> None:
        self.check_at_least("language", 1,
                            ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "max_position_embeddings"))
        check(self.hidden_size % self.num_heads == 0,
              f"language.hidden_size ({self.hidden_size}) must be divisible by language.num_heads "
              f"({self.num_heads})")
        check(self.num_heads % self.num_kv_heads == 0,
              f"language.num_heads ({self.num_heads}) must be divisible by language.num_kv_heads "
              f"({self.num_kv_heads})")
        check(self.head_dim % 2 == 0,
              f"language head_dim ({self.head_dim}) must be even for rotary embeddings")
        check(self.rope_theta > 0 and self.rms_norm_eps > 0,
              "language.rope_theta and language.rms_norm_eps must be positive")
        check(self.eos_token_id is None or 0 <= self.eos_token_id < self.vocab_size,
              f"language.eos_token_id ({self.eos_token_id}) must lie in [0, vocab_size={self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass
class VLMConfig(Config):
    """The whole model: which pieces, the id of the image placeholder token in the LM vocabulary, and where a
    prompt's image tokens go (a property of how the model was trained, so it travels with the checkpoint)."""

    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    projector: ProjectorConfig = dataclasses.field(default_factory=ProjectorConfig)
    language: LanguageConfig = dataclasses.field(default_factory=LanguageConfig)
    splitting: SplitConfig = dataclasses.field(default_factory=SplitConfig)
    video: VideoConfig = dataclasses.field(default_factory=VideoConfig)  # clip sampling (data/video.py)
    # the image placeholder token's id (training sets it from the tokenizer)
    image_token_id: int | None = None
    # before_text: image tokens open the user turn (nanoVLM, Idefics3). after_text: they close it, so that in
    # a causal LM each image token can attend to the question and the image is read with the question in mind.
    image_position: ImagePosition = "before_text"
    # Tokens that end an answer (the chat format's end of turn and the tokenizer's EOS); empty in configs
    # written before this field, where the language model's eos_token_id is used (see `stop_ids`).
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        grid, factor = self.vision.grid_size, self.projector.pixel_shuffle_factor
        check(
            grid % factor == 0,
            f"the patch grid ({grid}x{grid}) must be divisible by projector.pixel_shuffle_factor ({factor})",
        )
        vocab = self.language.vocab_size
        check(self.image_token_id is None or 0 <= self.image_token_id < vocab,
              f"image_token_id ({self.image_token_id}) must lie in [0, language.vocab_size={vocab})")
        check(all(0 <= i < vocab for i in self.stop_token_ids),
              f"stop_token_ids {list(self.stop_token_ids)} must lie in [0, language.vocab_size={vocab})")
        if self.splitting.enabled:
            self.splitting.check_tile(self.vision.image_size)

    @property
    def stop_ids(self) -> list[int]:
        """The token ids generation stops at: `stop_token_ids`, else the language model's EOS (if any)."""
        if self.stop_token_ids:
            return list(self.stop_token_ids)
        return [] if self.language.eos_token_id is None else [self.language.eos_token_id]

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches // self.projector.pixel_shuffle_factor**2
