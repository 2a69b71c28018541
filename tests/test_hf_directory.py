"""Continued pretraining from a Hugging Face directory as it is (issue 37, items 2 and 4).

The Hugging Face directories are our own random checkpoints exported by llm-export-hf
(llm_pretrain/checkpoint/hf_export.py writes what transformers' save_pretrained writes), in both
config.json forms (transformers 4.x top-level rope keys, 5.x rope_parameters), single-file and
sharded. Loading them (models/hf_directory.py) gives back every weight bitwise; export, import,
export gives the same files; bad directories are one line naming the tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import paddle
import pytest

from llm_pretrain.arguments import parse_arguments
from llm_pretrain.checkpoint import checkpointer as ckpt
from llm_pretrain.checkpoint.hf_export import export_hf
from llm_pretrain.checkpoint.hf_import import import_hf
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.layout import Layout, build_model_config, plan_layout
from models.decoder import CausalLM
from models.dtypes import FLOAT8_E4M3FN_VALUES, float8_e4m3fn_to_float32
from models.hf_directory import SafetensorsFiles, dequantize_fp8_blocks, stream_hf_weights
from models.registry import ARCHITECTURES, resolve_model
from models.weights import load_weights_file, read_paddle_pickle
from test_hf_config_keys import to_transformers5
from test_hf_export import PRESETS, random_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_directory(tmp_path, preset: str, form: str = "4.x", shard: bool = False, name: str = "hf"):
    """A Hugging Face directory of random weights: (directory, the model whose weights it holds)."""
    checkpoint, model = random_checkpoint(tmp_path / f"{name}-run", ARCHITECTURES[preset])
    directory = tmp_path / name
    export_hf(checkpoint, str(directory), max_shard_bytes=20_000 if shard else 5 * 10**9)
    if form == "5.x":
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(to_transformers5(raw), indent=2))
    return directory, model


def _weights(model, exported: bool = False) -> dict:
    """The model's weights; exported: as an export writes them (Baichuan2's NormHead folded into the head,
    llm_pretrain/checkpoint/hf_export.py _Source.read)."""
    weights = {name: param.numpy() for name, param in model.named_parameters()}
    if exported and model.config.norm_head:
        head = weights["lm_head.weight"].astype(np.float64)
        weights["lm_head.weight"] = (head / np.linalg.norm(head, axis=0, keepdims=True)).astype(np.float32)
    return weights


# Every family once; the rotary ones (whose config.json forms differ) in the form transformers 5 writes,
# sharded, and Llama in both.
FORMS = [(case, "5.x", True) if case in ("llama3.1", "qwen2", "mixtral", "qwen2_moe") else (case, "4.x", False)
         for case in sorted(PRESETS)] + [("llama", "5.x", True)]


@pytest.mark.parametrize("case,form,shard", FORMS)
def test_a_hugging_face_directory_loads_every_weight_bitwise(case, form, shard, tmp_path):
    directory, original = hf_directory(tmp_path, PRESETS[case], form, shard)
    if shard:
        assert (directory / "model.safetensors.index.json").is_file()
    config, weights_file = resolve_model(str(directory))
    assert config.architecture_dict() == ARCHITECTURES[PRESETS[case]].architecture_dict()
    assert weights_file.endswith("model.safetensors.index.json" if shard else "model.safetensors")
    paddle.seed(99)
    model = CausalLM(config)
    load_weights_file(model, config, weights_file)
    got, expected = _weights(model), _weights(original, exported=True)
    assert sorted(got) == sorted(expected)
    assert all(np.array_equal(got[name], expected[name]) for name in expected), case


def test_continue_training_is_implied_with_the_directorys_weights(tmp_path):
    directory, _ = hf_directory(tmp_path, "qwen2-tiny", "5.x")
    args, _ = parse_arguments(["--model_name_or_path", str(directory), "--input_dir", str(tmp_path),
                               "--max_steps", "1", "--max_seq_length", "16"])
    assert not args.continue_training and args.tokenizer_path == str(directory)  # the tokenizer: the same directory
    config, weights_file, notes = build_model_config(args, plan_layout(args, 1), "cpu")
    assert weights_file == str(directory / "model.safetensors")
    assert [n for n in notes if n.startswith("continue_training: implied")] and len(notes) == 1, notes
    assert config.rope_theta == 1e6 and config.vocab_size == 256  # the file's, not grown to a tokenizer's


@pytest.mark.parametrize("case", sorted(PRESETS))
def test_export_import_export_gives_the_same_files(case, tmp_path):
    """Item 4: a checkpoint exported, imported (llm-import-hf), its weights saved as a checkpoint again and
    exported again: every file of the two Hugging Face directories is bitwise equal."""
    first, _ = hf_directory(tmp_path, PRESETS[case], name="first")
    import_hf(str(first), str(tmp_path / "ours"))
    config, weights_file = resolve_model(str(tmp_path / "ours"))
    model = CausalLM(config)
    load_weights_file(model, config, weights_file)
    state = {"global_step": 1, "consumed_samples": 8, "layout": {}, "model_config": config.architecture_dict(),
             "args": {"model_name_or_path": str(tmp_path / "ours")}}
    checkpoint = ckpt.save_checkpoint(str(tmp_path / "again-run"), 1, model,
                                      paddle.optimizer.AdamW(parameters=model.parameters()), state, Layout(), None)
    export_hf(checkpoint, str(tmp_path / "second"))
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(tmp_path / "second"))
    for name in names:
        assert (first / name).read_bytes() == (tmp_path / "second" / name).read_bytes(), (case, name)


# deepseek-ai/DeepSeek-V3's config.json quantization_config
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _rewrite_safetensors(path, change) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("damage,message", [
    (lambda d: _rewrite_safetensors(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     "no tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda d: _rewrite_safetensors(d / "model.safetensors",
                                    lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros(3, "f4")})),
     "tensor 'model.layers.2.mlp.up_proj.weight' (1 such) has no place"),
    (lambda d: _rewrite_safetensors(d / "model.safetensors", lambda t: t.update(
        {"model.layers.0.self_attn.o_proj.weight": np.zeros((64, 32), "f4")})),
     "model.layers.0.self_attn.o_proj.weight has shape [64, 32]"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
     "does not fit its header"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})),
     "rope_scaling.rope_type 'dynamic'"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "use_sliding_window": True})),
     "use_sliding_window true cannot be honoured"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "quantization_config": {**FP8_CONFIG, "weight_block_size": [64, 64]}})),
     "quantization_config {"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "quantization_config": {"quant_method": "bitsandbytes"}})),
     'quantization_config {"quant_method": "bitsandbytes"} cannot be honoured'),
    # PaddleNLP's QuantizationConfig with an algorithm set (its null one is read as "not quantized": test_interop)
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "quantization_config": {"weight_quantize_algo": "weight_only_int8",
                                                                                  "quant_type": None}})),
     'quantization_config {"weight_quantize_algo": "weight_only_int8"'),
])
def test_bad_directories_are_one_line_naming_the_tensor_or_key(damage, message, tmp_path):
    directory, _ = hf_directory(tmp_path, "qwen2-tiny")
    damage(directory)
    with pytest.raises(UsageError) as refused:
        config, weights_file = resolve_model(str(directory))
        model = CausalLM(config)
        load_weights_file(model, config, weights_file)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        import_hf(str(directory), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_import_hf_command_refuses_in_one_line_exit_2(tmp_path):
    directory, _ = hf_directory(tmp_path, "qwen2-tiny")
    _rewrite_safetensors(directory / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    message = "no tensor 'model.layers.1.mlp.up_proj.weight'"
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "import_hf.py"), str(directory),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr and not (tmp_path / "out").exists()


def test_a_missing_tensor_is_refused_before_paddle_is_imported(tmp_path):
    """The preflight reads the safetensors headers (no Paddle, no weights): the run stops at once."""
    directory, _ = hf_directory(tmp_path, "llama-tiny")
    _rewrite_safetensors(directory / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    code = ("import sys; from llm_pretrain.arguments import parse_arguments; "
            "from llm_pretrain.parallel.layout import build_model_config, plan_layout; "
            f"args, _ = parse_arguments(['--model_name_or_path', {str(directory)!r}, '--input_dir', 'x', "
            "'--max_steps', '1']); "
            "from llm_pretrain.errors import UsageError\n"
            "try:\n    build_model_config(args, plan_layout(args, 1), 'cpu')\n"
            "except UsageError as e:\n    print(e, 'paddle' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert "no tensor 'lm_head.weight'" in done.stdout and done.stdout.strip().endswith("False"), done
    # the trainer's command: one line, exit 2
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "llm_pretrain", "run_pretrain.py"),
                           "--model_name_or_path", str(directory), "--input_dir", str(tmp_path), "--max_steps", "1",
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "no tensor 'lm_head.weight'" in done.stderr


def test_import_hf_writes_our_directory_with_the_tokenizer(tmp_path):
    directory, original = hf_directory(tmp_path, "mixtral-tiny", "5.x", shard=True)
    (directory / "tokenizer.json").write_text("{}")
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "import_hf.py"), str(directory),
                           str(tmp_path / "ours")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "mixtral" in done.stdout, done.stderr
    assert (tmp_path / "ours" / "tokenizer.json").is_file()
    ours = read_paddle_pickle(str(tmp_path / "ours" / "model_state.pdparams"))
    expected = _weights(original, exported=True)
    assert sorted(ours) == sorted(expected) and all(np.array_equal(ours[k], expected[k]) for k in expected)


# ------------------------------------------------------------------ DeepSeek-V3's published FP8 files
def _to_e4m3_codes(x: np.ndarray) -> np.ndarray:
    """The nearest float8 e4m3fn code of each value (|x| <= 448): the quantizer this test writes files with."""
    values = FLOAT8_E4M3FN_VALUES[:0x7F]  # the non-negative finite codes, increasing
    high = np.clip(np.searchsorted(values, np.abs(x)), 1, len(values) - 1)
    codes = np.where(np.abs(x) - values[high - 1] <= values[high] - np.abs(x), high - 1, high)
    return (codes | np.where(x < 0, 0x80, 0)).astype(np.uint8)


def _quantize(w: np.ndarray, block: int = 128):
    """(e4m3 codes, float32 scale_inv per block) as DeepSeek's inference/kernel.py weight_quant: amax / 448."""
    blocks = [-(-n // block) for n in w.shape]
    scale = np.zeros(blocks, np.float32)
    codes = np.zeros(w.shape, np.uint8)
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = max(np.abs(part).max(), 1e-12) / 448
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = _to_e4m3_codes(part / scale[i, j])
    return codes, scale


def _e4m3_bound(w: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """e4m3's rounding: half a unit in the last place, 2**-4 of the value (3 mantissa bits), or 2**-10 of the
    block's scale among the subnormals."""
    per_value = np.repeat(np.repeat(scale, block, 0), block, 1)[: w.shape[0], : w.shape[1]]
    return 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * per_value


def _write_safetensors(path, tensors: dict) -> None:
    """safetensors by hand: numpy has no float8 (safetensors.numpy cannot write F8_E4M3). tensors: name ->
    (dtype, array whose bytes are written)."""
    header, data, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(data))


def test_float8_e4m3fn_codes_and_block_dequantization():
    """The 256 codes (OCP FP8 e4m3fn): a few by hand, the NaN pair; each 128 x 128 block times its own scale,
    partial blocks at the edges (DeepSeek-V3 inference/kernel.py weight_dequant)."""
    assert [FLOAT8_E4M3FN_VALUES[c] for c in (0x00, 0x01, 0x08, 0x38, 0x3F, 0x7E, 0xC0, 0xFE)] == \
        [0.0, 2.0 ** -9, 2.0 ** -6, 1.0, 1.875, 448.0, -2.0, -448.0]
    assert np.isnan(FLOAT8_E4M3FN_VALUES[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(FLOAT8_E4M3FN_VALUES, [0x7F, 0xFF])).all()
    w = np.random.default_rng(0).standard_normal((300, 260)).astype(np.float32)
    w[:128, :128] *= 100  # blocks of very different scales: a scale per row or per column would be far off
    codes, scale = _quantize(w)
    got = dequantize_fp8_blocks(float8_e4m3fn_to_float32(codes), scale)
    assert scale.shape == (3, 3) and np.all(np.abs(got - w) <= _e4m3_bound(w, scale))
    assert np.abs(got - w).max() > 0  # rounded, not copied


def _fp8_deepseek_directory(tmp_path, copies=True):
    """A tiny DeepSeek-V3 directory written as the published one: every matrix of the attention and the MLPs in
    F8_E4M3 with its _scale_inv, quantization_config in config.json, and the MTP layer's copies of the embedding
    and the head. Returns (directory, original model, {quantized name: (reference, scale)})."""
    from safetensors.numpy import load_file

    directory, original = hf_directory(tmp_path, "deepseek-v3-tiny")
    tensors = {name: ("F32", value) for name, value in load_file(str(directory / "model.safetensors")).items()}
    quantized = {}
    for name, (_, value) in list(tensors.items()):
        if name.endswith("_proj.weight") and "eh_proj" not in name:  # DeepSeek-V3: the linears of the blocks
            codes, scale = _quantize(value)
            tensors[name], tensors[name + "_scale_inv"] = ("F8_E4M3", codes), ("F32", scale)
            quantized[name] = (value, scale)
    n = original.config.num_hidden_layers
    if copies:
        tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"]
    _write_safetensors(directory / "model.safetensors", tensors)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "quantization_config": FP8_CONFIG}))
    return directory, original, quantized


def test_published_fp8_deepseek_v3_files_are_dequantized_and_the_mtp_copies_ignored(tmp_path):
    directory, original, quantized = _fp8_deepseek_directory(tmp_path)
    config, weights_file = resolve_model(str(directory))
    assert config.num_nextn_predict_layers == 1  # the MTP layer is read
    files = SafetensorsFiles(weights_file)
    assert len(quantized) > 20 and not any(n.endswith("_scale_inv") for n in files.names())
    for name, (reference, scale) in quantized.items():
        got = files.read(name)
        assert np.all(np.abs(got - reference) <= _e4m3_bound(reference, scale)), name
    paddle.seed(99)
    model = CausalLM(config)
    load_weights_file(model, config, weights_file)  # the copies: no "has no place"
    got, expected = _weights(model), _weights(original, exported=True)
    assert sorted(got) == sorted(expected)
    exact = [k for k in expected if np.array_equal(got[k], expected[k])]
    assert "embeddings.word_embeddings.weight" in exact and "lm_head.weight" in exact and "mtp.enorm.weight" in exact
    assert len(exact) == len(expected) - len(quantized)  # every other tensor bitwise
    # a copy that is no copy (another shape), an FP8 matrix without its scales, the NaN code: one line each
    header_size = int.from_bytes((directory / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((directory / "model.safetensors").read_bytes()[8:8 + header_size])
    n = config.num_hidden_layers
    for damage, message in [
        ({f"model.layers.{n}.shared_head.head.weight": ("F32", np.zeros((3, 64), "f4"))}, "as a copy of lm_head.weight"),
        ({"model.layers.0.self_attn.o_proj.weight_scale_inv": None}, "has no model.layers.0.self_attn.o_proj.weight_scale_inv"),
        ({"model.layers.0.self_attn.o_proj.weight": ("F8_E4M3", np.full(header["model.layers.0.self_attn.o_proj.weight"]["shape"], 0x7F, np.uint8))},
         "holds the NaN code"),
    ]:
        tensors = {**_read_all(directory / "model.safetensors", header), **damage}
        tensors = {name: value for name, value in tensors.items() if value is not None}
        _write_safetensors(tmp_path / "damaged.safetensors", tensors)
        with pytest.raises(UsageError, match=message) as refused:
            damaged = SafetensorsFiles(str(tmp_path / "damaged.safetensors"))
            dict(stream_hf_weights(config, json.loads((directory / "config.json").read_text()), damaged, "damaged"))
        assert "\n" not in str(refused.value)


def _read_all(path, header) -> dict:
    """name -> (dtype, the stored array as bytes of its dtype) of a file _write_safetensors wrote."""
    kinds = {"F32": np.float32, "F8_E4M3": np.uint8}
    files = SafetensorsFiles(str(path))
    out = {}
    for name, entry in header.items():
        _, start, _ = files.entries[name]
        begin, end = entry["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + begin)
            out[name] = (entry["dtype"], np.frombuffer(f.read(end - begin), kinds[entry["dtype"]]).reshape(entry["shape"]))
    return out
