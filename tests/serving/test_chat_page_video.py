"""The chat page with a video: a clip attached in a real browser (headless Chromium through Selenium, as
test_chat_page.py) is sent as a `video_url` part, shown in the user's turn, and answered as `generate` answers
the clip's frames. Skipped where no Chromium is installed."""

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("selenium.webdriver")

from data.video import read_video  # noqa: E402
from loading import load_for_inference  # noqa: E402
from serving.async_engine import AsyncEngine  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.media import MediaPolicy  # noqa: E402
from serving.server import create_app  # noqa: E402
from tests.data.test_video import write_clip  # noqa: E402
from tests.serving.test_chat_page import browser, checkpoint, pytestmark  # noqa: E402, F401
from tests.serving.test_server import Server  # noqa: E402


def test_a_dropped_video_is_answered_as_generate_answers_it(checkpoint, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    clip = write_clip(tmp_path / "clip.mp4", 4)
    question = "which way does the square move?"
    model, processor = load_for_inference(checkpoint, torch.device("cpu"))
    ids, pixels = processor.encode(question, [], read_video(clip, model.config.video))
    tokens = model.generate(torch.tensor([ids]), pixels, max_new_tokens=12, greedy=True,
                            eos_token_id=model.config.stop_ids)
    expected = processor.tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True).strip()
    engine = AsyncEngine(Engine(model, processor, ServingConfig(num_blocks=200, block_size=8)))
    media = MediaPolicy(video=model.config.video)
    server = Server(create_app(engine, processor.tokenizer, "tiny", media=media))
    try:
        browser.get(server.url)
        wait = WebDriverWait(browser, 60)
        wait.until(lambda driver: driver.find_element(By.ID, "model").text == "tiny")
        browser.find_element(By.ID, "file").send_keys(str(clip))
        wait.until(lambda driver: driver.find_elements(By.CSS_SELECTOR, "#attached video"))
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("12")
        browser.find_element(By.ID, "question").send_keys(question)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda driver: driver.find_element(By.ID, "status").text in ("done", "error"))
        answer = browser.find_elements(By.CSS_SELECTOR, "#log .assistant")[-1].text
        assert browser.find_element(By.ID, "status").text == "done", answer
        assert answer.strip() == expected and expected
        assert browser.find_elements(By.CSS_SELECTOR, "#log .user video")  # the clip shown in the user's turn
    finally:
        server.stop()
        engine.shutdown()
