"""Training: the loss falls, one step follows the gradient of the (token- or sample-weighted) mean answer
loss, a resumed run equals an uninterrupted one, and the batch sampler (resumable, rank-split,
length-grouped)."""

import copy
import itertools
import json
import multiprocessing
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from data import ResumableBatchSampler
from tests.models.helpers import tiny_vlm
from tests.training.helpers import PRETRAINED_VIT, small_config
from training import run
from training.config import RunConfig, TrainConfig
from training.loop import Trainer, train_step
from training.run import train
from training.vision_pretraining import Pretraining
from typed_config import ConfigError


def _history(run_dir):
    last = sorted(run_dir.glob("step_*"))[-1]
    return json.loads((last / "training_state.json").read_text())["history"], load_file(
        last / "model.safetensors"
    )


def test_loss_falls_and_the_run_leaves_its_artifacts(tmp_path):
    metrics = train(small_config(tmp_path, **{"train.max_steps": "40", "train.eval_every": "40",
                                              "train.save_every": "40"}))
    history, _ = _history(tmp_path)
    losses = [loss for _, loss in history]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    for name in ("metrics.json", "loss_curve.png", "predictions.png", "heldout_example.png",
                 "step_000040/config.json", "step_000040/model.safetensors", "step_000040/tokenizer.json",
                 "step_000040/run_config.json"):
        assert (tmp_path / name).is_file(), name
    assert (
        json.loads((tmp_path / "metrics.json").read_text())["validation_loss"] == metrics["validation_loss"]
    )


def test_a_fresh_run_pretrains_its_vit_and_lr_vision_0_keeps_it(tmp_path, monkeypatch):
    """The ViT leaves pre-training changed in every tensor, and with lr_vision 0 training ends with it bit for
    bit."""
    snapshots, build, run_pretraining = {}, run.pretraining_on_scenes, Pretraining.run

    def build_and_snapshot(vision, *args, **kwargs):
        snapshots["vision"], snapshots["initial"] = vision, copy.deepcopy(vision.state_dict())
        return build(vision, *args, **kwargs)

    def run_and_snapshot(self, *args, **kwargs):
        finished = run_pretraining(self, *args, **kwargs)
        snapshots["pretrained"] = copy.deepcopy(snapshots["vision"].state_dict())
        return finished

    monkeypatch.setattr(run, "pretraining_on_scenes", build_and_snapshot)
    monkeypatch.setattr(Pretraining, "run", run_and_snapshot)
    train(small_config(tmp_path, **{**PRETRAINED_VIT, "train.max_steps": "3", "train.save_every": "3",
                                    "train.eval_every": "3"}))
    assert "pretrained" in snapshots, "the ViT was not pre-trained"
    _, weights = _history(tmp_path)
    trained = {
        name.removeprefix("vision."): tensor for name, tensor in weights.items() if name.startswith("vision.")
    }
    initial, pretrained = snapshots["initial"], snapshots["pretrained"]
    assert trained.keys() == pretrained.keys()
    assert [name for name in trained if not torch.equal(trained[name], pretrained[name])] == []
    assert [name for name in initial if torch.equal(initial[name], pretrained[name])] == []


# Step 6 falls inside a window of 16 batches; a resumed run must not pre-train its ViT again.
@pytest.mark.parametrize("settings", [{"train.group_by_length": "false"}, {"train.group_by_length": "true"},
                                      PRETRAINED_VIT, {"train.num_workers": "2"}],
                         ids=["plain", "grouped", "pretrained-vit", "workers"])
def test_resume_equals_an_uninterrupted_run(tmp_path, settings):
    steps = {"train.decay_steps": "12", "train.save_every": "6", "train.eval_every": "6", **settings}
    train(small_config(tmp_path / "whole", **steps, **{"train.max_steps": "12"}))
    train(small_config(tmp_path / "split", **steps, **{"train.max_steps": "6"}))
    config = RunConfig.from_json(tmp_path / "split" / "step_000006" / "run_config.json")
    config = config.replace({"train.max_steps": "12"})
    train(config, resume=tmp_path / "split" / "step_000006")
    whole, whole_weights = _history(tmp_path / "whole")
    split, split_weights = _history(tmp_path / "split")
    assert [s for s, _ in split] == list(range(1, 13))
    torch.testing.assert_close(torch.tensor([loss for _, loss in split]),
                               torch.tensor([loss for _, loss in whole]), atol=1e-6, rtol=0)
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, atol=1e-6, rtol=0)


def test_batches_are_a_function_of_their_position():
    stream = iter(ResumableBatchSampler(20, 4, seed=3))
    batches = [next(stream) for _ in range(12)]  # 48 samples: epochs of 20, each a fresh permutation
    flat = [i for batch in batches for i in batch]
    assert sorted(flat[:20]) == sorted(flat[20:40]) == list(range(20)) and flat[:20] != flat[20:40]
    resumed = iter(ResumableBatchSampler(20, 4, seed=3, start=28))  # from any sample count
    assert [next(resumed) for _ in range(5)] == batches[7:12]


def test_ranks_split_each_global_batch():
    """Rank r of N takes the r-th slice of the batch one rank with N times the batch size would see."""
    single = iter(ResumableBatchSampler(20, 6, seed=1, start=2))
    ranks = [iter(ResumableBatchSampler(20, 2, seed=1, start=2, rank=r, world_size=3)) for r in range(3)]
    for _ in range(10):
        assert next(single) == [i for rank in ranks for i in next(rank)]


def test_length_grouping_keeps_the_samples_and_cuts_the_padding():
    lengths = [(i * 37) % 50 for i in range(200)]
    plain = ResumableBatchSampler(200, 8, seed=2)
    grouped = ResumableBatchSampler(200, 8, seed=2, lengths=lengths, group=5, bucket=10)
    # one epoch
    plain_batches, grouped_batches = (list(itertools.islice(iter(s), 25)) for s in (plain, grouped))
    assert sorted(i for b in grouped_batches for i in b) == list(range(200))
    for start in range(0, 25, 5):  # each window of 5 batches holds the plain stream's samples of that window
        window = grouped_batches[start : start + 5]
        assert sorted(i for b in window for i in b) == sorted(
            i for b in plain_batches[start : start + 5] for i in b
        )
        spans = sorted((min(lengths[i] // 10 for i in b), max(lengths[i] // 10 for i in b)) for b in window)
        # sorted by bucket, cut in runs
        assert all(high <= next_low for (_, high), (next_low, _) in zip(spans, spans[1:]))
    padded = [
        sum(len(b) * max(lengths[i] for i in b) for b in batches)
        for batches in (grouped_batches, plain_batches)
    ]
    assert padded[0] < 0.8 * padded[1]
    # windows' batches are shuffled
    assert grouped_batches != sorted(grouped_batches, key=lambda b: lengths[b[0]])


def test_length_grouped_batches_resume_and_split_across_ranks():
    lengths = [(i * 13) % 17 for i in range(60)]

    def sampler(**kwargs) -> ResumableBatchSampler:
        return ResumableBatchSampler(60, seed=4, lengths=lengths, group=4, bucket=3, **kwargs)

    whole = list(itertools.islice(iter(sampler(batch_size=6)), 30))
    resumed = sampler(batch_size=6, start=7 * 6)  # mid-window, at step 7
    assert list(itertools.islice(iter(resumed), 23)) == whole[7:]
    ranks = [iter(sampler(batch_size=2, rank=r, world_size=3)) for r in range(3)]
    for batch in whole:
        assert batch == [i for rank in ranks for i in next(rank)]


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("loss_weight", ["token", "sample"])
def test_a_step_descends_the_mean_answer_loss(loss_weight, packed):
    """train_step against a float64 reference: the gradient of the mean over every answer token of the batch,
    or of the mean over samples of each sample's mean answer-token loss; the same when the samples are packed
    into rows."""
    model = tiny_vlm()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (3, 16), generator=generator)
    ids[:, :4] = model.config.image_token_id  # one image per row
    images = torch.randn(3, 3, 32, 32, generator=generator)
    targets = torch.full_like(ids, -100)
    # 8, 1 and 2 answer tokens
    targets[0, 5:13], targets[1, 9], targets[2, 11:13] = ids[0, 6:14], ids[1, 10], ids[2, 12:14]
    batch = {"input_ids": ids, "images": images, "attention_mask": torch.ones_like(ids), "targets": targets}
    # two rows: [sample 0, padding] and [sample 1, sample 2]; the mask numbers a row's samples 1, 2
    if packed:
        batch = {"input_ids": torch.stack([torch.cat([ids[0], torch.zeros_like(ids[0])]), ids[1:].flatten()]),
                 "attention_mask": torch.tensor([[1] * 16 + [0] * 16, [1] * 16 + [2] * 16]),
                 "targets": torch.stack([torch.cat([targets[0], torch.full_like(targets[0], -100)]),
                                         targets[1:].flatten()]),
                 "images": images}

    reference = copy.deepcopy(model).double()
    logits, _ = reference(ids, images.double())
    if loss_weight == "token":
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    else:
        expected = torch.stack([F.cross_entropy(row_logits, row_targets)
                                for row_logits, row_targets in zip(logits, targets)]).mean()
    expected.backward()

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = copy.deepcopy(model)
    config = RunConfig(train=TrainConfig(grad_clip=0, loss_weight=loss_weight))
    loss, tokens, finite = train_step(
        Trainer(config, model, model, optimizer, scheduler, torch.device("cpu")), [batch]
    )
    assert finite and tokens == ids.numel()  # real tokens only
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for (name, after), old, ref in zip(model.named_parameters(), before.parameters(), reference.parameters()):
        torch.testing.assert_close(old - after, ref.grad.float(), rtol=1e-3, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_run_ends_its_data_workers_when_it_returns(tmp_path):
    """Left to the garbage collector, a run's DataLoader workers outlived it, and collecting them later (in
    the next run of the same process, say) stalled ~5 s a worker."""
    before = set(multiprocessing.active_children())
    train(small_config(tmp_path, **{"train.max_steps": "2", "train.save_every": "2", "train.eval_every": "2",
                                    "train.num_workers": "2"}))
    assert set(multiprocessing.active_children()) - before == set()


def test_progress_to_a_file_is_plain_lines(tmp_path, capsys):
    """Output that is not a terminal (a log file) gets a line every log_every steps, never a progress bar's
    '\\r'."""
    train(small_config(tmp_path, **{"train.max_steps": "5", "train.log_every": "2", "train.save_every": "5",
                                    "train.eval_every": "5"}))
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    history, _ = _history(tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("step ") and "tokens/s" in line]
    assert [line.split(":")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    for line, (_, loss) in zip(lines, [history[1], history[3], history[4]]):
        assert f"loss {loss:.4f}, " in line


def test_activation_checkpointing_trains_the_same_run(tmp_path, capsys, monkeypatch):
    """train.activation_checkpointing: the blocks are recomputed (counted), for the same losses as without
    (float32, the same batches); the log reports peak memory."""
    import models.language_model
    import models.vision_transformer

    recomputed = []
    for module in (models.language_model, models.vision_transformer):
        original = module.checkpoint
        monkeypatch.setattr(module, "checkpoint", lambda *args, original=original, **kwargs: (
            recomputed.append(1), original(*args, **kwargs))[1])
    settings = {"train.max_steps": "3", "train.eval_every": "3", "train.save_every": "3",
                "train.lr_vision": "0.01"}
    plain = train(small_config(tmp_path / "plain", **settings))
    assert not recomputed
    checkpointed = train(small_config(tmp_path / "checkpointed",
                                      **{**settings, "train.activation_checkpointing": "true"}))
    assert len(recomputed) >= 3 * 3  # every block of the LM (2) and the ViT (1), each of the 3 steps
    _assert_same_run(tmp_path / "checkpointed", tmp_path / "plain")
    assert plain["peak_memory_mib"] > 0 and checkpointed["peak_memory_mib"] > 0
    assert "peak memory" in capsys.readouterr().out


def _assert_same_run(run_dir, reference_dir) -> None:
    """The run's logged losses equal the reference run's. The first step's loss (the same weights and batch)
    differs only by float32 sums taken in another order: 1e-6. After it, AdamW's first step is about
    lr * sign(gradient), so a gradient that is 0 but for rounding (a key bias's: the softmax ignores it) moves
    its weight by up to the learning rate either way, depending on which CPU kernels rounded it; the later
    losses are compared at 1e-3, and the weights not at all. Equal losses and gradients in float64 are the
    model's tests (tests/models/test_vision_language_model.py)."""
    (history, _), (reference_history, _) = _history(run_dir), _history(reference_dir)
    losses, reference_losses = [loss for _, loss in history], [loss for _, loss in reference_history]
    assert len(losses) == len(reference_losses) > 1
    assert losses[0] == pytest.approx(reference_losses[0], abs=1e-6)
    assert losses == pytest.approx(reference_losses, abs=1e-3)


def test_the_chunked_loss_trains_the_same_run(tmp_path, monkeypatch):
    """train.chunked_loss: training and validation losses come from the chunked head + cross-entropy
    (counted), for the same run as the plain loss (float32, the same batches)."""
    import models.linear_cross_entropy

    monkeypatch.setattr(models.linear_cross_entropy, "CHUNK_ELEMENTS", 64 * 8)  # chunks of 8 positions
    chunked_calls = []
    original = models.linear_cross_entropy.linear_cross_entropy
    monkeypatch.setattr(models.linear_cross_entropy, "linear_cross_entropy",
                        lambda *args: (chunked_calls.append(1), original(*args))[1])
    settings = {"train.max_steps": "3", "train.eval_every": "3", "train.save_every": "3"}
    train(small_config(tmp_path / "plain", **settings))
    assert not chunked_calls
    train(small_config(tmp_path / "chunked", **{**settings, "train.chunked_loss": "true"}))
    assert len(chunked_calls) >= 3 + 1  # each step and the validation
    _assert_same_run(tmp_path / "chunked", tmp_path / "plain")


@pytest.mark.parametrize("compiled, message", [
    ("false", "train.flex_attention needs train.compile: true"),
    ("true", "train.flex_attention trains on a CUDA GPU (FlexAttention has no backward pass on a CPU); this "
             "run's device is cpu"),
], ids=["uncompiled", "cpu"])
def test_flex_attention_uncompiled_or_off_a_gpu_is_a_one_line_error(tmp_path, monkeypatch, compiled, message):
    """train.flex_attention: uncompiled it would run FlexAttention's unfused reference, and a CPU has no
    backward pass for it: either stops the run before any data is read, with one line."""
    monkeypatch.setattr(run, "build_datasets", lambda *_: pytest.fail("read data"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(small_config(tmp_path / "flex", **{"train.flex_attention": "true", "train.compile": compiled}))
