"""tinyvlm's model package: import the VLM and its parts from here."""

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
