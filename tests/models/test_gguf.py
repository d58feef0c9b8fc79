"""GGUF files (models/gguf.py) against transformers: a random GQA Llama written as llama.cpp's converter
writes it (its tensor names, its rotary permutation of the q / k rows, its metadata keys) loads as our model
with transformers' logits. tests/models/test_smollm2.py checks a real quantized file the same way."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

import models.quantize
from models import LanguageModel
from models.quantize import load_quantized_language_model
from models.weights import CheckpointError
from tests.models.helpers import fused_copy, save_tiny_llama

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to a Hugging Face q or k projection."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _write_gguf(path, model, architecture: str = "llama", matrices: type | GGMLQuantizationType = np.float32,
                drop: str | None = None, name: str | None = None,
                extra: dict[str, np.ndarray] | None = None, float32: tuple[str, ...] = ()) -> None:
    """`model` as llama.cpp writes it: matrices as float32 or float16, or quantized (Q4_1: the embedding and
    the `float32` tensors stay float32); `drop` leaves out one metadata key, `extra` adds tensors."""
    c, weights = model.config, {name: t.numpy() for name, t in model.state_dict().items()}
    writer = GGUFWriter(str(path), architecture)
    metadata = {"llama.block_count": (writer.add_uint32, c.num_hidden_layers),
                "llama.context_length": (writer.add_uint32, c.max_position_embeddings),
                "llama.embedding_length": (writer.add_uint32, c.hidden_size),
                "llama.feed_forward_length": (writer.add_uint32, c.intermediate_size),
                "llama.attention.head_count": (writer.add_uint32, c.num_attention_heads),
                "llama.attention.head_count_kv": (writer.add_uint32, c.num_key_value_heads),
                "llama.rope.freq_base": (writer.add_float32, c.rope_parameters["rope_theta"]),
                "llama.attention.layer_norm_rms_epsilon": (writer.add_float32, c.rms_norm_eps),
                "llama.vocab_size": (writer.add_uint32, c.vocab_size),
                "tokenizer.ggml.eos_token_id": (writer.add_uint32, c.eos_token_id)}
    if name:
        metadata["general.name"] = (writer.add_string, name)
    for key, (add, value) in metadata.items():
        if key != drop:
            add(key, value)
    tensors = {"token_embd.weight": weights["model.embed_tokens.weight"],
               "output_norm.weight": weights["model.norm.weight"]}
    if not c.tie_word_embeddings:
        tensors["output.weight"] = weights["lm_head.weight"]
    heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
    for i in range(c.num_hidden_layers):
        for gguf_name, hf_name in LAYER_NAMES.items():
            values = weights[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name.endswith(tuple(heads)):
                values = _llama_cpp_permute(values, heads[hf_name.removeprefix("self_attn.")])
            tensors[f"blk.{i}.{gguf_name}.weight"] = values
    quantized = isinstance(matrices, GGMLQuantizationType)
    for tensor_name, values in {**tensors, **(extra or {})}.items():
        if quantized and values.ndim == 2 and tensor_name not in ("token_embd.weight", *float32):
            writer.add_tensor(tensor_name, quantize(values, matrices), raw_dtype=matrices)
        else:
            dtype = matrices if values.ndim == 2 and not quantized else None
            writer.add_tensor(tensor_name, np.ascontiguousarray(values, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tie, matrices", [(True, np.float32), (False, np.float32), (True, np.float16)],
                         ids=["tied", "untied", "float16"])
def test_a_gguf_llama_loads_with_transformers_logits(tmp_path, tie, matrices):
    reference = save_tiny_llama(tmp_path / "hf", tie=tie)
    if matrices == np.float16:  # the reference holds exactly what the file can (float16 is exact in float32)
        with torch.no_grad():
            for p in reference.parameters():
                if p.dim() == 2:
                    p.copy_(p.half())
    _write_gguf(tmp_path / "model.gguf", reference, matrices=matrices)
    ours = LanguageModel.from_pretrained(tmp_path / "model.gguf")
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads,
            c.intermediate_size) == (3, 64, 8, 2, 128)
    assert (c.rope_theta, c.eos_token_id, c.tie_word_embeddings) == (5000.0, 3, tie)
    assert c.rms_norm_eps == pytest.approx(1e-5)  # GGUF keeps it as a float32
    ids = torch.randint(0, 128, (2, 40))
    fused = fused_copy(ours)
    with torch.no_grad():
        expected = reference(ids).logits
        actual = ours.head(ours(ours.token_embedding(ids))[0])
        actual_fused = fused.head(fused(fused.token_embedding(ids))[0])
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(actual_fused, expected, atol=1e-4, rtol=0)


def _no_unpacking(*_):
    raise AssertionError("an int4 weight was unpacked")


@pytest.mark.parametrize("mixed", [False, True], ids=["q4_1", "mixed"])
def test_int4_reads_q4_1_blocks_as_they_are(tmp_path, mixed, monkeypatch):
    """load_quantized_language_model(gguf, "int4"): each Q4_1 matrix (blocks of 32 4-bit q with a
    scale d and a minimum m: w = d * q + m) becomes an int4 weight holding the file's q unchanged, and the
    logits are those of the model de-quantized to float32 (gguf's own dequantize), to float32 rounding.
    Mixed: a float32 matrix (holding values on Q4_1's grid) is quantized as it loads, and a Q4_1 head of 120
    rows (not a multiple of 16: int4's kernel leaves it float) is de-quantized. An all-Q4_1 file loads
    without unpacking any int4 weight (before, every one was unpacked to learn the shapes to load)."""
    pytest.importorskip("torchao")
    reference = save_tiny_llama(tmp_path / "hf", tie=False, vocab_size=120 if mixed else 128)
    float32 = ("blk.0.ffn_down.weight",) if mixed else ()
    with torch.no_grad():  # the float32 matrix's values: on Q4_1's grid, so int4 holds them exactly
        weight = reference.model.layers[0].mlp.down_proj.weight
        weight.copy_(torch.from_numpy(dequantize(quantize(weight.numpy(), GGMLQuantizationType.Q4_1),
                                                 GGMLQuantizationType.Q4_1)))
    _write_gguf(tmp_path / "model.gguf", reference, matrices=GGMLQuantizationType.Q4_1, float32=float32)
    with monkeypatch.context() as patch:
        if not mixed:  # (mixed: the float32 matrix is quantized, then read back as plain int4 tensors)
            patch.setattr(models.quantize, "_unpack_int4_cpu", _no_unpacking)
        direct = load_quantized_language_model(tmp_path / "model.gguf", "int4")
    float_model = LanguageModel.from_pretrained(tmp_path / "model.gguf")
    saved = direct.state_dict()  # the int4 weights' q, two a byte (models/quantize.py), the parts' names
    names = {**{f"blk.{i}.{gguf}.weight": f"blocks.{i}.{hf.replace('self_attn', 'attn')}.weight"
                for i in range(3) for gguf, hf in LAYER_NAMES.items() if "norm" not in gguf},
             "output.weight": "head.weight"}
    heads = {"attn_q": 8, "attn_k": 2}
    assert (type(direct.head.weight).__name__ == "Int4OpaqueTensor") != mixed
    assert type(direct.blocks[0].mlp.down_proj.weight).__name__ == "Int4OpaqueTensor"
    q4_1 = [tensor for tensor in GGUFReader(tmp_path / "model.gguf").tensors
            if tensor.name in names and tensor.tensor_type == GGMLQuantizationType.Q4_1
            and saved[names[tensor.name]].dtype == torch.uint8]  # the head, mixed: float
    assert len(q4_1) == 3 * 7 + 1 - 2 * mixed
    for tensor in q4_1:
        # the file's q, from gguf's own de-quantized values and each block's d and m (its first 4 bytes)
        blocks = tensor.data.reshape(tensor.data.shape[0], -1, 20)
        d, m = (blocks[..., i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(blocks.shape[:2] + (32,))
        expected_q = np.rint((weights - m) / d).reshape(tensor.data.shape[0], -1)
        packed = saved[names[tensor.name]].numpy()
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        projection = tensor.name.split(".")[-2]
        if projection in heads:  # our rows are Hugging Face's: llama.cpp's rotary order, as the file has it
            q = _llama_cpp_permute(q, heads[projection])
        np.testing.assert_array_equal(q, expected_q, err_msg=tensor.name)
    ids = torch.randint(0, reference.config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = float_model.head(float_model(float_model.token_embedding(ids))[0])
        actual = direct.head(direct(direct.token_embedding(ids))[0])
    # zero = m + 8 d in float32, then (q - 8) * d + zero in the kernel: float32 rounding of the weights only
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize(
    "change, error",
    [
        ({"architecture": "qwen2"}, r"GGUF architecture 'qwen2' is not supported \(expected llama\)"),
        (
            {"drop": "llama.attention.head_count"},
            r"not a complete Llama GGUF file \(no llama.attention.head_count in",
        ),
        (
            {"extra": {"rope_freqs.weight": np.ones(4, dtype=np.float32)}},
            r"unsupported Llama variant: rope scaling",
        ),
        ({"name": "Mistral 7B v0.1"}, r"model_type 'mistral' is not supported"),
    ],
    ids=["qwen2", "incomplete", "llama3-rope-freqs", "mistral"],
)
def test_a_gguf_this_model_cannot_run_is_refused_in_one_line(tmp_path, change, error):
    _write_gguf(tmp_path / "model.gguf", save_tiny_llama(tmp_path / "hf", tie=True), **change)
    with pytest.raises(CheckpointError, match=error):
        LanguageModel.from_pretrained(tmp_path / "model.gguf")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a GGUF file at all" * 10)
    with pytest.raises(CheckpointError, match=r"model.gguf: not a readable GGUF file"):
        LanguageModel.from_pretrained(tmp_path / "model.gguf")
