"""Video clips in the engine and the server: a clip's greedy tokens equal `VisionLanguageModel.generate` on
the processor's ids and frames, a second question on the same clip finds its frames' KV blocks in the prefix
cache (and another clip with the same ids does not), a clip too long for the context is refused in one line,
and the server's `video_url` part (a data URL or a file under --allowed-local-media-path, streamed or not)
answers as generate does, with a 400 in OpenAI's shape for a bad clip."""

import base64
import json
from pathlib import Path

import httpx
import pytest
import torch
from PIL import ImageOps

pytest.importorskip("fastapi")

from data import Message  # noqa: E402
from data.video import Clip, read_video  # noqa: E402
from models.split_config import VideoConfig  # noqa: E402
from serving.async_engine import AsyncEngine  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.media import MediaPolicy  # noqa: E402
from serving.requests import Request, RequestError, RequestParams  # noqa: E402
from serving.server import create_app  # noqa: E402
from tests.data.test_video import write_clip  # noqa: E402
from tests.models.helpers import base_tokenizer, chat_vlm  # noqa: E402
from tests.serving.test_server import Server, _idle, _png  # noqa: E402

QUESTION, FOLLOW_UP = "which way does the square move?", "what colour is the sky?"
BLOCK = 8


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    (directory / "allowed").mkdir()
    return write_clip(directory / "allowed" / "clip.mp4", 4)  # 4 s at 10 fps: 4 frames at the default 1 fps


def _engine(model, tokenizer) -> Engine:
    return Engine(model, tokenizer, ServingConfig(num_blocks=400, block_size=BLOCK, max_num_seqs=16,
                                                  max_batch_tokens=256))


@pytest.fixture(scope="module")
def served(clip_path):
    """A tiny random chat VLM served on loopback, local media allowed beside the clip: (server, model, its
    engine, another engine on the model to drive directly)."""
    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    engine = _engine(model, tokenizer)
    async_engine = AsyncEngine(engine, max_in_flight=16)
    media = MediaPolicy(allowed_local_path=clip_path.parent, video=model.config.video)
    server = Server(create_app(async_engine, tokenizer, "tiny", default_max_tokens=12, media=media))
    yield server, model, engine, _engine(model, tokenizer)
    server.stop()
    async_engine.shutdown()


def _generate(engine: Engine, model, messages: list[Message], clip: Clip, max_tokens: int) -> list[int]:
    """generate() on the processor's ids and frames, cut after the first stop token: the reference."""
    ids, pixels = engine.processor.encode_chat(messages, [], clip)
    row = model.generate(torch.tensor([ids]), pixels, max_new_tokens=max_tokens, greedy=True,
                         eos_token_id=model.config.stop_ids)[0].tolist()
    stops = [i for i, token in enumerate(row) if token in model.config.stop_ids]
    return row[: stops[0] + 1] if stops else row


def test_the_engines_tokens_for_a_clip_equal_generate_and_a_second_question_reuses_its_frames(
        served, clip_path):
    _, model, _, engine = served
    clip = read_video(clip_path, model.config.video)
    params = RequestParams(greedy=True, max_tokens=10)
    first, second = [Message("user", QUESTION)], [Message("user", FOLLOW_UP)]
    answered = engine.generate([Request(first, params=params, video=clip)])[0]
    assert answered.token_ids[0] == _generate(engine, model, first, clip, 10)
    again = engine.generate([Request(second, params=params, video=clip)])[0]
    assert again.token_ids[0] == _generate(engine, model, second, clip, 10)
    ids = [engine.processor.encode_chat(messages, [], clip)[0] for messages in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)  # the clip's tokens, then the questions
    assert len(clip.frames) == 4 and shared > 4 * model.config.tokens_per_image
    assert again.cached_tokens == shared // BLOCK * BLOCK  # every full block of the clip's tokens
    # the same ids over other pixels (each frame mirrored) share only the blocks before the first frame
    mirrored = Clip([ImageOps.mirror(frame) for frame in clip.frames], clip.indices, clip.timestamps,
                    clip.duration)
    other = engine.generate([Request(second, params=params, video=mirrored)])[0]
    first_frame = ids[1].index(model.config.image_token_id)
    assert other.cached_tokens == first_frame // BLOCK * BLOCK
    assert other.token_ids[0] == _generate(engine, model, second, mirrored, 10)


def test_a_clip_too_long_for_the_context_is_refused_in_one_line_not_cut(served, clip_path):
    _, model, _, engine = served
    every_frame = read_video(clip_path, VideoConfig(fps=30, max_frames=64))  # all 40 frames
    with pytest.raises(RequestError, match="the clip's 40 frames are in the prompt: sample fewer") as error:
        engine.prepare(Request(QUESTION, params=RequestParams(max_tokens=200), video=every_frame))
    assert "\n" not in str(error.value) and f"context of {model.config.language.max_position_embeddings}" in \
        str(error.value)


def _ask(server, content: list[dict], stream: bool = False) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0,
            "stream": stream}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _video(url: str, question: str = QUESTION) -> list[dict]:
    return [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]


def _data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("source", ["data-url", "allowed-path"])
def test_a_video_url_streamed_and_not_answers_as_generate(served, clip_path, source):
    server, model, engine, _ = served
    url = _data_url(clip_path.read_bytes()) if source == "data-url" else str(clip_path)
    clip = read_video(clip_path, model.config.video)
    expected = engine.decode(_generate(engine, model, [Message("user", QUESTION)], clip, 10))
    reply = _ask(server, _video(url))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == expected and expected
    events = [json.loads(line.removeprefix("data: ")) for line in _ask(server, _video(url), stream=True)
              .text.splitlines() if line.startswith("data: {")]
    assert "".join(event["choices"][0]["delta"].get("content") or "" for event in events) == expected
    _idle(engine)


def _bad(clip_path: Path) -> dict[str, tuple[list[dict], str]]:
    data = clip_path.read_bytes()
    return {
        "truncated": (_video(_data_url(data[: len(data) // 3])), "video 0: not a readable video"),
        "not-a-video": (_video(_data_url(b"not a video at all\n" * 20)), "video 0: not a readable video"),
        "an-image": (_video(_data_url(_png())), "video 0: an image (png_pipe), not a video"),
        "outside-the-allow-list": (_video(str(clip_path.parent.parent / "secret.mp4")),
                                   "video 0: no such file under the allowed media directory"),
        "two-videos": (_video(str(clip_path)) + _video(str(clip_path)), "one video and no images beside it"),
        "beside-an-image": (_video(str(clip_path)) + [{"type": "image_url", "image_url": {"url": str(
            clip_path)}}], "one video and no images beside it"),
        "no-object": ([{"type": "video_url"}], "a video_url content part needs a video_url object"),
    }


@pytest.mark.parametrize("case", ["truncated", "not-a-video", "an-image", "outside-the-allow-list",
                                  "two-videos", "beside-an-image", "no-object"])
def test_a_bad_video_is_a_400_in_openais_shape_with_one_line(served, clip_path, case):
    server, _, engine, _ = served
    content, message = _bad(clip_path)[case]
    for stream in (False, True):
        response = _ask(server, content, stream)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and message in error["message"]
        assert "\n" not in error["message"] and str(clip_path.parent) not in error["message"]
    _idle(engine)


def test_a_video_after_the_first_user_message_is_a_400(served, clip_path):
    server, _, engine, _ = served
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": _video(str(clip_path))}]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "messages.2: a video goes in the first user message"


def test_a_clip_is_read_under_the_media_policys_byte_pixel_and_time_limits(clip_path):
    from serving.media import open_video

    url = _data_url(clip_path.read_bytes())
    with pytest.raises(RequestError, match="^video 0: frames of 64 x 48, more than 3000 pixels$"):
        open_video(url, 0, MediaPolicy(max_pixels=3000))
    with pytest.raises(RequestError, match="^video 0: larger than 1000 bytes$"):
        open_video(url, 0, MediaPolicy(max_video_bytes=1000))
    assert open_video(url, 0, MediaPolicy(max_bytes=1000)).frames  # a clip has its own limit, not an image's
    with pytest.raises(RequestError, match="^video 0: decoding its frames took too long"):
        open_video(url, 0, MediaPolicy(decode_timeout=0))
    assert len(open_video(url, 0, MediaPolicy(video=VideoConfig(fps=2, max_frames=3))).frames) == 3
