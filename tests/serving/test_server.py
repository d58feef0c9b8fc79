"""The OpenAI-compatible server on 127.0.0.1, driven by the real `openai` client and by raw HTTP: answers
equal `generate` on each request alone, streamed equals non-streamed, bad requests get 4xx, disconnects free
their blocks."""

import base64
import contextlib
import gc
import io
import json
import math
import re
import socket
import threading
import time

import httpx
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from data import ImageProcessor, Message, encode_prompt  # noqa: E402
from serving.async_engine import AsyncEngine  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.connections import server_config  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.protocol import RequestLimits  # noqa: E402
from serving.requests import Output  # noqa: E402
from serving.server import Completion, create_app, freeze_startup_heap  # noqa: E402
from tests.models.helpers import base_tokenizer, chat_vlm, tiny_vlm  # noqa: E402


def _png(color: str = "skyblue", size=(40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _message(text: str, *images: bytes | str) -> list[dict]:
    """A user message of `text` and images: encoded bytes (sent as data URLs) or URLs as they are."""
    parts = [{"type": "text", "text": text}]
    urls = [image if isinstance(image, str) else _data_url(image) for image in images]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


class Server:
    """uvicorn serving the app on a free loopback port, in a thread of the test process, set up as the
    server's main() sets it up."""

    def __init__(self, app, header_timeout: float = 10.0) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, header_timeout,
                                                   log_level="warning"))
        freeze_startup_heap()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        gc.unfreeze()


@contextlib.contextmanager
def serving(limits: RequestLimits = RequestLimits(), header_timeout: float = 10.0, overlap: bool = False):
    """A tiny random chat VLM served on loopback: (server, openai client, model, tokenizer, engine)."""
    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    engine = Engine(model, tokenizer, ServingConfig(num_blocks=400, block_size=8, max_num_seqs=16,
                                                    max_batch_tokens=256, overlap=overlap))
    async_engine = AsyncEngine(engine, max_in_flight=300)
    server = Server(create_app(async_engine, tokenizer, "tiny", default_max_tokens=12, limits=limits),
                    header_timeout)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)
    try:
        yield server, client, model, tokenizer, engine
    finally:
        server.stop()
        async_engine.shutdown()


@pytest.fixture(scope="module")
def served():
    with serving() as setup:
        yield setup


def _alone(model, tokenizer, text: str, images: list[bytes], max_tokens: int, **settings) -> list[str]:
    """What the model answers on its own (VisionLanguageModel.generate), decoded."""
    ids = torch.tensor([encode_prompt(tokenizer, text, len(images), model.config.tokens_per_image)])
    processor = ImageProcessor.from_config(model.config.vision)
    pixels = torch.stack([processor(Image.open(io.BytesIO(i))) for i in images]) if images else None
    rows = model.generate(ids, pixels, max_new_tokens=max_tokens, eos_token_id=model.config.stop_ids,
                          pad_token_id=tokenizer.pad_token_id, **settings).tolist()
    texts = []
    for row in rows:
        stops = [i for i, token in enumerate(row) if token in model.config.stop_ids]
        texts.append(tokenizer.decode(row[: stops[0]] if stops else row, skip_special_tokens=True))
    return texts


def _idle(engine: Engine, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.blocks.num_free != engine.blocks.num_usable:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)
    engine.blocks.check()


def test_answers_streamed_and_not_equal_generate(served):
    server, client, model, tokenizer, engine = served
    image = _png()
    expected = _alone(model, tokenizer, "what colour is the sky?", [image], 10, greedy=True)[0]
    reply = client.chat.completions.create(model="tiny", messages=_message("what colour is the sky?", image),
                                           max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected
    prompt = encode_prompt(tokenizer, "what colour is the sky?", 1, model.config.tokens_per_image)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny",
                                                 messages=_message("what colour is the sky?", image),
                                                 max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [reply.choices[0].finish_reason]
    _idle(engine)


def test_logprobs_equal_a_float64_log_softmax_of_the_models_logits(served):
    """`logprobs` / `top_logprobs` through the openai client, streamed and not: each token's entry equals a
    float64 log-softmax of the model's logits at that step (one uncached pass over the prompt and the answer's
    tokens)."""
    server, client, model, tokenizer, engine = served
    image, text = _png("pink"), "what colour is the sky?"
    reply = client.chat.completions.create(model="tiny", messages=_message(text, image), max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    prompt = encode_prompt(tokenizer, text, 1, model.config.tokens_per_image)
    pixels = ImageProcessor.from_config(model.config.vision)(Image.open(io.BytesIO(image)))[None]
    answer = model.generate(torch.tensor([prompt]), pixels, max_new_tokens=6, greedy=True)[0].tolist()
    answer = answer[: len(content)]
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + answer]), pixels)
    reference = logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    assert len(content) == reply.usage.completion_tokens
    for step, (token, entry) in enumerate(zip(answer, content)):
        assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(reference[step, token].item(), abs=1e-4)
        top = reference[step].topk(3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    chunks = client.chat.completions.create(model="tiny", messages=_message(text, image), max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model="tiny", messages=_message(text, image), max_tokens=6,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    _idle(engine)


def test_a_conversation_equals_generate_on_its_rendered_prompt_and_reuses_its_earlier_turns(served):
    """Three turns through the openai client (a system prompt, images in the first two user turns): each
    answer is generate's on the conversation as the processor renders it (greedy), streamed = not, and from
    the second turn on the earlier turns' blocks come from the prefix cache
    (usage.prompt_tokens_details.cached_tokens, engine stats)."""
    server, client, model, tokenizer, engine = served
    images = [_png("navy"), _png("gold", (24, 36))]
    history = [{"role": "system", "content": "You answer in a few words."}]
    turns = [("what colour is this?", [images[0]]), ("and this one?", [images[1]]),
             ("which is brighter?", [])]
    previous = []  # the answers so far
    for turn, (text, turn_images) in enumerate(turns):
        history.append(_message(text, *turn_images)[0])
        hits = engine.blocks.hits
        reply = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
        answer = reply.choices[0].message.content
        rendered = [Message("system", "You answer in a few words.")]
        rendered += [
            m
            for t, (q, i) in enumerate(turns[: turn + 1])
            for m in (
                [Message("user", q, len(i))] + ([Message("assistant", previous[t])] if t < turn else [])
            )
        ]
        shown = [image for _, i in turns[: turn + 1] for image in i]
        ids, pixels = engine.processor.encode_chat(rendered, [Image.open(io.BytesIO(i)) for i in shown])
        row = model.generate(torch.tensor([ids]), pixels, max_new_tokens=8, greedy=True)[0].tolist()
        stops = [i for i, token in enumerate(row) if token in model.config.stop_ids]
        assert answer == tokenizer.decode(row[: stops[0]] if stops else row, skip_special_tokens=True), turn
        assert reply.usage.prompt_tokens == len(ids)
        chunks = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        if turn:
            assert reply.usage.prompt_tokens_details.cached_tokens > 0 and engine.blocks.hits > hits
        previous.append(answer)
        history.append({"role": "assistant", "content": answer})
    _idle(engine)


def test_text_completions_continue_a_plain_prompt(served):
    """/v1/completions (what load testers and evaluation harnesses send): the prompt's own token ids, no chat
    template; the text equals generate's continuation, streamed = not, with usage; a prompt of token ids
    too."""
    server, client, model, tokenizer, engine = served
    prompt = "the sky is blue and the sea is"
    ids = tokenizer(prompt)["input_ids"]
    row = model.generate(torch.tensor([ids]), max_new_tokens=10, greedy=True,
                         eos_token_id=model.config.stop_ids)
    row = row[0].tolist()
    stops = [i for i, token in enumerate(row) if token in model.config.stop_ids]
    expected = tokenizer.decode(row[: stops[0]] if stops else row, skip_special_tokens=True)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text == expected
    assert reply.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert (
        client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0).choices[0].text
        == expected
    )
    default = client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the API's default max_tokens
    for body, message in [
        ({"prompt": prompt, "echo": True}, "echo"),
        ({"prompt": [prompt, prompt]}, "one prompt"),
        ({"prompt": [10**9]}, "token ids must lie"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"prompt": ["x" * 300_000]}, "characters"),
    ]:
        response = httpx.post(f"{server.url}/v1/completions", json=body)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    _idle(engine)


def test_structured_answers_through_the_openai_client(served):
    """response_format json_schema (parsed by the client into the schema's model), json_object, and
    guided_choice."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    server, client, model, tokenizer, engine = served
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["colour", "count"], "additionalProperties": False}
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=_message("describe it", _png()), temperature=1.0, seed=seed, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "scene", "schema": schema}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    anything = client.chat.completions.create(model="tiny", messages=_message("hi"), temperature=1.0, seed=1,
                                              max_tokens=200, response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside the object
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    chosen = client.chat.completions.create(model="tiny", messages=_message("well?"), temperature=1.0,
                                            max_tokens=10, n=4, seed=2, logprobs=True, top_logprobs=5,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert {c.message.content for c in chosen.choices} <= {"yes", "no"}
    # log-probabilities are the model's, before the mask: finite, even where the mask left one token
    # (regression)
    assert all(
        math.isfinite(t.logprob) for c in chosen.choices for e in c.logprobs.content for t in e.top_logprobs
    )
    bad = httpx.post(f"{server.url}/v1/chat/completions",
                     json={"messages": _message("hi"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}})
    assert bad.status_code == 400 and "cannot be compiled" in bad.json()["error"]["message"], bad.text
    _idle(engine)


@pytest.mark.parametrize("schema, message", [
    # only itself: it was served as "" with finish_reason "stop"; xgrammar >= 0.2.9 refuses a bare
    # self-reference when compiling, older ones compile it and our check finds no first token
    ({"$ref": "#"}, "the json schema "),
    ({"anyOf": [{"$ref": "#"}]}, "admits no answer"),  # compiles in every xgrammar; no first token
    ({"type": "no-such-type"}, 'cannot be compiled (Unsupported type "no-such-type")'),
    ({"type": "string", "enum": []}, "cannot be compiled (enum array must not be empty)"),
])
def test_a_schema_without_answers_is_refused_in_one_line_without_paths(served, schema, message):
    pytest.importorskip("xgrammar")
    server, *_ = served
    response = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": _message("hi"), "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}}})
    text = response.json()["error"]["message"]
    assert response.status_code == 400 and message in text, text
    assert "/" not in text.replace('"#"', "") and ".cc" not in text and "\n" not in text, text


def test_n_samples_with_a_seed_equal_generate_num_samples(served):
    server, client, model, tokenizer, engine = served
    image = _png("orange")
    reply = client.chat.completions.create(model="tiny", messages=_message("the sky", image), n=3, seed=4,
                                           temperature=1.4, max_tokens=8)
    expected = _alone(model, tokenizer, "the sky", [image], 8, temperature=1.4, num_samples=3,
                      generator=torch.Generator().manual_seed(4))
    assert [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    _idle(engine)


def test_a_stop_string_ends_the_answer_before_it(served):
    server, client, model, tokenizer, engine = served
    check_a_stop_string_ends_the_answer(client, model, tokenizer)
    _idle(engine)


def check_a_stop_string_ends_the_answer(client, model, tokenizer) -> None:
    """A stop string taken from the answer's middle: the reply is the answer up to it, finish reason
    "stop"."""
    full = _alone(model, tokenizer, "blue", [], 12, greedy=True)[0]
    assert len(full) > 4
    stop = full[3:5]
    reply = client.chat.completions.create(model="tiny", messages=_message("blue"), max_tokens=12,
                                           temperature=0, stop=[stop])
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def _metrics(server) -> dict[str, float]:
    """/metrics parsed by prometheus-client's own text parser: {name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    return {sample.name + str(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def test_a_model_is_retrieved_by_its_id(served):
    """GET /v1/models/{id}, as the openai client's models.retrieve asks: OpenAI's model object, or a 404 in
    OpenAI's error shape."""
    server, client, *_ = served
    assert client.models.retrieve("tiny").model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    missing = httpx.get(f"{server.url}/v1/models/some/org/model")
    assert missing.status_code == 404 and missing.json() == {"error": {
        "message": "the model `some/org/model` does not exist (this server serves `tiny`)",
        "type": "not_found_error", "param": "model", "code": "model_not_found"}}


def test_the_help_examples_ask_for_the_model_the_server_serves():
    """The module's help (`serving.server --help`) starts a checkpoint and asks for a model by name: the
    name that server serves (it asked for `tinyvlm`, a 404)."""
    import serving.server

    checkpoint = re.search(r"--checkpoint (\S+)", serving.server.__doc__).group(1)
    asked = set(re.findall(r'model="([^"]+)"', serving.server.__doc__))
    args = serving.server._parser().parse_args(["--checkpoint", checkpoint])
    assert asked == {serving.server.served_name(args)}


def test_models_health_and_prometheus_metrics_that_move_with_the_requests(served):
    server, client, model, tokenizer, engine = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "serving": engine.settings.to_dict()}
    model_label = "[('model_name', 'tiny')]"
    before = _metrics(server)
    assert before["tinyvlm:num_requests_running" + model_label] == 0
    assert before["tinyvlm:kv_cache_blocks_total" + model_label] == engine.blocks.num_usable
    replies = [client.chat.completions.create(model="tiny", messages=_message("the sky", _png()),
                                              max_tokens=5, temperature=0) for _ in range(2)]
    _idle(engine)
    after = _metrics(server)

    def moved(name: str, labels: str = model_label) -> float:
        return after[name + labels] - before.get(name + labels, 0)

    assert moved("tinyvlm:generation_tokens_total") == sum(r.usage.completion_tokens for r in replies)
    assert moved("tinyvlm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in replies)
    assert moved("tinyvlm:time_to_first_token_seconds_count") == 2
    assert moved("tinyvlm:e2e_request_latency_seconds_count") == 2
    assert moved("tinyvlm:inter_token_latency_seconds_count") == sum(
        r.usage.completion_tokens - 1 for r in replies
    )
    reasons = {r.choices[0].finish_reason for r in replies}
    assert sum(moved("tinyvlm:request_success_total",
                     f"[('finished_reason', '{reason}'), ('model_name', 'tiny')]")
               for reason in reasons) == 2
    assert moved("tinyvlm:prefix_cache_hits_total") > 0  # the second request reused the first one's blocks


def _bomb() -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buffer, format="PNG")  # 400M pixels in a few kB
    return buffer.getvalue()


BAD = [
    ("malformed JSON", b'{"messages": [', "not valid JSON"),
    ("wrong type", {"messages": _message("hi"), "max_tokens": "ten"}, "max_tokens"),
    ("n out of range", {"messages": _message("hi"), "n": 17}, "n"),
    ("n zero", {"messages": _message("hi"), "n": 0}, "n"),
    ("max_tokens zero", {"messages": _message("hi"), "max_tokens": 0}, "max_tokens"),
    ("past the context", {"messages": _message("hi"), "max_tokens": 600}, "exceeds the context"),
    ("prompt too long", {"messages": _message("sky " * 600)}, "exceeds the context"),
    ("image URL on a loopback address", {"messages": _message("hi", "http://127.0.0.1:9/a.png")},
     "loopback, private or link-local"),
    ("local image path", {"messages": _message("hi", "/etc/hostname")}, "--allowed-local-media-path"),
    ("undecodable image", {"messages": _message("hi", b"not an image at all")}, "not an image"),
    ("too many images", {"messages": _message("hi", *[_png()] * 5)}, "at most 4"),
    ("no messages", {"messages": []}, "messages"),
    (
        "assistant turn last",
        {"messages": [{"role": "assistant", "content": "hi"}]},
        "last message must be the user",
    ),
    (
        "image in an assistant turn",
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "image_url", "image_url": {"url": _data_url(_png())}}],
                },
                *_message("hi"),
            ]
        },
        "only user messages",
    ),
    ("tool message", {"messages": [{"role": "tool", "content": "42"}, *_message("hi")]}, "tool messages"),
    *[(f"{kind} content part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                          {"type": kind, kind: {}}]}]},
       f"messages.0.content.1: content part type '{kind}' is not supported; this server takes 'text', "
       "'image_url', 'video_url' parts") for kind in ("input_audio", "file")],
    ("content part without a type", {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
     "messages.0.content.0.type: Field required"),
]


@pytest.mark.parametrize("body, fragment", [(body, fragment) for _, body, fragment in BAD],
                         ids=[name for name, *_ in BAD])
def test_bad_requests_get_a_4xx_json_error(served, body, fragment):
    server, *_ = served
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    assert fragment in response.json()["error"]["message"], response.json()


def test_a_decompression_bomb_is_refused(served):
    server, *_ = served
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": _message("hi", _bomb())},
                          timeout=60)
    assert response.status_code == 400 and "decompression bomb" in response.json()["error"]["message"]


def test_a_full_server_answers_429():
    from fastapi.testclient import TestClient

    tokenizer = base_tokenizer()
    engine = AsyncEngine(Engine(chat_vlm(tokenizer), tokenizer, ServingConfig(num_blocks=64, block_size=8)),
                         max_in_flight=0)
    try:
        response = TestClient(create_app(engine, tokenizer, "tiny")).post(
            "/v1/chat/completions", json={"messages": _message("hi")})
        assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
    finally:
        engine.shutdown()


def test_a_client_that_disconnects_frees_its_blocks(served):
    server, client, model, tokenizer, engine = served
    body = {"messages": _message("what colour is the sky?", _png()), "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # the first event: the request runs
    _idle(engine)


def test_completion_text_holds_back_cut_characters_and_stop_string_starts():
    tokenizer = base_tokenizer()
    decoded = []
    decode = tokenizer.decode
    tokenizer.decode = lambda ids, **kwargs: decoded.append(len(ids)) or decode(ids, **kwargs)
    filler = "the sky is blue " * 40
    ids = tokenizer.encode(filler + "é😀 ENDing", add_special_tokens=False)
    completion = Completion(tokenizer, 1, ["NOT HERE", "END"])
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        deltas += completion.update(Output("r", [[token]], last, ["length" if last else None]))
        if completion.done:
            break
    assert "".join(deltas) == filler + "é😀 " and completion.finish_reasons == ["stop"]
    # nothing of the stop string went out
    assert not any("\ufffd" in delta or "E" in delta for delta in deltas)
    assert sum(decoded) < 6 * len(ids)  # each step decodes a few recent tokens, not all of them


def test_engine_settings_that_cannot_run_together_stop_the_server_with_one_line(monkeypatch, capsys):
    """The sparse path with a compiled decode is a one-line error and exit code 2 before anything listens,
    not a traceback."""
    import serving.server

    monkeypatch.setattr(serving.server, "load_for_inference", lambda *args, **options: (tiny_vlm(), None))
    assert serving.server.main(["--device", "cpu", "--attention", "sparse", "--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: sparse paged attention needs"), err
    # a value that does not fit its field: one line, before the model loads
    assert serving.server.main(["--device", "cpu", "--max-num-seqs", "many"]) == 2
    assert capsys.readouterr().err.strip() == "error: max_num_seqs: expected int, got 'many'"


def test_the_server_prints_its_resolved_engine_settings_and_health_reports_them(monkeypatch, capsys):
    """The engine's options map onto ServingConfig (today's flags and the new ones); what the engine resolved
    at start-up is one line on stderr and the `serving` entry of /health."""
    import uvicorn
    from fastapi.testclient import TestClient

    import serving.server
    from data.chat_processors import ChatProcessor
    from models import kv_cache_bytes

    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    monkeypatch.setattr(serving.server, "load_for_inference",
                        lambda *args, **options: (model, ChatProcessor.from_config(model.config, tokenizer)))
    health = []
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda self: health.append(TestClient(self.config.app).get("/health").json()))
    assert serving.server.main(["--device", "cpu", "--attention", "gather", "--enforce-eager",
                                "--max-num-seqs", "8", "--kv-cache-mib", "1", "--block-size", "8",
                                "--max-batch-tokens", "64", "--pack-weights", "false",
                                "--overlap", "true"]) == 0
    block = kv_cache_bytes(model.config.language, batch=1, tokens=8, dtype=torch.float32)
    settings = ServingConfig(attention="gather", cuda_graphs=False, compile_prefill=False, pack_weights=False,
                             overlap=True, block_size=8, kv_cache_mib=1, max_num_seqs=8, max_batch_tokens=64,
                             # the blocks 1 MiB holds, + the null block
                             admission_batch=1, num_blocks=2**20 // block + 1)
    assert health == [{"status": "ok", "serving": settings.to_dict()}]
    assert f"engine: {settings.summary()}" in capsys.readouterr().err.splitlines()
