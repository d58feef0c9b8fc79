"""The VLM: images -> ViT -> projector -> embeddings at the image-token positions -> language model.

    from models import VisionLanguageModel
    model = VisionLanguageModel.from_pretrained("runs/tiny")          # config.json + model.safetensors
    tokens = model.generate(input_ids, images, attention_mask, max_new_tokens=32, greedy=True)
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import Tensor, nn

from models.checkpoints import QUANTIZATION, read_checkpoint
from models.compiled_decode import bucket_capacity, compiled_step, pad_rows, shape_static
from models.config import VLMConfig
from models.errors import InputError, TinyVLMError
from models.fused_linear import fuse_projections
from models.kv_cache import repeat_rows
from models.language_model import LanguageModel
from models.linear_cross_entropy import head_and_loss
from models.modality_projector import ModalityProjector
from models.quantize import check_savable, describe, quantize_as
from models.sampling import SamplingParams, sample
from models.vision_transformer import VisionTransformer
from models.weights import atomic_write, load_checked, read_json, save_weights

STOP_CHECK_INTERVAL = 8  # generate's decode steps between host-side "has every row finished?" checks


class GenerationError(TinyVLMError, ValueError):
    """Generation settings or inputs that cannot work (for example a prompt longer than the context)."""


# nanoVLM's VisionLanguageModel (Hugging Face, 2025), with batched left padding and a preallocated cache.
class VisionLanguageModel(nn.Module, PyTorchModelHubMixin, library_name="tinyvlm",
                          tags=["vision-language-model"]):
    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionTransformer(config.vision)
        self.projector = ModalityProjector(config)
        self.language = LanguageModel(config.language)

    @classmethod
    def from_backbones(cls, config: VLMConfig, allow_pickle: bool = False) -> VisionLanguageModel:
        """A new VLM whose vision tower and/or language model are loaded from `config`'s `pretrained` sources
        (their architecture fields are then taken from those checkpoints)."""
        vision = (VisionTransformer.from_pretrained(config.vision.pretrained, allow_pickle)
                  if config.vision.pretrained else None)
        language = (LanguageModel.from_pretrained(config.language.pretrained, allow_pickle)
                    if config.language.pretrained else None)
        config = dataclasses.replace(config, vision=vision.config if vision else config.vision,
                                     language=language.config if language else config.language)
        model = cls(config)
        if vision:
            model.vision = vision
        if language:
            model.language = language
        return model

    def tied_weight_keys(self) -> list[str]:
        return [f"language.{key}" for key in self.language.tied_weight_keys()]

    def fuse_projections(self) -> VisionLanguageModel:
        """For inference: the q/k/v projections of every block (LM and ViT) and the LM's gate/up projections
        each run as one matmul (models/fused_linear.py), 3 kernels fewer per LM block. The weights are
        copied once; saving, exporting and loading still see the separate tensors. Plain layers only:
        merge LoRA adapters first (models/lora.py), and do not fuse a model to train."""
        fuse_projections(self)
        return self

    def resize_token_embeddings(self, vocab_size: int, image_token_id: int | None = None) -> None:
        """Resize the LM vocabulary (after adding image / special tokens to the tokenizer) and record the
        image id."""
        self.language.resize_token_embeddings(vocab_size)
        image_token_id = self.config.image_token_id if image_token_id is None else image_token_id
        self.config = dataclasses.replace(self.config, language=self.language.config,
                                          image_token_id=image_token_id)

    def image_features(self, images: Tensor, checkpoint_activations: bool = False) -> Tensor:
        """The LM-space embeddings of `images` [N, C, H, W]: [N, tokens_per_image, hidden]."""
        pixels = images.to(self.language.token_embedding.weight.dtype)
        return self.projector(self.vision(pixels, checkpoint_activations))

    def _image_slots(self, input_ids: Tensor) -> Tensor:
        """[B, T] bool: the image-token placeholders of `input_ids`."""
        return input_ids == (-1 if self.config.image_token_id is None else self.config.image_token_id)

    def check_image_tokens(self, num_slots: int, num_features: int) -> None:
        """InputError unless the prompts' `num_slots` placeholders are one per image feature (token)."""
        if num_slots != num_features:
            per_image = self.config.tokens_per_image
            raise InputError(f"the prompts hold {num_slots} image tokens but the images give {num_features} "
                             f"({num_features // per_image} image(s) of {per_image} tokens)")

    def embed(self, input_ids: Tensor, images: Tensor | None = None, features: Tensor | None = None,
              slots: Tensor | None = None) -> Tensor:
        """Token embeddings [B, T, C] with the projected image patches written at the image-token positions,
        in the row-major order of the placeholders. `features` (rows of `image_features`) may stand in for
        `images` (a prompt chunk takes its part of an image's). `slots`, where not every image-token id is
        a placeholder (a generated one is a token): a [B, T] bool mask, or indices into the flat B x T
        tokens."""
        embeddings = self.language.token_embedding(input_ids)
        if slots is None:
            slots = self._image_slots(input_ids)
        if features is None and images is not None and len(images):
            features = self.image_features(images)
        num_features = 0 if features is None else features.shape[:-1].numel()
        # Counting a mask's placeholders reads a value back from the device: eager calls only (compiled
        # training trusts the collator; generate(compile=True) counts them before its compiled prefill).
        if slots.dtype != torch.bool:
            num_slots = slots.numel()
        else:
            num_slots = num_features if torch.compiler.is_compiling() else int(slots.sum())
        self.check_image_tokens(num_slots, num_features)
        if num_features == 0:
            return embeddings
        # under autocast the projector returns bfloat16 while embeddings stay float32
        features = features.to(embeddings.dtype)
        if slots.dtype != torch.bool:
            return embeddings.flatten(0, 1).index_copy(0, slots, features.flatten(0, -2)).view_as(embeddings)
        return embeddings.masked_scatter(slots.unsqueeze(-1), features)

    def forward(self, input_ids: Tensor, images: Tensor | None = None, attention_mask: Tensor | None = None,
                targets: Tensor | None = None, reduction: Literal["mean", "sum", "none"] = "mean",
                return_logits: bool = True, *, chunked_loss: bool = False, flex_attention: bool = False,
                checkpoint_activations: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """Logits [B, T, V] and, given `targets` [B, T] (the token to predict at each position, -100 to skip),
        the cross-entropy (models/linear_cross_entropy.py `head_and_loss`). return_logits=False (training)
        returns None for the logits; with `chunked_loss` the loss is then computed a chunk at a time.
        Training's options (train.py sets them): see LanguageModel.forward."""
        has_images = images is not None and len(images) > 0
        features = self.image_features(images, checkpoint_activations) if has_images else None
        embeddings = self.embed(input_ids, features=features)
        hidden, _ = self.language(embeddings, attention_mask, flex_attention=flex_attention,
                                  checkpoint_activations=checkpoint_activations)
        return head_and_loss(hidden, self.language.head, targets, reduction, return_logits, chunked_loss)

    @torch.inference_mode()
    def stream(self, input_ids: Tensor, images: Tensor | None = None, attention_mask: Tensor | None = None, *,
               max_new_tokens: int = 64, greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, num_samples: int = 1, eos_token_id: int | list[int] | None = None,
               pad_token_id: int | None = None, use_cache: bool = True, compile: bool = False,
               generator: torch.Generator | None = None, stop_check_every: int = 1) -> Iterator[Tensor]:
        """Prefill image + prompt tokens in one pass, then decode one token a step at `start_pos` offsets in
        a preallocated cache (use_cache=False: recompute the whole sequence); yield each step's tokens [B *
        num_samples] (a prompt's samples adjacent) until every row has yielded an `eos_token_id` (checked
        every `stop_check_every` steps, a device read each); rows that finished yield `pad_token_id`.
        input_ids [B, T] are left-padded with `attention_mask` [B, T] (1 real, 0 pad); each row's rotary
        positions start at its first real token. compile=True: the decode step shape-static through
        torch.compile (models/compiled_decode.py; CUDA graphs on a GPU), the prefill with symbolic sizes."""
        params = SamplingParams(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
        prompt_len = input_ids.shape[1]
        capacity = self._capacity(prompt_len, max_new_tokens, num_samples, stop_check_every,
                                  static=compile and use_cache)
        eos_ids = torch.tensor(([] if eos_token_id is None
                                else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id),
                               device=input_ids.device, dtype=torch.long)
        pad_token_id = pad_token_id if pad_token_id is not None else (int(eos_ids[0]) if len(eos_ids) else 0)
        logits, embeddings, mask, cache = self._prefill(
            input_ids, images, attention_mask, capacity, num_samples, use_cache, compile
        )
        rows = logits.shape[0]
        step_fn, position = self.decode_step, prompt_len
        # shape-static: rows padded to a bucket (masked out), the position a device tensor
        if compile and use_cache:
            step_fn = functools.partial(compiled_step("decode", input_ids.device.type), self)
            position = torch.tensor(prompt_len, device=input_ids.device)
            mask, cache = shape_static(mask, cache, rows, capacity)
        done = torch.zeros(rows, dtype=torch.bool, device=logits.device)
        for step in range(max_new_tokens):
            token = sample(logits, params, generator).masked_fill(done, pad_token_id)
            yield token
            done |= torch.isin(token, eos_ids)
            checks = len(eos_ids) and step % stop_check_every == stop_check_every - 1
            if step == max_new_tokens - 1 or (checks and bool(done.all())):
                return
            if use_cache:
                logits = step_fn(pad_rows(token, cache[0]["key"].shape[0], pad_token_id), mask, cache,
                                 position)[:rows]
                position += 1
            else:
                embeddings = torch.cat([embeddings, self.language.token_embedding(token[:, None])], dim=1)
                hidden, _ = self.language(
                    embeddings, None if mask is None else mask[:, : embeddings.shape[1]]
                )
                logits = self.language.head(hidden[:, -1])

    def _prefill(self, input_ids: Tensor, images: Tensor | None, attention_mask: Tensor | None, capacity: int,
                 num_samples: int, use_cache: bool,
                 compile: bool = False) -> tuple[Tensor, Tensor, Tensor | None, list[dict] | None]:
        """Image + prompt tokens in one pass into a cache of `capacity` positions: the last position's logits,
        the input embeddings, the attention mask over the whole capacity and the cache, each repeated for
        `num_samples` (one prefill serves every sample: its cache rows are copied, not recomputed). With
        `compile` (and a cache) the pass runs through torch.compile."""
        batch, prompt_len = input_ids.shape
        mask = None
        if attention_mask is not None:
            mask = torch.ones(batch, capacity, dtype=torch.long, device=input_ids.device)
            mask[:, :prompt_len] = attention_mask
        cache = self.language.allocate_kv_cache(batch, capacity) if use_cache else None
        prefill = self.prefill_logits
        if compile and use_cache:
            # the compiled graph takes the image tokens' count on trust: counted here, eagerly
            self.check_image_tokens(int(self._image_slots(input_ids).sum()),
                                     0 if images is None else len(images) * self.config.tokens_per_image)
            prefill = functools.partial(compiled_step("prefill", input_ids.device.type), self)
        logits, embeddings = prefill(input_ids, images, mask, cache)
        if num_samples > 1:
            logits = logits.repeat_interleave(num_samples, 0)
            embeddings = embeddings.repeat_interleave(num_samples, 0)
            mask = None if mask is None else mask.repeat_interleave(num_samples, 0)
            cache = repeat_rows(cache, num_samples) if use_cache else None
        return logits, embeddings, mask, cache

    def _capacity(self, prompt_len: int, max_new_tokens: int, num_samples: int, stop_check_every: int,
                  static: bool) -> int:
        """The cache slots a generation needs (rounded up to a bucket for the shape-static step);
        GenerationError where the request cannot be served."""
        capacity, context = prompt_len + max_new_tokens, self.config.language.max_position_embeddings
        if max_new_tokens < 1 or num_samples < 1:
            raise GenerationError(f"max_new_tokens and num_samples must be >= 1, "
                                  f"got {max_new_tokens} and {num_samples}")
        if stop_check_every < 1:
            raise GenerationError(f"stop_check_every must be >= 1, got {stop_check_every}")
        if capacity > context:
            raise GenerationError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) "
                                  f"exceeds the context of {context} tokens")
        return bucket_capacity(capacity, context) if static else capacity

    def decode_step(self, token: Tensor, mask: Tensor | None, cache: list[dict[str, Tensor]],
                    position: int | Tensor) -> Tensor:
        """One decode step: `token` [B] enters the cache at slot `position`; returns the next logits [B,
        V]."""
        hidden, _ = self.language(
            self.language.token_embedding(token[:, None]), mask, cache, start_pos=position
        )
        return self.language.head(hidden[:, -1])

    def prefill_logits(self, input_ids: Tensor, images: Tensor | None, mask: Tensor | None,
                       cache: list[dict] | None) -> tuple[Tensor, Tensor]:
        """Image + prompt tokens through the model, their K/V written into `cache` in place: the last
        position's logits [B, V] and the input embeddings [B, T, C]."""
        embeddings = self.embed(input_ids, images)
        hidden, _ = self.language(embeddings, mask, cache)
        return self.language.head(hidden[:, -1]), embeddings

    def generate(self, input_ids: Tensor, images: Tensor | None = None, attention_mask: Tensor | None = None,
                 **settings) -> Tensor:
        """New tokens [B * num_samples, steps]; see `stream` for the settings. Rows end with pads after
        EOS."""
        settings.setdefault("stop_check_every", STOP_CHECK_INTERVAL)
        return torch.stack(list(self.stream(input_ids, images, attention_mask, **settings)), dim=1)

    def save_pretrained(self, save_directory: str | Path, **settings) -> str | None:
        """huggingface_hub's `save_pretrained`, refused in one line before it creates the directory or removes
        a config.json there for a model whose quantized weights cannot be saved (models/quantize.py
        `check_savable`)."""
        check_savable(self)
        return super().save_pretrained(save_directory, **settings)

    def _save_pretrained(self, save_directory: Path) -> None:
        """config.json + model.safetensors, each written atomically (temporary file, fsync, rename). A
        quantized model's quantized weights are saved as their integers and scales, and config.json says what
        is quantized (models/quantize.py)."""
        save_weights(self, Path(save_directory) / "model.safetensors")
        config = self.config.to_dict()
        if quantized := describe(self):
            config[QUANTIZATION] = quantized
        atomic_write(Path(save_directory) / "config.json",
                     lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))

    @classmethod
    def from_pretrained(cls, source: str | Path, map_location: str | torch.device = "cpu",
                        allow_pickle: bool = False) -> VisionLanguageModel:
        """A checkpoint directory or hub id: tinyvlm's own, Idefics3 / SmolVLM or nanoVLM
        (models/checkpoints.py). With `allow_pickle`, a `pytorch_model.bin` will also do. A quantized one
        (saved quantized) comes back fused and quantized, with the weights it was saved with."""
        config, weights, path = read_checkpoint(source, allow_pickle)
        model = cls(config)
        if quantized := read_json(path / "config.json").get(QUANTIZATION):
            quantize_as(model.to(map_location).fuse_projections(), quantized)
        load_checked(model, weights, path)
        return model.to(map_location)
