"""train.py under torchrun on CPU (gloo): DDP equals one process with the whole batch, checkpoints cross world
sizes, FSDP2 trains, resumes from its shards and exports, and a dead rank ends the job instead of hanging
it."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data import ImageLoadError
from models import VisionLanguageModel
from tests.training.helpers import SMALL, small_config
from training.config import RunConfig, load_run_config
from training.run import train

pytestmark = pytest.mark.slow

STEPS = 20
COMMON = {"train.decay_steps": str(STEPS), "train.eval_every": str(STEPS), "train.num_threads": "1",
          "train.keep_checkpoints": "5"}  # torchrun gives each rank one thread: the reference gets one too


HOOKS = str(Path(__file__).with_name("rank_hooks.py"))  # train.py with test hooks for the ranks


def torchrun(nproc: int, *argv: str, timeout: int = 300, script: str = "train.py",
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def overrides(**settings: str) -> list[str]:
    return [arg for key, value in {**SMALL, **COMMON, **settings}.items() for arg in (f"--{key}", value)]


def history_and_weights(run_dir: Path, step: int):
    checkpoint = run_dir / f"step_{step:06d}"
    history = json.loads((checkpoint / "training_state.json").read_text())["history"]
    return torch.tensor([loss for _, loss in history]), load_file(checkpoint / "model.safetensors")


def assert_same_run(run_dir: Path, reference: Path, step: int = STEPS, reference_step: int = STEPS) -> None:
    """The run's losses up to `step` equal the reference's first ones; at equal steps, so do the weights."""
    (losses, weights), (expected_losses, expected_weights) = (history_and_weights(run_dir, step),
                                                              history_and_weights(reference, reference_step))
    # 5e-5 on losses of ~1-4: another summation order (and, with loss_weight=sample, dividing each row by its
    # answer length before the sum) rounds differently, and 20 Adam steps at lr 0.01 carry that forward.
    torch.testing.assert_close(losses, expected_losses[: len(losses)], atol=5e-5, rtol=0)
    if step != reference_step:
        return
    for name, tensor in expected_weights.items():
        if name.endswith("k_proj.bias"):
            # Softmax ignores a shift shared by every key, so this bias's true gradient is 0 and what it gets
            # is rounding noise, which Adam scales up to lr-sized steps: it wanders differently under any
            # other summation order.
            continue
        # 3e-4: Adam divides by sqrt(v), so weights with tiny gradients amplify the rounding differences of
        # another summation order; still 200x below the 20 x lr = 0.06 that 20 steps may move a weight.
        torch.testing.assert_close(weights[name], tensor, atol=3e-4, rtol=0,
                                   msg=lambda message, name=name: f"{name}: {message}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process, batch 8, 20 steps, a checkpoint every 10."""
    threads = torch.get_num_threads()
    run_dir = tmp_path_factory.mktemp("reference")
    try:
        train(small_config(run_dir, **COMMON, **{"train.batch_size": "8", "train.max_steps": str(STEPS),
                                                 "train.save_every": "10"}))
    finally:
        torch.set_num_threads(threads)
    return run_dir


# configs/tiny.yaml as it is (1.5M parameters, ViT pre-trained then frozen), with less data to generate, a
# shorter vision pre-training and evaluation
TINY = {"data.shapes.num_train": "640", "data.shapes.num_validation": "16", "train.eval_questions": "8",
        "train.eval_batches": "1", "train.warmup_steps": "2", "train.log_every": "1",
        "train.vision_pretrain_steps": "3",
        "train.vision_pretrain_batch_size": "8", **COMMON}


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory) -> Path:
    """The tiny config in one process, batch 16, 20 steps."""
    threads = torch.get_num_threads()
    run_dir = tmp_path_factory.mktemp("tiny_reference")
    try:
        train(load_run_config("configs/tiny.yaml",
                              {**TINY, "train.batch_size": "16", "train.max_steps": str(STEPS),
                               "train.save_every": str(STEPS), "train.output_dir": str(run_dir)}))
    finally:
        torch.set_num_threads(threads)
    return run_dir


# the second accumulates under no_sync
@pytest.mark.parametrize("batch_size, accumulation", [("8", "1"), ("4", "2")])
def test_two_ranks_of_batch_8_equal_one_of_batch_16(tiny_reference, tmp_path, batch_size, accumulation):
    settings = {**TINY, "train.batch_size": batch_size, "train.grad_accum_steps": accumulation,
                "train.max_steps": str(STEPS), "train.save_every": str(STEPS),
                "train.output_dir": str(tmp_path), "train.num_workers": "1"}
    torchrun(2, *[arg for key, value in settings.items() for arg in (f"--{key}", value)])
    assert_same_run(tmp_path, tiny_reference)
    metrics = json.loads((tmp_path / "metrics.json").read_text())  # rank 0 alone wrote the artifacts
    assert metrics["step"] == STEPS and not list(tmp_path.glob("*rank*"))


def test_checkpoints_resume_across_world_sizes(reference, tmp_path):
    # 2 ranks x 4 -> 1 rank x 8
    torchrun(2, *overrides(**{"train.batch_size": "4", "train.max_steps": "10", "train.save_every": "10",
                              "train.output_dir": str(tmp_path / "two")}))
    config = RunConfig.from_json(tmp_path / "two" / "step_000010" / "run_config.json")
    threads = torch.get_num_threads()
    try:
        train(config.replace({"train.batch_size": "8", "train.max_steps": str(STEPS)}),
              resume=tmp_path / "two" / "step_000010")
    finally:
        torch.set_num_threads(threads)
    assert_same_run(tmp_path / "two", reference)
    # 1 rank x 8 (the reference's step 10) -> 2 ranks x 4
    (tmp_path / "one").mkdir()
    os.symlink(reference / "step_000010", tmp_path / "one" / "step_000010")
    torchrun(2, "--resume", str(tmp_path / "one" / "step_000010"), "--train.batch_size", "4",
             "--train.output_dir", str(tmp_path / "one"))
    assert_same_run(tmp_path / "one", reference)


def test_fsdp2_trains_resumes_from_its_shards_and_exports(reference, tmp_path):
    fsdp = {"train.parallel": "fsdp", "train.batch_size": "4", "train.save_every": "2"}
    torchrun(2, *overrides(**fsdp, **{"train.max_steps": "4", "train.output_dir": str(tmp_path / "whole")}))
    assert (tmp_path / "whole" / "step_000002" / "sharded").is_dir()
    assert not (tmp_path / "whole" / "step_000002" / "model.safetensors").exists()
    # the same computation, sharded
    assert_same_run(tmp_path / "whole", reference, step=4, reference_step=STEPS)

    torchrun(2, *overrides(**fsdp, **{"train.max_steps": "2", "train.output_dir": str(tmp_path / "split")}))
    # Nothing sharded outlives the run into interpreter teardown (once, a rank died there: SIGABRT in gloo).
    resumed = torchrun(2, "--resume", str(tmp_path / "split"), "--train.max_steps", "4", script=HOOKS,
                       env={"TINYVLM_TEST_COUNT_LEFTOVERS": "1"})
    assert sorted(line for line in resumed.stdout.splitlines() if "destroys its process group" in line) == [
        f"rank {r} destroys its process group with 0 FSDP2 modules alive" for r in range(2)]
    assert_same_run(tmp_path / "split", tmp_path / "whole", step=4, reference_step=4)

    exported = subprocess.run([sys.executable, "-m", "training.export",
                               str(tmp_path / "whole" / "step_000002"), "--out", str(tmp_path / "exported")],
                              capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr
    # the final step is exported by train.py
    for directory in (tmp_path / "exported", tmp_path / "whole" / "step_000004"):
        model = VisionLanguageModel.from_pretrained(directory)
        # text only
        tokens = model.generate(torch.tensor([[10, 11, 12]]), None, max_new_tokens=4, greedy=True)
        assert tokens.shape == (1, 4)
    unsharded = subprocess.run(
        [sys.executable, "train.py", "--resume", str(tmp_path / "whole" / "step_000002")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert unsharded.returncode == 2 and unsharded.stderr.strip().splitlines()[-1].endswith(
        "an FSDP2 checkpoint of 2 ranks resumes with train.parallel=fsdp on 2 ranks "
        f"(or export its weights: python -m training.export {tmp_path / 'whole' / 'step_000002'})"
    ), unsharded.stderr


def test_ranks_stay_in_step_and_train_alike_when_a_batch_has_no_image(tmp_path):
    """Text-only records and records whose image is corrupt (skipped): a rank whose batch has no image still
    runs the vision tower (DDP needs every parameter), and both ranks end with the same trained weights. Over
    two epochs each bad record is read twice, by either rank, and counted once."""
    from data import ResumableBatchSampler, build_datasets, make_shapes_dataset

    lines = []
    for i, row in enumerate(make_shapes_dataset("train", 24, seed=0, image_size=32)):
        row["images"][0].save(tmp_path / f"{i}.png")
        if i in (3, 9, 15):
            (tmp_path / f"{i}.png").write_bytes(b"not an image")
        lines.append(json.dumps({"images": [f"{i}.png"] if i % 3 == 0 else [], "texts": row["texts"]}))
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    settings = {"data.source": "jsonl", "data.path": str(tmp_path / "data.jsonl"), "data.holdout": "4",
                "train.batch_size": "1", "train.max_steps": "20", "train.save_every": "20",
                "train.eval_every": "20", "train.output_dir": str(tmp_path / "run"),
                "train.dist_timeout": "60"}
    # the scenario: 20 records, 2 epochs of batches of 1 per rank; which of them have no (readable) image
    train_data, _ = build_datasets(small_config(tmp_path, **settings).data)
    imageless = [not (train_data.with_format(None)[i]["images"]) or _unreadable(train_data, i)
                 for i in range(len(train_data))]
    bad = [i for i in range(len(train_data)) if _unreadable(train_data, i)]
    ranks = [iter(ResumableBatchSampler(len(train_data), 1, seed=0, rank=r, world_size=2)) for r in range(2)]
    per_step = [[imageless[next(rank)[0]] for rank in ranks] for _ in range(20)]
    assert [True, True] in per_step and ([True, False] in per_step or [False, True] in per_step) and bad

    torchrun(2, *overrides(**settings), script=HOOKS, env={"TINYVLM_TEST_DUMP_WEIGHTS": "1"}, timeout=240)
    run = tmp_path / "run"
    before, after = (
        [load_file(run / f"rank{r}_{when}.safetensors") for r in range(2)] for when in ("before", "after")
    )
    assert all(torch.equal(before[0][name], before[1][name]) for name in before[0])
    assert [name for name in after[0] if not torch.equal(after[0][name], after[1][name])] == []
    for part in ("vision.", "projector.", "language."):
        assert any(not torch.equal(after[0][n], before[0][n]) for n in after[0] if n.startswith(part)), part
    assert json.loads((run / "metrics.json").read_text())["bad_records"] == len(bad)


def _unreadable(dataset, index: int) -> bool:
    try:
        dataset[index]
    except ImageLoadError:
        return True
    return False


def test_a_hung_rank_ends_the_job_within_dist_timeout(tmp_path):
    """Rank 1 stays alive but stops taking part after its first step: rank 0's next collective gives up after
    train.dist_timeout, train.py exits 3 with its one-line error, and torchrun ends the job."""
    timeout = 20
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", HOOKS,
               *overrides(**{"train.max_steps": "100000", "train.save_every": "100000",
                             "train.output_dir": str(tmp_path), "train.dist_timeout": str(timeout)})]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True, env={**os.environ, "TINYVLM_TEST_HANG_RANK": "1"})
    lines = []  # (time read, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in job.stdout))
    reader.start()
    try:
        job.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    reader.join()
    output = "".join(line for _, line in lines)
    assert job.returncode != 0, output[-3000:]
    hung = next((t for t, line in lines if line.startswith("rank 1 hangs")), None)
    lost = next((t for t, line in lines if line.startswith("error: lost contact with the other ranks (")),
                None)
    assert hung is not None and lost is not None, output[-3000:]
    assert lost - hung < timeout + 15, (lost - hung, output[-3000:])
    assert "exitcode  : 3" in output and "[rank0]: Traceback" not in output, output[-3000:]


def test_a_fresh_job_into_another_runs_directory_is_refused_on_every_rank(tmp_path):
    """Rank 0 decides (it writes the run directory) and every rank stops with the same one line, exit code 2,
    before reading any data: none waits for the others in a collective."""
    run_dir = tmp_path / "run"
    (run_dir / "step_000010").mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train.py", *overrides(**{"train.max_steps": "2", "train.output_dir": str(run_dir)})]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    error = (f"error: train.output_dir ({run_dir}) holds another run (step_000010): continue it with "
             f"--resume {run_dir}, give this run a new --train.output_dir, or write into it anyway with "
             "--train.overwrite true")
    assert done.returncode != 0 and output.count(error) == 2, output[-3000:]
    assert "exitcode  : 2" in output and "reading the data" not in output, output[-3000:]
    assert [path.name for path in run_dir.iterdir()] == ["step_000010"]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")), None)


def test_a_killed_rank_ends_the_job_with_an_error(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "train.py", *overrides(**{"train.max_steps": "100000", "train.save_every": "100000",
                             "train.output_dir": str(tmp_path), "train.dist_timeout": "30"})]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while "model:" not in job.stdout.readline() and time.monotonic() < deadline:
        assert job.poll() is None
    time.sleep(2)
    rank_1 = next(pid for pid in _children(job.pid) if _rank_of(pid) == 1)
    killed = time.monotonic()
    os.kill(rank_1, signal.SIGKILL)
    output, _ = job.communicate(timeout=120)
    assert job.returncode != 0 and time.monotonic() - killed < 120
    assert "exitcode  : -9" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]
