"""lmms-eval video documents (a video task's `doc_to_visual` gives the clip's path): `generate_until` answers
as `generate` does on the clip's frames, sampled as the checkpoint's `video` settings say, and
`loglikelihood` scores a continuation as a float64 forward over the same prompt and frames."""

import pytest
import torch

from data.video import read_video
from tests.data.test_video import write_clip
from tests.models.helpers import base_tokenizer, chat_vlm

pytest.importorskip("lmms_eval", reason="lmms-eval is the [eval] extra (make install installs it)")
from lmms_eval.api.instance import Instance  # noqa: E402

from evaluation.lmms_model import TinyVLM  # noqa: E402

QUESTION = "Which way does the square move?"


@torch.no_grad()
def test_a_video_document_is_answered_and_scored_on_its_sampled_frames(tmp_path):
    tokenizer = base_tokenizer()
    chat_vlm(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    clip = write_clip(tmp_path / "clip.mp4", 4)
    wrapper = TinyVLM(checkpoint=str(tmp_path), device="cpu", batch_size=2, kv_cache_mib=16)
    wrapper.task_dict = {"task": {"test": [{"video": str(clip)}]}}
    frames = read_video(clip, wrapper.model.config.video)
    prompt, pixels = wrapper.processor.encode(QUESTION, [], frames)
    assert len(pixels) == 4  # 4 s at the default 1 frame a second

    arguments = (QUESTION, {"max_new_tokens": 10, "temperature": 0, "until": []}, lambda doc: [doc["video"]],
                 0, "task", "test")
    answer = wrapper.generate_until([Instance("generate_until", arguments, idx=0,
                                              metadata={"task": "task", "doc_id": 0, "repeats": 1})])
    tokens = wrapper.model.generate(torch.tensor([prompt]), pixels, max_new_tokens=10, greedy=True,
                                    eos_token_id=wrapper.model.config.stop_ids)
    assert answer == [tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True).strip()] and answer[0]

    continuation = tokenizer.encode(" left to right", add_special_tokens=False)
    arguments = (QUESTION, " left to right", lambda doc: [doc["video"]], 0, "task", "test")
    [score] = wrapper.loglikelihood([Instance("loglikelihood", arguments, idx=0,
                                              metadata={"task": "task", "doc_id": 0, "repeats": 1})])
    model = wrapper.model.double()
    logits, _ = model(torch.tensor([prompt + continuation]), pixels.double())
    log_probs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    expected = -float(log_probs.gather(1, torch.tensor(continuation)[:, None]).sum())
    nll, _ = score.text
    assert float(nll) == pytest.approx(expected, rel=1e-4, abs=1e-4)  # float32 against float64: rounding only


@torch.no_grad()
def test_video_documents_are_held_encoded_a_few_at_a_time_with_answers_unchanged(tmp_path, monkeypatch):
    """generate_until encodes a document as the engine takes it: at most `max_pending` clips' pixels are
    alive at any time (counted by weak references), where all of the task's were before; loglikelihood
    holds one forward's `batch_size`. Answers are each document's own, alone; scores those of all at once."""
    import weakref

    tokenizer = base_tokenizer()
    chat_vlm(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    clips = [str(write_clip(tmp_path / f"clip{seconds}.mp4", seconds)) for seconds in (1, 2, 1)]
    wrapper = TinyVLM(checkpoint=str(tmp_path), device="cpu", batch_size=2, kv_cache_mib=16, max_pending=1)
    wrapper.task_dict = {"task": {"test": [{"video": clip} for clip in clips]}}
    questions = [f"{QUESTION} ({i})" for i in range(len(clips))]
    expected = []
    for clip, question in zip(clips, questions):
        prompt, pixels = wrapper.processor.encode(question, [], read_video(clip, wrapper.model.config.video))
        tokens = wrapper.model.generate(torch.tensor([prompt]), pixels, max_new_tokens=4, greedy=True,
                                        eos_token_id=wrapper.model.config.stop_ids)
        expected.append(tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True).strip())
    live, most = [0], [0]

    def encode(prompt, images, video):  # each clip's pixels counted while anything refers to them
        ids, pixels = type(wrapper.processor).encode(wrapper.processor, prompt, images, video)
        live[0] += 1
        most[0] = max(most[0], live[0])
        weakref.finalize(pixels, lambda: live.__setitem__(0, live[0] - 1))
        return ids, pixels

    monkeypatch.setattr(wrapper.processor, "encode", encode)
    generate = [Instance("generate_until", (question, {"max_new_tokens": 4, "temperature": 0, "until": []},
                                            lambda doc: [doc["video"]], i, "task", "test"), idx=0,
                         metadata={"task": "task", "doc_id": i, "repeats": 1})
                for i, question in enumerate(questions)]
    assert wrapper.generate_until(generate) == expected and most[0] == 1
    wrapper.max_pending, most[0] = 100, 0
    assert wrapper.generate_until(generate) == expected and most[0] == len(clips)  # unbounded: all at once

    scored = [Instance("loglikelihood", (question, " left", lambda doc: [doc["video"]], i, "task", "test"),
                       idx=0, metadata={"task": "task", "doc_id": i, "repeats": 1})
              for i, question in enumerate(questions)]
    most[0] = 0
    chunked = [score.text for score in wrapper.loglikelihood(scored)]
    assert most[0] == 2
    wrapper.batch_size = len(clips)  # one forward over every document: the scores before chunking
    whole = [score.text for score in wrapper.loglikelihood(scored)]
    assert [nll for nll, _ in whole] == pytest.approx([nll for nll, _ in chunked], abs=1e-4)
    assert [greedy for _, greedy in whole] == [greedy for _, greedy in chunked]
