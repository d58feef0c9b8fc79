"""tinyvlm's model package: import the VLM and its parts from here.

The core, in reading order (what a newcomer reads to follow images -> ViT -> projector -> blocks with a dict
KV cache -> generate: prefill, then decode at `start_pos` offsets):

    config.py                 the typed configs of the ViT, projector, language model and VLM
    vision_transformer.py     a SigLIP-compatible ViT
    modality_projector.py     pixel shuffle, then a linear map to the language model's width
    attention.py              rotary positions, masks, causal / grouped-query / Flex attention
    kv_cache.py               the per-block dict cache and its layouts (the seam serving/ plugs into)
    language_model.py         Llama blocks: (x, kv_cache) -> (x, kv_cache)
    sampling.py               temperature, top-k, top-p
    vision_language_model.py  embed, forward (the loss), stream / generate

Around it: released formats (llama.py, siglip.py, idefics3.py, nanovlm.py, gguf.py, checkpoints.py,
weights.py, split_config.py), inference fast paths wrapped from outside (compiled_decode.py,
fused_linear.py, quantize.py: int8 / int4 weights), training (linear_cross_entropy.py, lora.py). serving/ adds
the paged layout and its kernels.
"""

from models.config import LanguageConfig, ProjectorConfig, VisionConfig, VLMConfig
from models.errors import InputError, TinyVLMError
from models.kv_cache import kv_cache_bytes
from models.language_model import LanguageModel
from models.modality_projector import ModalityProjector
from models.sampling import SamplingParams
from models.vision_language_model import GenerationError, VisionLanguageModel
from models.vision_transformer import VisionTransformer
from models.weights import CheckpointError
from typed_config import ConfigError

__all__ = [
    "CheckpointError", "ConfigError", "GenerationError", "InputError", "TinyVLMError", "LanguageConfig",
    "LanguageModel", "ModalityProjector", "ProjectorConfig", "SamplingParams", "VLMConfig", "VisionConfig",
    "VisionLanguageModel", "VisionTransformer", "kv_cache_bytes",
]
