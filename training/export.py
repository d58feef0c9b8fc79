"""Export checkpoints: a sharded (FSDP2) one into the ordinary `save_pretrained` layout (one process, no GPU
needed), a LoRA one (an adapter and the model it adapts) merged into a plain checkpoint, or any tinyvlm model
as a transformers Idefics3 checkpoint, which transformers, vLLM and SGLang load (a SmolVLM2 one where its
processor takes video: a SmolVLM2 fine-tune's, with the model's `video` sampling).

    python -m training.export runs/big/step_001000            # adds model.safetensors next to the shards
    python -m training.export runs/big/step_001000 --out exported/
    python -m training.export --merge runs/lora merged/        # base + adapter -> one plain checkpoint
    python -m training.export --format idefics3 runs/tiny/step_002000 exported-idefics3/  # adapters merged
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from loading import PROCESSOR_FILES, SHARDED, find_checkpoint, load_checkpoint
from models import CheckpointError, ConfigError, VisionLanguageModel, VLMConfig
from models.lora import ADAPTER_CONFIG, adapter_base
from training.distributed import ShardError, read_sharded_weights
from typed_config import one_line


def export(checkpoint: Path, out: Path | None = None) -> Path:
    """Write config.json + model.safetensors (and the processor or tokenizer files) of a sharded checkpoint
    into `out`."""
    if not (checkpoint / SHARDED).is_dir():
        raise CheckpointError(f"{checkpoint}: not a sharded checkpoint (no {SHARDED}/ directory)")
    out = out or checkpoint
    model = VisionLanguageModel(VLMConfig.from_json(checkpoint / "config.json"))
    read_sharded_weights(checkpoint / SHARDED, model)
    model.save_pretrained(out)
    if out != checkpoint:
        copy_processor(checkpoint, out)
    return out


def export_merged(checkpoint: Path, out: Path) -> Path:
    """Write a LoRA checkpoint's base model with the adapter merged in, as a plain checkpoint (and its
    processor or tokenizer files) into `out`."""
    checkpoint = find_checkpoint(checkpoint)
    if adapter_base(checkpoint) is None:
        raise CheckpointError(f"{checkpoint}: not a LoRA checkpoint (no {ADAPTER_CONFIG}): nothing to merge")
    model, _ = load_checkpoint(checkpoint, torch.device("cpu"))
    model.save_pretrained(out)
    copy_processor(checkpoint, out)
    return out


# tinyvlm's ChatML (data/prompts.py encode_chat) for transformers' apply_chat_template: each message as
# <|im_start|>role\n + content + <|im_end|>\n, a user message's images (content parts {"type": "image"}, each
# IMAGE_PLACEHOLDERS of the model's image token) before its text, then <|im_start|>assistant\n.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}IMAGE_PLACEHOLDERS{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")


def export_idefics3(checkpoint: Path, out: Path) -> Path:
    """Write the tinyvlm checkpoint as a transformers Idefics3 one, with its processor (a SmolVLM fine-tune's)
    or its tokenizer; a tokenizer of tinyvlm's gets the chat template of tinyvlm's prompts, content parts
    included. A processor that takes video (SmolVLM2's) makes it a SmolVLM2 checkpoint whose video processor
    samples as the model's `config.video` says. (A model with tinyvlm's own prompts exports as Idefics3,
    without video: transformers' SmolVLM2 processor writes a conversation with a video through its built-in
    `User:` / `Assistant:` template, never the checkpoint's ChatML.)"""
    from models.idefics3 import export_idefics3 as write_idefics3
    from models.idefics3 import video_processor_config

    checkpoint = find_checkpoint(checkpoint)
    if adapter_base(checkpoint) is not None:  # a LoRA checkpoint: its base with the adapter merged in
        model, _ = load_checkpoint(checkpoint, torch.device("cpu"))
    else:
        model = VisionLanguageModel.from_pretrained(checkpoint)
    write_idefics3(model, out, video="video_sampling" in (video_processor_config(checkpoint) or {}))
    copy_processor(checkpoint, out, model.config)
    return out


def copy_processor(checkpoint: Path, out: Path, config: VLMConfig | None = None) -> None:
    """What inference needs besides the weights: the checkpoint's whole transformers processor where it has
    one (a SmolVLM fine-tune: image splitting settings and chat template too), else its tokenizer files, if
    any: with `config` (an Idefics3 export) a tokenizer of tinyvlm's own gets CHAT_TEMPLATE, which
    transformers' Idefics3 processor cannot replace (it writes Idefics3's own image tokens), and a video
    processor samples as `config.video` says."""
    if any((checkpoint / name).is_file() for name in PROCESSOR_FILES):
        from transformers import AutoProcessor

        from models.idefics3 import set_video_sampling

        processor = AutoProcessor.from_pretrained(checkpoint)
        if config is not None and getattr(processor, "video_processor", None) is not None:
            set_video_sampling(processor.video_processor, config.video)
        processor.save_pretrained(out)
    elif (checkpoint / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        from data import IMAGE_TOKEN

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        # (a model that splits images writes tile markers and tile counts no fixed template knows)
        if (config is not None and not config.splitting.enabled
                and tokenizer.convert_ids_to_tokens(config.image_token_id) == IMAGE_TOKEN):
            tokenizer.chat_template = CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDERS",
                                                            IMAGE_TOKEN * config.tokens_per_image)
        tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path,
                        help="a step_NNNNNN directory (sharded, or any for idefics3)")
    parser.add_argument("out", type=Path, nargs="?",
                        help="where to write (default: into the sharded checkpoint)")
    parser.add_argument("--out", type=Path, dest="out_option", help="the same as the OUT argument")
    parser.add_argument("--merge", action="store_true",
                        help="merge a LoRA checkpoint's adapter into its base model")
    parser.add_argument("--format", choices=["tinyvlm", "idefics3"], default="tinyvlm",
                        help="tinyvlm: a sharded checkpoint's weights as model.safetensors; idefics3: a "
                             "transformers Idefics3 checkpoint")
    args = parser.parse_args(argv)
    out = args.out or args.out_option
    try:
        if args.format == "idefics3":
            if out is None:
                parser.error("--format idefics3 needs an output directory")
            print(f"exported {export_idefics3(args.checkpoint, out)}")
        elif args.merge:
            if out is None:
                parser.error("--merge needs an output directory")
            print(f"exported {export_merged(args.checkpoint, out)}")
        else:
            print(f"exported {export(args.checkpoint, out)}")
    except (CheckpointError, ConfigError, ShardError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
