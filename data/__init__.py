"""tinyvlm data: synthetic shapes VQA, real sources, image processing, tokenizers, prompts and batching."""

from data.bad_records import BadRecordError, CheckedRecords
from data.collator import VQACollator, left_pad, pad
from data.image_splitting import ImageInputs, ImageSplitter, marker_tokens, placeholder_ids, prepare_images
from data.images import ImageLoadError, ImageProcessor, load_image, to_rgb
from data.prompts import (
    CAPTION_PROMPT,
    IGNORE_INDEX,
    Message,
    PromptError,
    encode_chat,
    encode_conversation,
    encode_prompt,
)
from data.sampler import ResumableBatchSampler
from data.sources import (
    DataConfig,
    DataSourceError,
    build_datasets,
    load_cauldron,
    load_imagefolder,
    load_jsonl,
)
from data.synthetic import QUESTION_TYPES, ShapesConfig, make_shapes_dataset, shapes_datasets
from data.tokenizer import (
    IM_END,
    IM_START,
    IMAGE_TOKEN,
    PAD_TOKEN,
    TokenizerError,
    build_shapes_tokenizer,
    conversation_texts,
    prepare_tokenizer,
    stop_token_ids,
    text_lengths,
    token_id,
)

__all__ = [
    "BadRecordError", "CheckedRecords", "CAPTION_PROMPT", "IGNORE_INDEX", "IMAGE_TOKEN", "IM_END", "IM_START",
    "PAD_TOKEN", "QUESTION_TYPES", "DataConfig", "DataSourceError", "ImageInputs", "ImageLoadError",
    "ImageProcessor", "ImageSplitter", "Message", "PromptError", "ResumableBatchSampler", "ShapesConfig",
    "VQACollator", "build_datasets", "build_shapes_tokenizer", "conversation_texts", "encode_chat",
    "encode_conversation", "encode_prompt", "left_pad", "load_cauldron", "load_image", "load_imagefolder",
    "load_jsonl", "make_shapes_dataset", "marker_tokens", "pad", "placeholder_ids", "prepare_images",
    "prepare_tokenizer", "shapes_datasets", "stop_token_ids", "text_lengths", "to_rgb", "token_id",
    "TokenizerError",
]
