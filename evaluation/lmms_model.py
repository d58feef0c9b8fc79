"""tinyvlm as an lmms-eval model (lmms-eval 0.7: `pip install -e ".[eval]"`), registered under the name
`tinyvlm`:

    python -m lmms_eval --model tinyvlm --model_args checkpoint=runs/tiny --tasks mmstar --batch_size 32
    python -m lmms_eval --model tinyvlm --tasks mme \\
        --model_args checkpoint=HuggingFaceTB/SmolVLM-256M-Instruct

Any checkpoint `generate.py` takes (tinyvlm's own, SmolVLM / Idefics3, nanoVLM; a directory or a hub id) is
asked the way it was trained: its own chat template and image splitting (data/chat_processors.py), every image
of a document in its prompt, or its video's frames (a video task's path, sampled as the checkpoint's `video`
settings say: data/video.py). `generate_until` runs all of a task's requests through the serving engine
(batched, greedy unless the task asks for a temperature); `loglikelihood` scores continuations with the
model's log-probabilities. Any setting of the engine (serving/config.py ServingConfig) is a model argument of
the same name: `--model_args checkpoint=runs/tiny,kv_cache_mib=2048,attention=gather`; `quantize=int8` (or
int4, int8-dynamic) quantizes the language model's linears (models/quantize.py), `quantize_vision=True` the
ViT's too. A document's images or clip are read and encoded only when its turn comes: at most
`max_pending` documents (default: twice `batch_size`) are held encoded at once in `generate_until`, and
`batch_size` in `loglikelihood`, however many a task has (a 64-frame clip of 512 px is ~200 MB encoded).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from lmms_eval.api.instance import GenerationResult, Instance
from lmms_eval.api.model import lmms
from lmms_eval.models.registry_v2 import ModelManifest
from PIL import Image

from data.collator import pad
from data.video import Clip, read_video
from loading import load_for_inference, pick_device
from models.errors import TinyVLMError
from serving.config import ServingConfig
from serving.engine import Engine
from serving.requests import Request, RequestParams
from typed_config import one_line

DEFAULT_MAX_NEW_TOKENS = 256


def manifest() -> ModelManifest:
    """lmms-eval's entry point (pyproject.toml, group "lmms_eval.models"): `--model tinyvlm` is this class."""
    return ModelManifest(model_id="tinyvlm", simple_class_path=f"{__name__}.TinyVLM")


# lmms-eval's model interface (lmms_eval/api/model.py), as its llava_hf model implements it.
class TinyVLM(lmms):
    """`checkpoint`: a directory or hub id (None: the newest run under runs/); `batch_size`: the rows of a
    log-likelihood forward, and the engine's sequences at once unless `max_num_seqs` says; `serving`: any
    other ServingConfig field by name (values as lmms-eval parses them, or as text). lmms-eval also passes its
    `max_batch_size`, which changes nothing; `quantize`: "int8", "int4" or "int8-dynamic" (`quantize_vision`:
    the ViT's too); `max_pending`: the documents `generate_until` holds encoded at once (default: twice
    `batch_size`, so that the engine's seats refill from encoded ones). A checkpoint that cannot be loaded, a
    quantization that cannot run or engine settings that do not fit end the process: one line, exit code
    2."""

    def __init__(self, checkpoint: str | None = None, device: str | None = None, batch_size: int | str = 16,
                 allow_pickle: bool = False, max_batch_size: int | None = None, quantize: str | None = None,
                 quantize_vision: bool = False, max_pending: int | str | None = None, **serving) -> None:
        super().__init__()
        self.device = pick_device(device or "auto")
        self.batch_size = int(batch_size)
        self.max_pending = int(max_pending or 2 * self.batch_size)
        try:
            config = ServingConfig.from_dict({"max_num_seqs": self.batch_size, **serving})
            self.model, self.processor = load_for_inference(checkpoint, self.device, allow_pickle,
                                                            quantization=quantize,
                                                            quantize_vision=quantize_vision)
            self.engine = Engine(self.model, self.processor, config)
        except TinyVLMError as e:  # lmms-eval would log any Exception with a traceback, then exit 0
            print(f"error: {one_line(e)}", file=sys.stderr)
            raise SystemExit(2) from None
        self.tokenizer = self.processor.tokenizer

    def _visuals(self, doc_to_visual, doc_id: int, task: str, split: str) -> tuple[list[Image.Image],
                                                                                  Clip | None]:
        """A document's images, or its video: a path, as lmms-eval's video tasks give it, its frames sampled
        as the checkpoint's `video` settings say (data/video.py)."""
        visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual is not None else []
        visuals = [v for v in visuals or [] if v is not None]
        videos = [v for v in visuals if isinstance(v, str)]
        images = [v for v in visuals if not isinstance(v, str)]
        if not all(isinstance(image, Image.Image) for image in images) or len(videos) > 1:
            raise NotImplementedError("tinyvlm takes images (PIL) or one video (a path), not audio")
        clip = read_video(videos[0], self.model.config.video) if videos else None
        return [image.convert("RGB") for image in images], clip

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Every request through the engine (greedy unless it asks for a temperature; as many new tokens as it
        asks for and the context holds), each document encoded as the engine takes it, at most `max_pending`
        at once; each answer cut at the first of its `until` strings."""
        results = self.engine.generate((self._request(*request.args) for request in requests),
                                       max_pending=self.max_pending)
        return [_cut(result.texts[0], _until(request.args[1])) for result, request in zip(results, requests)]

    def _request(self, context: str, gen_kwargs: dict, doc_to_visual, doc_id: int, task: str,
                 split: str) -> Request:
        """A generate_until document as an engine request: its prompt and pixels, its sampling settings."""
        images, video = self._visuals(doc_to_visual, doc_id, task, split)
        prompt, pixels = self.processor.encode(context, images, video)
        wanted = int(gen_kwargs.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
        context_length = self.model.config.language.max_position_embeddings
        return Request(prompt, pixels, RequestParams(temperature=float(gen_kwargs.get("temperature") or 0),
                                                     top_p=float(gen_kwargs.get("top_p") or 1.0),
                                                     max_tokens=max(min(wanted, context_length - len(prompt)),
                                                                    1)))

    @torch.no_grad()
    def loglikelihood(self, requests: list[Instance]) -> list[GenerationResult]:
        """(the continuation's negative log-likelihood, in nats, summed over its tokens; whether greedy
        decoding would give it) for each (context, continuation). Negated as lmms-eval's models return it: its
        multiple-choice tasks pick the choice with the smallest value. Each pair is wrapped in a
        GenerationResult: lmms-eval 0.7's evaluator turns a bare (float, bool) into its str, which its
        multiple-choice scoring cannot read."""
        scores = []
        for start in range(0, len(requests), self.batch_size):  # each forward's rows encoded for it alone
            chunk = requests[start : start + self.batch_size]
            scores += continuation_scores(self.model, [self._scored(*request.args) for request in chunk],
                                          self.tokenizer.pad_token_id, self.device)
        return [GenerationResult(text=score) for score in scores]

    def _scored(self, context: str, continuation, doc_to_visual, doc_id: int, task: str,
                split: str) -> tuple[list[int], list[int], torch.Tensor | None]:
        """A loglikelihood document as (prompt ids, continuation ids, pixels)."""
        if not isinstance(continuation, str):  # a task's doc_to_target, for "loglikelihood" tasks
            continuation = continuation(self.task_dict[task][split][doc_id])
        images, video = self._visuals(doc_to_visual, doc_id, task, split)
        prompt, pixels = self.processor.encode(context, images, video)
        return prompt, self.tokenizer.encode(continuation, add_special_tokens=False), pixels

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("tinyvlm answers single-round tasks (generate_until, loglikelihood)")


def continuation_scores(model, rows: Sequence[tuple[list[int], list[int], torch.Tensor | None]], pad_id: int,
                        device: torch.device) -> list[tuple[float, bool]]:
    """For each (prompt ids, continuation ids, prompt pixels): the continuation's summed negative
    log-likelihood under `model` after the prompt, and whether it is the greedy continuation. One right-padded
    forward for all rows."""
    ids, mask = pad([prompt + continuation for prompt, continuation, _ in rows], pad_id, "right")
    pixels = [p for _, _, p in rows if p is not None]
    logits, _ = model(ids.to(device), torch.cat(pixels).to(device) if pixels else None, mask.to(device))
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    scores = []
    for row, (prompt, continuation, _) in enumerate(rows):
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(continuation) - 1, device=device)
        wanted = torch.tensor(continuation, device=device)
        chosen = log_probs[row, positions]
        nll = -chosen.gather(1, wanted[:, None]).sum()
        scores.append((float(nll), bool((chosen.argmax(-1) == wanted).all())))
    return scores


def _until(gen_kwargs: dict) -> list[str]:
    until = gen_kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def _cut(text: str, until: list[str]) -> str:
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text
