"""The serving engine: requests in, tokens out, many requests sharing each forward pass over a paged KV cache.

    engine = Engine(model, processor, ServingConfig(num_blocks=512))  # processor: data.chat_processors (or a
                                                                      # tokenizer); config: serving/config.py
    outputs = engine.generate([Request("What color is the circle?", [image]), Request("Describe the image.")])
    # a conversation: its earlier turns reuse cached blocks
    turns = [Message("system", "Answer in one word."), Message("user", "Color?", 1)]
    outputs = engine.generate([Request(turns, [image])])
    # a clip (data/video.py): its frames are the request's images
    outputs = engine.generate([Request("Which way?", video=read_video(path, model.config.video))])

or step by step (a server): `add_request`, then `step()` until `has_unfinished()` is False;
`abort(request_id)` drops a request and frees its blocks. Each step schedules (serving/scheduler.py), runs the
decode rows and the prompt chunks on the device (serving/runner.py), samples every row in one call, each with
its request's settings and generator, and does the bookkeeping: the host's work per running sequence is a few
attribute reads and appends, never a loop over its tokens or blocks. On a GPU steps overlap
(ServingConfig.overlap): each step is launched before the step before's sampled ids are read, so that
bookkeeping and the next schedule run while the device computes (see `step`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from data.chat_processors import ChatProcessor, CheckpointProcessor
from data.prompts import Message, PromptError
from models import InputError, VisionLanguageModel
from serving.block_manager import BlockManager
from serving.config import ServingConfig
from serving.packed_linear import onednn_available
from serving.requests import Output, Request, RequestError, Result, TokenLogprobs
from serving.runner import ModelRunner, SampledIds
from serving.scheduler import Scheduler
from serving.sequence import RequestState, Sequence, Status, token_keys
from serving.served_model import ServedModel
from serving.structured import Grammars, accepted


@dataclasses.dataclass
class Launched:
    """A step started on the device: the sequences it samples and their ids on the way back (None: it
    samples none, only prompt chunks that do not end their prompts)."""

    sampled_sequences: list[Sequence]
    sampled: SampledIds | None


class Engine:
    def __init__(self, model: VisionLanguageModel,
                 processor: ChatProcessor | CheckpointProcessor | None = None,
                 config: ServingConfig | None = None) -> None:
        """`processor` turns text prompts and PIL images into model inputs (data/chat_processors.py); a
        tokenizer is taken as tinyvlm's ChatML with it. Without one, requests give token ids and pixels.
        `config` (default: ServingConfig()): the kernel, decode fast paths, KV cache and batch limits,
        resolved here once for the model's device and dtype into `settings` (serving/config.py); ConfigError
        for settings that cannot run there. The model is run through serving/served_model.py alone."""
        self.model = ServedModel(model)
        if processor is not None and not isinstance(processor, (ChatProcessor, CheckpointProcessor)):
            processor = self.model.chat_processor(processor)
        self.processor = processor
        self.tokenizer = None if processor is None else processor.tokenizer
        kv = self.model.kv
        self.settings = (config or ServingConfig()).resolve(
            self.model.device.type, kv.dtype, kv_token_bytes=kv.token_bytes, context=self.model.context,
            onednn=onednn_available(),
        )
        settings = self.settings
        self.blocks = BlockManager(settings.num_blocks, settings.block_size)
        self.runner = ModelRunner(self.model, settings)
        self.scheduler = Scheduler(self.blocks, settings.max_num_seqs, settings.max_batch_tokens,
                                   settings.admission_batch)
        self.groups: dict[str, RequestState] = {}
        self.constrained = 0  # requests with a grammar among them: their masks need each token read first
        self.unread_step: Launched | None = None  # an overlapped step whose sampled ids are not read yet
        self._arrivals = itertools.count()
        self.prompt_tokens = self.generation_tokens = 0  # of the requests accepted, and the tokens sampled
        # steps launched, and those of them scheduled only after the step before was read (not overlapped)
        self.steps = self.steps_read_first = 0
        self.grammars = (None if self.tokenizer is None
                         else Grammars(self.tokenizer, self.model.vocab_size, self.model.stop_ids))

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> str:
        """Queue a request; returns its id. Raises RequestError for one that could never be served."""
        return self.enqueue(self.prepare(request))

    def enqueue(self, group: RequestState) -> str:
        if group.request_id in self.groups:
            raise RequestError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        self.constrained += group.grammar is not None
        self.scheduler.add(group)
        self.prompt_tokens += group.num_prompt
        return group.request_id

    def prepare(self, request: Request) -> RequestState:
        """The request checked and encoded, ready for `enqueue`; changes no engine state, so a server can call
        it from its own threads and answer a bad request at once. Raises RequestError.

        A clip whose frames leave no room in the context for max_tokens is refused (one line naming its
        frames), not sampled down: which frames the model sees is the caller's choice (the fps and
        max_frames it reads the clip with), and silently dropping some would answer another question."""
        request_id = request.request_id or f"req-{next(self._arrivals)}"
        prompt, images = self._encode(request)
        params, model = request.params, self.model
        if images is not None and images.device.type == "cpu" and model.device.type == "cuda":
            # pinned here, off the engine's thread, so that the step that starts it copies them to the device
            # without waiting for the step before (a copy from pageable memory blocks the host)
            images = images.pin_memory()
        context = model.context
        if params.max_tokens is None:  # as many as fit the context after the prompt, and the KV cache
            params = dataclasses.replace(params, max_tokens=self._room(len(prompt), params.n, context))
        if len(prompt) + params.max_tokens > context:
            clip = "" if request.video is None else (
                f"; the clip's {len(request.video.frames)} frames are in the prompt: sample fewer (a lower "
                "fps or max_frames)")
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"the context of {context} tokens{clip}")
        worst = self._blocks_needed(len(prompt), params.max_tokens, params.n)
        if worst > self.blocks.num_usable:
            raise RequestError(f"the request needs up to {worst} KV-cache blocks, more than the "
                               f"{self.blocks.num_usable} there are")
        if params.n > self.scheduler.max_num_seqs:
            raise RequestError(f"n ({params.n}) exceeds max_num_seqs ({self.scheduler.max_num_seqs})")
        stop = set() if params.ignore_eos else {*model.stop_ids, *params.stop_token_ids}
        generator = None
        if params.seed is not None:
            generator = torch.Generator(self.runner.device).manual_seed(params.seed)
        grammar = None
        if params.structure is not None:
            if self.grammars is None:
                raise RequestError("structured output needs the engine's tokenizer")
            grammar = self.grammars.compile(params.structure)
        placeholders = (
            np.flatnonzero(np.asarray(prompt) == model.image_token_id) if images is not None else []
        )
        group = RequestState(request_id, prompt, images, np.asarray(placeholders, np.int64), params,
                             frozenset(stop),
                      len(prompt) + params.max_tokens, next(self._arrivals), generator=generator,
                             grammar=grammar)
        group.sequences = [Sequence(group, 0, list(prompt),
                                    token_keys(prompt, images, model.image_token_id))]
        return group

    def _blocks_needed(self, prompt: int, max_tokens: int, n: int) -> int:
        """KV blocks a request may hold at worst: its prompt's, then each sample's own (one more for
        copy-on-write)."""
        blocks = self.blocks
        return blocks.blocks_for(prompt) + n * (
            blocks.blocks_for(prompt + max_tokens) - blocks.blocks_for(prompt) + 1
        )

    def _room(self, prompt: int, n: int, context: int) -> int:
        """The most new tokens a request of `prompt` tokens and n samples can be given: what fits the context
        after the prompt and the KV cache at worst (at least 1: a prompt that leaves no room is refused by the
        checks that follow)."""
        blocks = self.blocks
        prompt_blocks = blocks.blocks_for(prompt)
        # the most blocks one sample's tokens may span:
        # prompt_blocks + n * (span - prompt_blocks + 1) <= usable
        span = prompt_blocks + (blocks.num_usable - prompt_blocks) // n - 1
        return max(min(context - prompt, span * blocks.block_size - prompt), 1)

    def _encode(self, request: Request) -> tuple[list[int], Tensor | None]:
        """The request's prompt ids and pixels (a clip's frames: its images, keyed alike by the prefix
        cache)."""
        images = request.images
        turns = request.prompt if isinstance(request.prompt, list) else []
        conversation = bool(turns) and isinstance(turns[0], Message)
        if isinstance(request.prompt, str) or conversation:
            if self.processor is None:
                raise RequestError("a text prompt needs the engine's processor (or tokenizer)")
            if isinstance(images, Tensor):
                raise RequestError("a text prompt takes PIL images (the processor makes their pixels), not "
                                   "pixels")
            try:
                if conversation:
                    prompt, images = self.processor.encode_chat(request.prompt, images or [], request.video)
                else:
                    prompt, images = self.processor.encode(request.prompt, images or [], request.video)
            except PromptError as e:
                raise RequestError(str(e)) from None
        else:
            if request.video is not None:
                raise RequestError("a prompt of token ids takes processed pixels, not a video")
            if images is not None and not isinstance(images, Tensor):
                raise RequestError(
                    "a prompt of token ids takes processed pixels [N, C, H, W], not PIL images"
                )
            prompt = list(request.prompt)
            vocab = self.model.vocab_size
            if prompt and not all(0 <= token < vocab for token in prompt):
                raise RequestError(f"the prompt's token ids must lie in 0..{vocab - 1}")
        if not prompt:
            raise RequestError("the prompt is empty")
        model = self.model
        try:
            model.check_image_tokens(sum(token == model.image_token_id for token in prompt),
                                     0 if images is None else len(images) * model.tokens_per_image)
        except InputError as e:
            raise RequestError(str(e)) from None
        return prompt, images

    def abort(self, request_id: str) -> None:
        """Drop a request (a client that went away) and free its blocks; unknown or finished ids are
        ignored."""
        group = self.groups.get(request_id)
        if group is not None:
            self.runner.release(group.sequences)
            self._remove(group)

    def _remove(self, group: RequestState) -> None:
        """Drop a finished or aborted request: its blocks freed, its seats (taken back by the caller) and
        its place in the queue. Its pixels are freed now, not at the next garbage collection (a group and its
        sequences are a reference cycle, and an unread step may hold it): what bounds the clips
        `generate(max_pending=...)` holds."""
        self.scheduler.remove(group)
        del self.groups[group.request_id]
        self.constrained -= group.grammar is not None
        group.images = group.features = None

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # -- stepping --------------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """Run one step over the scheduled work; return the new tokens of every request that got some.

        Overlapped (settings.overlap), a step launches its work on the device and then reads the step
        before's sampled ids, so the host's reading, bookkeeping, scheduling and input preparation run while
        the device computes: the tokens returned are the step before's. Where the next step depends on those
        ids, the step before is read first: a request with a grammar (its mask), or a cache that might have
        to preempt (a sequence waiting on its token must keep its blocks)."""
        outputs = []
        previous, self.unread_step = self.unread_step, None
        read_first = previous is not None and bool(self.constrained or self.scheduler.may_preempt())
        if read_first:
            outputs, previous = self._read(previous), None
        launched = self._launch()
        if launched is not None:
            self.steps += 1
            self.steps_read_first += read_first
        if launched is None and previous is None and self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("no request can be admitted with an empty KV cache: the admission check is "
                               "wrong")
        if previous is not None:
            outputs = self._read(previous)
        if launched is not None and not self.settings.overlap:
            outputs, launched = self._read(launched), None
        self.unread_step = launched
        return outputs

    def _launch(self) -> Launched | None:
        """Schedule a step and start it on the device: its forward and sampling (None: nothing to run)."""
        planned = self.scheduler.schedule()
        self.runner.release(planned.preempted)
        self.runner.admit(planned.admitted)
        if planned.empty:
            return None
        self.runner.copy_blocks(planned.copies)
        logits = self.runner.forward(planned.decodes, planned.prefills)
        size = self.blocks.block_size
        for sequence in planned.decodes:
            sequence.num_computed += 1
            if sequence.num_computed % size == 0:  # its last block just filled
                self._register(sequence)
        to_sample, rows = list(planned.decodes), None
        if planned.prefills:  # the chunks that end a prompt are sampled (and fork into its n samples)
            rows = list(range(len(planned.decodes)))
            for row, (sequence, count) in enumerate(planned.prefills, start=len(planned.decodes)):
                sequence.num_computed += count
                self._register(sequence)
                if sequence.num_pending == 0:
                    samples = self._first_samples(sequence.group) if not sequence.group.forked else [sequence]
                    to_sample += samples
                    rows += [row] * len(samples)
        if not to_sample:
            return Launched([], None)
        sampled = self.runner.sample(logits, to_sample, rows)
        for sequence in to_sample:
            sequence.unread += 1
        return Launched(to_sample, sampled)

    def _read(self, launched: Launched) -> list[Output]:
        """A launched step's sampled ids, read from the device and applied."""
        if launched.sampled is None:
            return []
        return self._update(launched.sampled_sequences, *launched.sampled.read())

    def _register(self, sequence: Sequence) -> None:
        """Register the sequence's newly filled blocks for prefix reuse (a decode fills at most one): those
        whose tokens the host has read (an overlapped decode's block is registered when its last token is)."""
        known = min(sequence.num_computed, len(sequence.tokens))
        if known // self.blocks.block_size > sequence.num_registered:
            sequence.num_registered = self.blocks.commit(sequence.table, sequence.keys, sequence.hashes,
                                                         known, sequence.num_registered)

    def _first_samples(self, group: RequestState) -> list[Sequence]:
        """The prompt is done: its n samples start here (each from the prompt's logits), sharing its
        blocks."""
        self.runner.admit(self.scheduler.fork(group))
        return group.sequences

    def _update(self, sampled: list[Sequence], tokens: list[int | None],
                logprobs: list[TokenLogprobs | None] | None) -> list[Output]:
        """Append each sampled token, end the samples that stop, and report each request's new tokens. A
        sample whose grammar allowed no token (None) ends as it is, cut short: finish reason "length"."""
        outputs: dict[RequestState, Output] = {}
        ended: set[RequestState] = set()  # requests a sample of which ended this step
        for i, (sequence, token) in enumerate(zip(sampled, tokens)):
            sequence.unread -= 1
            group = sequence.group
            if sequence.finish_reason is not None or group.status is Status.FINISHED:
                continue  # an overlapped step's row of a sample that ended (or was aborted) meanwhile
            output = outputs.get(group)
            if output is None:
                output = outputs[group] = Output(group.request_id, [[] for _ in range(group.params.n)])
                if group.params.logprobs is not None:
                    output.logprobs = [[] for _ in range(group.params.n)]
            if token is None:  # its grammar allows no token: the answer ends where it is
                sequence.finish_reason = "length"
            else:
                sequence.append(token)
                self._register(sequence)
                self.generation_tokens += 1
                output.new_tokens[sequence.index].append(token)
                if output.logprobs is not None:
                    output.logprobs[sequence.index].append(logprobs[i])
                if token in group.stop_ids or (
                    sequence.matcher is not None and not accepted(sequence.matcher, token)
                ):
                    sequence.finish_reason = "stop"
                elif len(sequence.tokens) >= group.max_length:
                    sequence.finish_reason = "length"
                else:
                    continue
            self.runner.release([sequence])
            self.scheduler.finish(sequence)
            ended.add(group)
        for group, output in outputs.items():
            output.finish_reasons = [sequence.finish_reason for sequence in group.sequences]
            if group in ended and group.finished:
                output.finished = True
                self._remove(group)
        return list(outputs.values())

    # -- offline ---------------------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request], progress=None,
                 max_pending: int | None = None) -> list[Result]:
        """Serve every request to the end; results in the order given. `progress(done)` is called as requests
        end. With `max_pending`, `requests` is drawn from only while fewer than that many are unfinished: a
        generator that reads each request's images or clip as it is drawn holds at most that many at once
        (lmms-eval's video tasks), where a list is all read before the first step."""
        order, tokens, logprobs = [], {}, {}
        live, prompt_sizes = {}, {}  # the groups unfinished; (prompt tokens, cached tokens) of those ended
        pending = iter(requests)

        def draw() -> None:
            while max_pending is None or len(self.groups) < max_pending:
                request = next(pending, None)
                if request is None:
                    return
                request_id = self.add_request(request)
                order.append(request_id)
                group = live[request_id] = self.groups[request_id]
                tokens[request_id] = [[] for _ in range(group.params.n)]
                if group.params.logprobs is not None:
                    logprobs[request_id] = [[] for _ in range(group.params.n)]

        reasons: dict[str, list[str]] = {}
        draw()
        while self.has_unfinished():
            for output in self.step():
                for sample_tokens, new in zip(tokens[output.request_id], output.new_tokens):
                    sample_tokens.extend(new)
                for sample_logprobs, new in zip(logprobs.get(output.request_id, ()), output.logprobs or ()):
                    sample_logprobs.extend(new)
                if output.finished:
                    reasons[output.request_id] = output.finish_reasons
                    ended = live.pop(output.request_id)
                    prompt_sizes[output.request_id] = ended.num_prompt, ended.num_cached or 0
                    if progress:
                        progress(len(reasons))
            draw()
        return [Result(request_id, tokens[request_id], [self.decode(t) for t in tokens[request_id]],
                       reasons[request_id], *prompt_sizes[request_id], logprobs.get(request_id))
                for request_id in order]

    def decode(self, token_ids: list[int]) -> str:
        return (
            ""
            if self.tokenizer is None
            else self.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
        )

    def stats(self) -> dict[str, float]:
        """Running and waiting requests, KV blocks in use, prefix-cache lookups and hits (full prompt blocks)
        and hit rate, and so far: preemptions, prompt tokens accepted, tokens generated, steps launched and
        those scheduled only after the step before was read (overlapped steps: the ones not overlapped)."""
        blocks = self.blocks
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": blocks.num_usable - blocks.num_free, "kv_blocks_total": blocks.num_usable,
                "prefix_cache_lookups": blocks.lookups, "prefix_cache_hits": blocks.hits,
                "prefix_hit_rate": blocks.hits / blocks.lookups if blocks.lookups else 0.0,
                "preemptions": self.scheduler.num_preemptions, "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens, "steps": self.steps,
                "steps_read_first": self.steps_read_first}
