"""The chat page at / in a real browser (headless Chromium through Selenium): attach an image, type a
question, and the streamed answer equals generate.py's for the same image and question; the conversation is
kept, and New chat clears it. Skipped where no Chromium is installed (.ci/run installs Debian's chromium and
chromium-driver)."""

import shutil

import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")

import generate  # noqa: E402
from loading import load_for_inference  # noqa: E402
from serving.async_engine import AsyncEngine  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.server import create_app  # noqa: E402
from tests.models.helpers import base_tokenizer, chat_vlm  # noqa: E402
from tests.serving.test_server import Server  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="no Chromium and chromedriver on this machine "
                                "(apt-get install chromium chromium-driver; .ci/run installs them)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = base_tokenizer()
    directory = tmp_path_factory.mktemp("checkpoint")
    chat_vlm(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_the_page_answers_as_generate_does_and_keeps_the_conversation(checkpoint, browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    image = tmp_path / "sky.png"
    Image.new("RGB", (40, 30), "skyblue").save(image)
    question = "what colour is the sky?"
    assert generate.main(["--checkpoint", str(checkpoint), "--image", str(image), "--prompt", question,
                          "--max-new-tokens", "12"]) == 0
    expected = capsys.readouterr().out.strip()
    model, processor = load_for_inference(checkpoint, torch.device("cpu"))
    engine = AsyncEngine(Engine(model, processor, ServingConfig(num_blocks=200, block_size=8)))
    server = Server(create_app(engine, processor.tokenizer, "tiny"))
    try:
        browser.get(server.url)
        wait = WebDriverWait(browser, 60)
        wait.until(lambda driver: driver.find_element(By.ID, "model").text == "tiny")
        assert "connect-src 'self'" in browser.execute_script(
            "return fetch('/').then(r => r.headers.get('content-security-policy'))")
        browser.find_element(By.ID, "file").send_keys(str(image))
        wait.until(lambda driver: driver.find_elements(By.CSS_SELECTOR, "#attached img"))
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("12")

        def ask(text: str) -> str:
            browser.find_element(By.ID, "question").send_keys(text)
            browser.find_element(By.ID, "send").click()
            wait.until(lambda driver: driver.find_element(By.ID, "status").text in ("done", "error"))
            assert browser.find_element(By.ID, "status").text == "done"
            return browser.find_elements(By.CSS_SELECTOR, "#log .assistant")[-1].text

        assert ask(question).strip() == expected and expected
        assert browser.find_elements(By.CSS_SELECTOR, "#log .user img")  # the image shown in the user's turn
        ask("and the sea?")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#log .user, #log .assistant")) == 4
        assert engine.engine.blocks.hits > 0  # the second turn reused the first one's blocks
        browser.find_element(By.ID, "new-chat").click()
        assert not browser.find_elements(By.CSS_SELECTOR, "#log .user, #log .assistant")
    finally:
        server.stop()
        engine.shutdown()
