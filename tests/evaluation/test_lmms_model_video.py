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
