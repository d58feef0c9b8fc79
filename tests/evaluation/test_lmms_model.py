"""tinyvlm as an lmms-eval model: `python -m lmms_eval --model tinyvlm` over the local shapes tasks gives
tinyvlm's own evaluation of the same questions (generated answers), and the log-likelihoods of a float64
forward (choices)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from evaluation.shapes_task import write_shapes_task
from loading import load_for_inference
from tests.models.helpers import base_tokenizer, chat_vlm
from tests.training.helpers import small_config
from training.evaluate import answer, exact_match
from training.run import train

pytest.importorskip("lmms_eval", reason="lmms-eval is the [eval] extra (make install installs it)")
from lmms_eval.api.instance import Instance  # noqa: E402

from evaluation.lmms_model import TinyVLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NUM_QUESTIONS = 20


def test_a_document_with_two_images_is_answered_with_both_and_cut_at_until(tmp_path):
    tokenizer = base_tokenizer()
    chat_vlm(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    wrapper = TinyVLM(checkpoint=str(tmp_path), device="cpu", batch_size=4, kv_cache_mib=16)
    images = [Image.new("RGB", (40, 30), "skyblue"), Image.new("RGB", (30, 40), "red")]
    wrapper.task_dict = {"task": {"test": [{"images": images}, {"images": images[:1]}]}}

    def ask(doc_id: int, until: list[str]) -> Instance:
        arguments = ("What colour is the sky?", {"max_new_tokens": 12, "temperature": 0, "until": until},
                     lambda doc: doc["images"], doc_id, "task", "test")
        return Instance("generate_until", arguments, idx=0,
                        metadata={"task": "task", "doc_id": doc_id, "repeats": 1})

    expected = []
    for doc_images in (images, images[:1]):
        prompt, pixels = wrapper.processor.encode("What colour is the sky?", doc_images)
        tokens = wrapper.model.generate(torch.tensor([prompt]), pixels, max_new_tokens=12, greedy=True,
                                        eos_token_id=wrapper.model.config.stop_ids)
        expected.append(tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True).strip())
    assert expected[0] != expected[1]  # the second image changes the answer: both were seen
    assert wrapper.generate_until([ask(0, []), ask(1, [])]) == expected
    cut = expected[0][3:6]  # answers end before the first `until` string
    assert wrapper.generate_until([ask(0, [cut])]) == [expected[0].split(cut)[0]]


def test_model_args_are_the_engines_settings_by_name(tmp_path, capsys):
    """checkpoint=..., then any ServingConfig field (as lmms-eval parses `--model_args`: numbers and booleans
    typed, the rest text); batch_size is max_num_seqs unless that is given. Settings that do not fit end the
    process: one line, exit code 2."""
    tokenizer = base_tokenizer()
    chat_vlm(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    wrapper = TinyVLM(checkpoint=str(tmp_path), device="cpu", batch_size=4, kv_cache_mib=16,
                      attention="gather", num_blocks=50, max_batch_tokens="64", cuda_graphs=False,
                      admission_batch="none")
    settings = wrapper.engine.settings
    assert (settings.max_num_seqs, settings.kv_cache_mib, settings.attention, settings.num_blocks,
            settings.max_batch_tokens, settings.cuda_graphs, settings.admission_batch) == (
        4, 16, "gather", 50, 64, False, 1)
    assert TinyVLM(checkpoint=str(tmp_path), device="cpu", batch_size=4, max_num_seqs=2,
                   num_blocks=20).engine.settings.max_num_seqs == 2
    # an unknown setting is refused before the (missing) checkpoint is looked for
    for checkpoint, fields, message in [
        (tmp_path / "nope", {"kv_cache_gib": 1}, "error: unknown key kv_cache_gib; valid keys: attention, "),
        (tmp_path, {"cuda_graphs": True}, "error: CUDA graphs need the model on a CUDA device"),
    ]:
        with pytest.raises(SystemExit) as ended:
            TinyVLM(checkpoint=str(checkpoint), device="cpu", **fields)
        err = capsys.readouterr().err.strip().splitlines()
        assert ended.value.code == 2 and len(err) == 1 and err[0].startswith(message), err


def test_quantize_serves_the_quantized_models_answers_and_a_bad_one_exits_2(tmp_path, capsys):
    pytest.importorskip("torchao")
    from models.quantize import describe

    tokenizer = base_tokenizer()
    chat_vlm(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    wrapper = TinyVLM(checkpoint=str(tmp_path), device="cpu", batch_size=4, kv_cache_mib=16, quantize="int8")
    assert describe(wrapper.model) == {"language": "int8"}
    images = [Image.new("RGB", (40, 30), "skyblue")]
    wrapper.task_dict = {"task": {"test": [{"images": images}]}}
    arguments = ("What colour is the sky?", {"max_new_tokens": 12, "temperature": 0, "until": []},
                 lambda doc: doc["images"], 0, "task", "test")
    prompt, pixels = wrapper.processor.encode("What colour is the sky?", images)
    tokens = wrapper.model.generate(torch.tensor([prompt]), pixels, max_new_tokens=12, greedy=True,
                                    eos_token_id=wrapper.model.config.stop_ids)
    expected = tokenizer.decode(tokens[0].tolist(), skip_special_tokens=True).strip()
    request = Instance("generate_until", arguments, idx=0,
                       metadata={"task": "task", "doc_id": 0, "repeats": 1})
    assert wrapper.generate_until([request]) == [expected]
    with pytest.raises(SystemExit) as ended:
        TinyVLM(checkpoint=str(tmp_path), device="cpu", quantize="int3")
    assert ended.value.code == 2  # the last line: torchao's import may log a deprecation note before it
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("error: unknown quantization 'int3': choose "
                                                                 "one of int8, int4, int8-dynamic")


def test_a_checkpoint_that_cannot_load_exits_2_with_one_line(tmp_path):
    """Regression: lmms-eval logs any exception from a model's constructor with a traceback and exits 0, so
    `python -m lmms_eval --model tinyvlm` with a checkpoint that cannot load looked like a finished run."""
    (tmp_path / "runs").mkdir()
    command = [sys.executable, "-m", "lmms_eval", "--model", "tinyvlm", "--model_args",
               "checkpoint=runs/nope,device=cpu", "--include_path", str(REPO / "evaluation/tasks"),
               "--tasks", "tinyvlm_shapes"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == "error: runs/nope: no such file or directory (runs/ is empty)"
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A briefly trained model, the task's questions, and what `python -m lmms_eval` said of both tasks."""
    root = tmp_path_factory.mktemp("lmms")
    config = small_config(root / "run", **{"train.max_steps": "60", "train.save_every": "60",
                                           "train.eval_every": "60"})
    train(config)
    rows = write_shapes_task(root / "runs/lmms_eval/shapes", NUM_QUESTIONS, config.data.shapes)
    command = [sys.executable, "-m", "lmms_eval", "--model", "tinyvlm", "--model_args",
               f"checkpoint={root / 'run'},device=cpu", "--include_path", str(REPO / "evaluation/tasks"),
               "--tasks", "tinyvlm_shapes,tinyvlm_shapes_choice", "--batch_size", "8", "--output_path", "out",
               "--log_samples"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    results = list((root / "out").rglob("*_results.json"))  # lmms-eval exits 0 even when a task fails
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    scores = json.loads(results[0].read_text())["results"]
    samples = {}
    for path in (root / "out").rglob("*_samples_*.jsonl"):
        task = path.stem.split("_samples_")[1]
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()),
                               key=lambda s: s["doc_id"])
    return root / "run", rows, scores, samples


@pytest.mark.slow  # lmms-eval in a subprocess, after a short training run
def test_generated_answers_and_score_equal_tinyvlms_own_evaluation(evaluated):
    checkpoint, rows, scores, samples = evaluated
    model, processor = load_for_inference(checkpoint, torch.device("cpu"))
    records = [{"texts": [{"user": row["question"], "assistant": row["answer"]}],
                "images": [Image.open(row["image"]).convert("RGB")], "question_type": row["question_type"]}
               for row in rows]
    ours = answer(model, processor.tokenizer, processor, records, torch.device("cpu"), max_new_tokens=16)
    assert [s["filtered_resps"] for s in samples["tinyvlm_shapes"]] == ours
    assert scores["tinyvlm_shapes"]["exact_match,none"] == pytest.approx(
        exact_match(records, ours)["accuracy"]
    )
    assert 0 < scores["tinyvlm_shapes"]["exact_match,none"]  # a trained model: the comparison is not 0 == 0


@pytest.mark.slow
@torch.no_grad()
def test_choice_log_likelihoods_equal_a_float64_forward_of_each_choice_alone(evaluated):
    checkpoint, rows, scores, samples = evaluated
    model, processor = load_for_inference(checkpoint, torch.device("cpu"))
    model.double()
    hits = []
    for row, sample in zip(rows, samples["tinyvlm_shapes_choice"], strict=True):
        prompt, pixels = processor.encode(row["question"], [Image.open(row["image"]).convert("RGB")])
        expected = []
        for choice in row["choices"]:
            continuation = processor.tokenizer.encode(choice, add_special_tokens=False)
            logits, _ = model(torch.tensor([prompt + continuation]), pixels.double())
            log_probs = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
            expected.append(-float(log_probs.gather(1, torch.tensor(continuation)[:, None]).sum()))
        got = [float(nll) for nll, _ in sample["filtered_resps"]]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-4)
        hits.append(min(range(len(expected)), key=expected.__getitem__) == row["answer_index"])
    assert scores["tinyvlm_shapes_choice"]["acc,none"] == pytest.approx(sum(hits) / len(hits))
