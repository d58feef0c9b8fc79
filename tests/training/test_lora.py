"""LoRA through peft (models/lora.py, train.lora): only the adapters train, checkpoints hold them alone in
peft's format, merged weights compute what base + adapter computed, and inference and resume load
base + adapter."""

import json
import re

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import generate
import training.run
from loading import load_checkpoint
from models import VisionLanguageModel
from models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LANGUAGE_PROJECTIONS,
    add_adapters,
    has_adapters,
    merge_adapters,
    quantize_frozen,
)
from tests.models.helpers import save_tiny_llama, tiny_vlm
from tests.training.helpers import small_config
from training import export
from training.config import load_run_config
from training.run import train
from typed_config import ConfigError

LORA = {"data.shapes.image_size": "32", "data.shapes.num_train": "64", "data.shapes.num_validation": "8",
        "train.batch_size": "8", "train.warmup_steps": "2", "train.log_every": "1", "train.device": "cpu",
        "train.eval_questions": "4", "train.eval_batches": "1", "train.num_workers": "0",
        "train.lr_vision": "0", "train.lr_projector": "0", "train.lr_language": "0.02",
        "train.min_lr_tail_fraction": "0", "train.lora.rank": "4", "train.lora.alpha": "8"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny trained run to adapt."""
    directory = tmp_path_factory.mktemp("base")
    train(small_config(directory, **{"train.max_steps": "2", "train.save_every": "2", "train.eval_every": "2",
                                     "train.eval_questions": "0"}))
    return directory


def _lora_run(base, output, steps: int, **overrides):
    settings = {**LORA, "init_from": str(base), "train.max_steps": str(steps), "train.save_every": "2",
                "train.eval_every": str(steps), "train.output_dir": str(output), **overrides}
    return train(load_run_config("configs/tiny.yaml", settings, keep_model=False))


def test_merged_weights_compute_what_base_and_adapter_compute():
    model = tiny_vlm(seed=2).double().eval()  # float64: the comparison sees the merge, not float32 rounding
    add_adapters(model, rank=4, alpha=8, target_modules=LANGUAGE_PROJECTIONS)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # zero at first: give the adapters something to add
                parameter.normal_(0, 0.2)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted, _ = model(ids)
        merged, _ = merge_adapters(model)(ids)
    assert not any("lora" in name for name in model.state_dict())
    torch.testing.assert_close(merged, adapted, atol=1e-10, rtol=0)
    # the adapters changed the model
    assert (merged - tiny_vlm(seed=2).double().eval()(ids)[0]).abs().max() > 1e-3


def test_only_the_adapters_train_and_the_checkpoint_holds_them_alone(base, tmp_path):
    metrics = _lora_run(base, tmp_path / "lora", steps=12)
    checkpoint = tmp_path / "lora" / "step_000012"
    assert (checkpoint / ADAPTER_CONFIG).is_file() and not (checkpoint / "model.safetensors").exists()
    config = json.loads((checkpoint / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str((base / "step_000002").resolve()) and config["r"] == 4
    adapter = load_file(checkpoint / ADAPTER_WEIGHTS)
    assert adapter and all(
        key.startswith("base_model.model.language.blocks.") and ".lora_" in key for key in adapter
    )
    history = json.loads((checkpoint / "training_state.json").read_text())["history"]
    assert history[-1][1] < history[0][1] and metrics["step"] == 12
    assert metrics["trainable_parameters"] == sum(tensor.numel() for tensor in adapter.values())
    # the base is untouched: merging back a zero adapter B gives it exactly; the adapted model differs from it
    start = VisionLanguageModel.from_pretrained(base / "step_000002")
    model, _ = load_checkpoint(checkpoint, torch.device("cpu"))
    changed = {name for name, tensor in start.state_dict().items()
               if not torch.equal(tensor, model.state_dict()[name])}
    assert changed and all("language.blocks." in name and name.endswith("_proj.weight") for name in changed)


def test_an_adapter_checkpoint_answers_like_its_merged_export(base, tmp_path, capsys):
    _lora_run(base, tmp_path / "lora", steps=4)
    checkpoint = tmp_path / "lora" / "step_000004"
    # the newest checkpoint
    assert export.main(["--merge", str(tmp_path / "lora"), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file() and not (
        tmp_path / "merged" / ADAPTER_CONFIG
    ).exists()
    Image.new("RGB", (32, 32), "skyblue").save(tmp_path / "sky.png")
    capsys.readouterr()
    answers = []
    for directory in (checkpoint, tmp_path / "merged"):
        assert generate.main(["--checkpoint", str(directory), "--image", str(tmp_path / "sky.png"),
                              "--prompt", "What color is the circle?", "--max-new-tokens", "8"]) == 0
        answers.append(capsys.readouterr().out.strip())
    assert answers[0] == answers[1]


def test_a_resumed_lora_run_equals_the_uninterrupted_one(base, tmp_path):
    _lora_run(base, tmp_path / "whole", steps=4, **{"train.decay_steps": "4"})
    _lora_run(base, tmp_path / "split", steps=2, **{"train.decay_steps": "4"})
    from train import main

    assert main(["--resume", str(tmp_path / "split"), "--train.max_steps", "4"]) == 0
    whole, split = (
        load_file(tmp_path / name / "step_000004" / ADAPTER_WEIGHTS) for name in ("whole", "split")
    )
    assert whole.keys() == split.keys()
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], atol=1e-6, rtol=0, msg=key)


def test_adapters_need_a_model_to_adapt():
    with pytest.raises(Exception, match="train.lora.rank: adapters go on a trained model"):
        load_run_config("configs/tiny.yaml", {"train.lora.rank": "4"})


def test_an_adapter_peft_wrote_on_transformers_llama_gives_its_logits_here(tmp_path):
    """peft's own LoRA on transformers' Llama (its names: model.layers.N.self_attn.q_proj, ...), saved with
    PeftModel.save_pretrained, loaded onto the same weights in tinyvlm's LanguageModel: the same logits."""
    from peft import LoraConfig, get_peft_model

    from models import LanguageModel
    from models.lora import load_adapter

    reference = save_tiny_llama(tmp_path / "llama", tie=False)
    ids = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = reference(input_ids=ids).logits
    adapted = get_peft_model(reference,
                             LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                        modules_to_save=["lm_head"]))  # a head trained whole, too
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    adapted.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
    ours = LanguageModel.from_pretrained(tmp_path / "llama").eval()
    load_adapter(ours, tmp_path / "adapter")
    with torch.no_grad():
        logits = ours.head(ours(ours.token_embedding(ids))[0])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (plain - expected).abs().max() > 1e-2  # the adapter matters


def test_modules_to_save_train_whole_and_travel_in_the_adapter(base, tmp_path):
    _lora_run(base, tmp_path / "lora", steps=4, **{"train.lora.modules_to_save": "projector",
                                                    "train.lr_projector": "0.02"})
    checkpoint = tmp_path / "lora" / "step_000004"
    assert json.loads((checkpoint / ADAPTER_CONFIG).read_text())["modules_to_save"] == ["projector"]
    start = VisionLanguageModel.from_pretrained(base / "step_000002")
    adapter = load_file(checkpoint / ADAPTER_WEIGHTS)
    projector = {f"projector.{name}" for name in start.projector.state_dict()}
    assert {key.removeprefix("base_model.model.") for key in adapter if ".lora_" not in key} == projector
    model, _ = load_checkpoint(checkpoint, torch.device("cpu"))
    changed = {name for name, tensor in start.state_dict().items()
               if not torch.equal(tensor, model.state_dict()[name])}
    # every projector weight trained, and nothing but it and the adapted projections
    assert projector <= changed
    assert all(
        name in projector or ("language.blocks." in name and name.endswith("_proj.weight"))
        for name in changed
    )
    for name in projector:
        assert torch.equal(model.state_dict()[name], adapter[f"base_model.model.{name}"])


@pytest.mark.parametrize(
    "setting, value, message",
    [
        ("target_modules", "(", "train.lora.target_modules: not a regular expression"),
        # a regex matches whole names: none here
        ("target_modules", "q_proj", "train.lora.target_modules (q_proj): "),
        (
            "target_modules",
            r"projector\.proj",
            "train.lora puts trained weights in the projector (projector.proj.lora_A",
        ),
        (
            "target_modules",
            r"language\.head",
            r"train.lora.target_modules (language\.head): language.head shares its weight with another",
        ),
        (
            "modules_to_save",
            "vision",
            "train.lora puts trained weights in the vision (vision.position_embedding",
        ),
        ("modules_to_save", "head", "train.lora.modules_to_save (head): 'head' matches no module"),
        (
            "modules_to_save",
            r"language\.head",
            r"train.lora.modules_to_save (language\.head): language.head shares its weight with another",
        ),
        (
            "modules_to_save",
            r"language\.blocks\.0\.attn",
            r"train.lora.modules_to_save (language\.blocks\.0\.attn): language.blocks.0.attn holds adapters",
        ),
    ],
    ids=[
        "not-a-regex",
        "no-match",
        "frozen-part",
        "tied-head",
        "whole-frozen-part",
        "whole-no-match",
        "whole-tied-head",
        "whole-adapted",
    ],
)
def test_adapters_where_they_cannot_train_are_one_line_config_errors(base, tmp_path, setting, value, message):
    with pytest.raises(ConfigError) as error:
        _lora_run(base, tmp_path / "lora", steps=2, **{f"train.lora.{setting}": value})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_fine_tune_never_writes_into_the_run_it_starts_from(base):
    config = load_run_config("configs/tiny.yaml", {"init_from": str(base)}, keep_model=False)
    assert config.train.output_dir == "runs/finetune"  # not tiny.yaml's runs/tiny, where its start may be
    with pytest.raises(ConfigError, match=r"train.output_dir \(.*\) holds init_from"):
        _lora_run(base, base, steps=2)


def test_an_adapter_with_options_tinyvlm_does_not_reproduce_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    from models import CheckpointError, LanguageModel
    from models.lora import load_adapter

    reference = save_tiny_llama(tmp_path / "llama", tie=False)
    get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True)
                   ).save_pretrained(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match="the adapter uses use_rslora, which tinyvlm does not load"):
        load_adapter(LanguageModel.from_pretrained(tmp_path / "llama"), tmp_path / "adapter")


def test_a_4bit_base_computes_with_its_dequantized_weights_and_only_the_adapters_train():
    bnb = pytest.importorskip("bitsandbytes")
    from models.lora import quantize_frozen

    model, reference = tiny_vlm(seed=3), tiny_vlm(seed=3)
    assert quantize_frozen(model, torch.device("cpu"), compute_dtype=torch.float32) == sum(
        1 for name, module in reference.named_modules()
        if isinstance(module, torch.nn.Linear) and ".blocks." in name)
    with torch.no_grad():  # the reference: full-precision layers holding the 4-bit weights, dequantized
        for name, module in model.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                reference.get_submodule(name).weight.copy_(
                    bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state))
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], reference(ids)[0], atol=1e-5, rtol=0)
    packed = {name: p.detach().clone() for name, p in model.named_parameters()}
    add_adapters(model, rank=4, alpha=8, target_modules=LANGUAGE_PROJECTIONS)
    assert all(".lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = model(ids, targets=ids.roll(-1, 1))[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    after = {
        name.replace(".base_layer", ""): p for name, p in model.named_parameters() if ".lora_" not in name
    }
    assert after.keys() == packed.keys() and all(torch.equal(after[name], packed[name]) for name in packed)


@pytest.mark.parametrize("settings, message", [
    ({"train.lora.quantize_base": "true"},
     "train.lora.quantize_base: a 4-bit base (QLoRA, bitsandbytes) trains on "
     "a CUDA GPU; this run's device is cpu"),
    ({"train.lora.quantize_base": "true", "train.lora.rank": "0"},
     "train.lora.quantize_base quantizes the base "
     "under adapters: set train.lora.rank"),
], ids=["cpu", "no-adapters"])
def test_a_4bit_base_off_a_gpu_or_without_adapters_is_a_one_line_error(base, tmp_path, settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _lora_run(base, tmp_path / "qlora", steps=2, **settings)


def test_quantizing_a_model_that_has_adapters_is_refused():
    model = tiny_vlm(seed=0)
    add_adapters(model, rank=4, alpha=8, target_modules=LANGUAGE_PROJECTIONS)
    with pytest.raises(ValueError, match="the model has adapters"):
        quantize_frozen(model, torch.device("cpu"))


def test_a_resumed_qlora_run_quantizes_its_base_before_its_adapters_go_back(base, tmp_path, monkeypatch):
    # A resumed run once quantized the base with the checkpoint's adapters on it: they became 4-bit too and
    # the run stopped (seen on an H100). bitsandbytes' layers need a GPU: a stand-in records the order.
    adapted_when_quantized = []
    monkeypatch.setattr(training.run, "_quantize_base",
                        lambda model, device: adapted_when_quantized.append(has_adapters(model)))
    _lora_run(base, tmp_path / "run", steps=2, **{"train.lora.quantize_base": "true"})
    from train import main

    assert main(["--resume", str(tmp_path / "run" / "step_000002"), "--train.max_steps", "4"]) == 0
    assert adapted_when_quantized == [False, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="QLoRA's 4-bit base trains on a CUDA GPU")
def test_qlora_trains_on_a_gpu_and_resumes_exactly(base, tmp_path):
    pytest.importorskip("bitsandbytes")
    settings = {"train.device": "cuda", "train.lora.quantize_base": "true", "train.decay_steps": "4"}
    metrics = _lora_run(base, tmp_path / "whole", steps=4, **settings)
    _lora_run(base, tmp_path / "split", steps=2, **settings)
    from train import main

    assert main(["--resume", str(tmp_path / "split"), "--train.max_steps", "4"]) == 0
    whole, split = (
        load_file(tmp_path / name / "step_000004" / ADAPTER_WEIGHTS) for name in ("whole", "split")
    )
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], atol=1e-5, rtol=0, msg=key)
    history = json.loads((tmp_path / "whole" / "step_000004" / "training_state.json").read_text())["history"]
    assert history[-1][1] < history[0][1] and metrics["step"] == 4
