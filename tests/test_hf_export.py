"""Hugging Face export (llm_pretrain/checkpoint/hf_export.py) and import of the same layouts.

Export reads a checkpoint written by the trainer's checkpointer; import (models/paddlenlp_interop.py)
reads the export back, single-file and sharded, for every family with a Hugging Face class: the
weights come back bitwise, and training continues from them with the same losses. The outside
clients: PaddleNLP 2.8.1's own conversion (`from_pretrained(..., convert_from_torch=True)`) here;
transformers + torch in scripts/verify_hf_export.py (benchmarks/hf_export_verification.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import paddle
import pytest

from llm_pretrain.checkpoint import checkpointer as ckpt
from llm_pretrain.errors import UsageError
from llm_pretrain.checkpoint.hf_export import export_hf, main
from llm_pretrain.parallel.layout import Layout
from models.decoder import CausalLM
from models.families import FAMILIES
from llm_pretrain.checkpoint.interchange import import_from_paddlenlp
from models.registry import ARCHITECTURES, resolve_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORTED = sorted(name for name, family in FAMILIES.items() if family.hugging_face is not None)
# Each exported family's tiny preset; Llama 3.1's rotary scaling and Baichuan's rotary variant too.
PRESETS = {family: FAMILIES[family].tiny for family in EXPORTED}
PRESETS.update({"llama3.1": "llama3-tiny"})


def random_checkpoint(tmp_path, config, seed=3, tokenizer=None):
    """checkpoint-1 of random weights, written by the trainer's checkpointer; (path, model)."""
    paddle.seed(seed)
    model = CausalLM(config)
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if len(param.shape) == 1 and "norm" in name else 0.0
            param.set_value((base + 0.1 * rng.standard_normal(param.shape)).astype("float32"))
    model.eval()
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    state = {"global_step": 1, "consumed_samples": 8, "layout": {}, "model_config": config.architecture_dict(),
             "args": {"model_name_or_path": "tiny", "tokenizer_name_or_path": tokenizer}}
    return ckpt.save_checkpoint(str(tmp_path / "output"), 1, model, optimizer, state, Layout(), None), model


def safetensors_names(directory) -> dict:
    from safetensors import safe_open

    names = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(directory, file), framework="np") as f:
                names.update({name: file for name in f.keys()})
    return names


@pytest.mark.parametrize("case", sorted(PRESETS))
def test_export_then_import_gives_the_same_weights(case, tmp_path):
    config = ARCHITECTURES[PRESETS[case]]
    path, model = random_checkpoint(tmp_path, config)
    target = FAMILIES[config.family].hugging_face
    result = export_hf(path, str(tmp_path / "hf"))
    files = sorted(os.listdir(tmp_path / "hf"))
    assert files == ["config.json", "generation_config.json", "model.safetensors"], files
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [target.class_name] and written["model_type"] == target.model_type
    assert written["torch_dtype"] == "float32" and written["vocab_size"] == config.vocab_size
    assert written.get("tie_word_embeddings") == config.tie_word_embeddings
    if config.rope_scaling:
        assert written["rope_scaling"] == config.rope_scaling
    assert result["parameters"] == sum(int(np.prod(p.shape)) for p in model.parameters())

    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "back"))
    imported, weights_file = resolve_model(str(tmp_path / "back"))
    assert imported.architecture_dict() == config.architecture_dict()
    back = paddle.load(weights_file, return_numpy=True)
    ours = ckpt.merge_checkpoint(path)
    assert sorted(back) == sorted(ours)
    for name, value in ours.items():
        if name == "lm_head.weight" and config.norm_head:  # Baichuan2's NormHead is exported normalized
            value = value / np.linalg.norm(value, axis=0, keepdims=True)
            np.testing.assert_allclose(back[name], value, rtol=1e-6, atol=1e-7)
        else:
            assert np.array_equal(back[name], value), name


def test_fused_checkpoint_exports_like_the_unfused_one(tmp_path):
    """A checkpoint with fused q|k|v and gate|up gives the same Hugging Face tensors, bit for bit."""
    config = ARCHITECTURES["llama-tiny"]
    fused = config.replace(fuse_attention_qkv=True, fuse_attention_ffn=True)
    path, _ = random_checkpoint(tmp_path / "unfused", config)
    weights = ckpt.merge_checkpoint(path)
    paddle.seed(0)
    model = CausalLM(fused)
    from models.paddlenlp_interop import fuse
    from models.weights import load_full_weights

    load_full_weights(model, fused, fuse(fused, dict(weights)), "test")
    state = {"global_step": 1, "consumed_samples": 0, "layout": {}, "model_config": fused.architecture_dict()}
    fused_path = ckpt.save_checkpoint(str(tmp_path / "fused"), 1, model, paddle.optimizer.AdamW(
        parameters=model.parameters()), state, Layout(), None)
    assert "layers.0.self_attn.qkv_proj.weight" in ckpt.merge_checkpoint(fused_path)
    export_hf(path, str(tmp_path / "a"))
    export_hf(fused_path, str(tmp_path / "b"))
    from safetensors.numpy import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_sharded_export_and_import(tmp_path):
    config = ARCHITECTURES["qwen2-tiny"]
    path, _ = random_checkpoint(tmp_path, config)
    result = export_hf(path, str(tmp_path / "hf"), max_shard_bytes=70_000)
    shards = sorted(f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors"))
    assert len(shards) > 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == safetensors_names(tmp_path / "hf")
    assert index["metadata"]["total_size"] == result["bytes"]
    sizes = [os.path.getsize(tmp_path / "hf" / f) for f in shards]
    assert all(size < 70_000 + 4096 for size in sizes)  # data within the limit (+ the JSON header)
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "back"))
    back = paddle.load(str(tmp_path / "back" / "model_state.pdparams"), return_numpy=True)
    ours = ckpt.merge_checkpoint(path)
    assert all(np.array_equal(back[name], value) for name, value in ours.items())


def test_bfloat16_export_rounds_like_paddle(tmp_path):
    config = ARCHITECTURES["llama-tiny"]
    path, model = random_checkpoint(tmp_path, config)
    export_hf(path, str(tmp_path / "hf"), dtype="bfloat16")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    begin, end = header["model.norm.weight"]["data_offsets"]  # numpy cannot hold bfloat16: read the bits
    bits = np.frombuffer(raw[8 + length + begin:8 + length + end], dtype=np.uint16)
    expected = paddle.to_tensor(model.norm.weight.numpy()).astype("bfloat16").view("uint16").numpy()  # Paddle's cast
    assert np.array_equal(bits, expected)
    # Import widens bfloat16 to float32 exactly: the weights are the checkpoint's, rounded as Paddle rounds.
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "back"))
    back = paddle.load(str(tmp_path / "back" / "model_state.pdparams"), return_numpy=True)
    for name, param in model.canonical_named_parameters():
        assert np.array_equal(back[name], param.astype("bfloat16").astype("float32").numpy()), name


def test_export_reads_one_tensor_at_a_time(tmp_path):
    """Peak memory of the export is a small multiple of the largest tensor, not the model's size (a
    version that gathers every weight first fails this: it holds the whole model)."""
    config = ARCHITECTURES["llama-tiny"].replace(num_hidden_layers=12, hidden_size=192, intermediate_size=512,
                                                 num_attention_heads=6, num_key_value_heads=2)
    path, model = random_checkpoint(tmp_path, config)
    total = sum(int(np.prod(p.shape)) * 4 for p in model.parameters())
    largest = max(int(np.prod(p.shape)) * 4 for p in model.parameters())
    del model
    tracemalloc.start()
    export_hf(path, str(tmp_path / "hf"), verify_checksums=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert total > 20 * largest and peak < 6 * largest, (peak, largest, total)


def test_paddlenlp_converts_the_export(tmp_path):
    """PaddleNLP 2.8.1's own Hugging Face conversion (from_pretrained with convert_from_torch) loads the
    export of every family it has a mapping for and computes our logits."""
    import paddlenlp.transformers as pdt

    for family, class_name in (("llama", "LlamaForCausalLM"), ("gpt3", "GPTForCausalLM"),
                               ("bloom", "BloomForCausalLM")):
        config = ARCHITECTURES[FAMILIES[family].tiny]
        path, model = random_checkpoint(tmp_path / family, config, seed=7)
        export_hf(path, str(tmp_path / family / "hf"))
        theirs = getattr(pdt, class_name).from_pretrained(str(tmp_path / family / "hf"), convert_from_torch=True,
                                                          dtype="float32")
        theirs.eval()
        ids = paddle.to_tensor(np.random.default_rng(1).integers(0, 256, size=(2, 16)), dtype="int64")
        with paddle.no_grad():
            ours, reference = model(ids).numpy(), theirs(input_ids=ids, return_dict=True).logits.numpy()
        assert ours.std() > 0.1 and np.abs(ours - reference).max() < 1e-4, family


# ----------------------------------------------------------------------------- bad input
def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    path, _ = random_checkpoint(tmp_path, ARCHITECTURES["llama-tiny"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "exists and is not empty" in _error(capsys, [path, str(tmp_path / "full")])
    assert "--max-shard-size" in _error(capsys, [path, str(tmp_path / "o"), "--max-shard-size", "lots"])

    qwen_path, _ = random_checkpoint(tmp_path / "qwen", ARCHITECTURES["qwen-tiny"])
    assert "family 'qwen' has no Hugging Face class" in _error(capsys, [qwen_path, str(tmp_path / "o")])

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    data = broken / "tensors.rank00000.safetensors"
    data.write_bytes(data.read_bytes()[:-100])  # truncated
    assert "tensors.rank00000.safetensors has" in _error(capsys, [str(broken), str(tmp_path / "o")])
    raw = bytearray(data.read_bytes())
    data.write_bytes(bytes(raw) + bytes(100))  # the right size, other bytes
    assert "tensors.rank00000.safetensors does not match its checksum" in _error(capsys, [str(broken), str(tmp_path / "o")])
    os.remove(data)
    assert "tensors.rank00000.safetensors is missing" in _error(capsys, [str(broken), str(tmp_path / "o")])
    os.remove(broken / ckpt.COMPLETE_MARKER)
    assert "is not complete" in _error(capsys, [str(broken), str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_script_and_last_save_in_hf_then_training_continues(embedded_corpus, tmp_path):
    """last_save_in_hf writes checkpoint-N-hf after the final save; scripts/export_hf.py writes the same
    files; the import of the export trains on with the same losses as the checkpoint's own weights."""
    from parity_utils import argv, base_arguments, run_single, train_records, write_json

    args_file = write_json(tmp_path / "run.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, max_steps=3, save_steps=3, last_save_in_hf=True))
    run_single([argv(args_file, tmp_path / "first")], tmp_path, "first")
    checkpoint, exported = tmp_path / "first" / "checkpoint-3", tmp_path / "first" / "checkpoint-3-hf"
    assert sorted(os.listdir(exported)) == ["config.json", "generation_config.json", "model.safetensors",
                                            "tokenizer.model", "tokenizer_config.json"]
    eos = json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
    assert isinstance(eos, int)

    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "export_hf.py"), str(checkpoint),
                           str(tmp_path / "again")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "LlamaForCausalLM" in done.stdout, done.stderr[-2000:]
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()

    # The import, and (the reference) the checkpoint's weights as they are, each continue training.
    import_from_paddlenlp(str(exported), str(tmp_path / "imported"))
    reference = tmp_path / "reference"
    reference.mkdir()
    shutil.copy(tmp_path / "imported" / "config.json", reference / "config.json")
    weights = ckpt.merge_checkpoint(str(checkpoint))
    paddle.save({k: paddle.to_tensor(v) for k, v in weights.items()}, str(reference / "model_state.pdparams"))
    back = paddle.load(str(tmp_path / "imported" / "model_state.pdparams"), return_numpy=True)
    assert sorted(back) == sorted(weights) and all(np.array_equal(back[k], weights[k]) for k in weights)
    runs = [argv(args_file, tmp_path / name, model_name_or_path=str(tmp_path / directory), continue_training=True,
                 last_save_in_hf=False, max_steps=2, save_steps=0)
            for name, directory in (("from_import", "imported"), ("from_checkpoint", "reference"))]
    # and the Hugging Face directory itself (models/hf_directory.py), continue_training implied (issue 37)
    runs.append(argv(args_file, tmp_path / "from_hf_dir", model_name_or_path=str(exported), last_save_in_hf=False,
                     max_steps=2, save_steps=0))
    run_single(runs, tmp_path, "continue")
    from_import, from_checkpoint = train_records(tmp_path / "from_import"), train_records(tmp_path / "from_checkpoint")
    assert [r["loss"] for r in from_import] == [r["loss"] for r in from_checkpoint] and len(from_import) == 2
    assert [r["loss"] for r in train_records(tmp_path / "from_hf_dir")] == [r["loss"] for r in from_import]
    first = train_records(tmp_path / "first")
    assert from_import[0]["loss"] < first[0]["loss"]  # it did continue from the trained weights


def test_import_bloom_saved_without_prefix(tmp_path):
    """bigscience's published Bloom files were saved from BloomModel: no "transformer." in the names."""
    from safetensors.numpy import load_file, save_file

    path, _ = random_checkpoint(tmp_path, ARCHITECTURES["bloom-tiny"])
    export_hf(path, str(tmp_path / "hf"))
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file({k[len("transformer."):]: v for k, v in state.items()}, str(tmp_path / "hf" / "model.safetensors"))
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "back"))
    back = paddle.load(str(tmp_path / "back" / "model_state.pdparams"), return_numpy=True)
    assert all(np.array_equal(back[name], value) for name, value in ckpt.merge_checkpoint(path).items())


@pytest.mark.parametrize("change, refused", [
    (dict(num_key_value_heads=2), "grouped"),                      # GPT-2 has one k/v head per q head
    (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),  # GPT-2's head is the embedding
    (dict(position_embedding="rope"), "position_embedding='rope'"),  # GPT-2 has learned positions only
    (dict(position_embedding="alibi"), "position_embedding='alibi'"),
])
def test_export_refuses_what_gpt2_cannot_express(change, refused):
    """A GPT-3 that GPT-2's layout cannot hold is refused before anything is written, naming what."""
    from llm_pretrain.checkpoint.hf_export import check_exportable

    config = ARCHITECTURES["gpt3-tiny"].replace(**change)
    with pytest.raises(UsageError, match="GPT2LMHeadModel cannot express") as refused_error:
        check_exportable(config)
    assert refused in str(refused_error.value)
    assert check_exportable(ARCHITECTURES["gpt3-tiny"]).class_name == "GPT2LMHeadModel"


@pytest.mark.parametrize("preset, change, refused", [
    ("mixtral-tiny", dict(norm_topk_prob=False), "MixtralForCausalLM cannot express a shared expert or unnormalized"),
    ("mixtral-tiny", dict(shared_expert_intermediate_size=64), "MixtralForCausalLM cannot express a shared expert"),
    ("mixtral-tiny", dict(moe_intermediate_size=32), "MixtralForCausalLM cannot express moe_intermediate_size"),
    ("mixtral-tiny", dict(tie_word_embeddings=True), "MixtralForCausalLM cannot express tie_word_embeddings=True"),
    ("qwen2-moe-tiny", dict(shared_expert_intermediate_size=0), "Qwen2MoeForCausalLM cannot express no shared expert"),
    ("qwen2-moe-tiny", dict(qkv_bias=False), "Qwen2MoeForCausalLM cannot express qkv_bias=False"),
])
def test_export_refuses_what_the_moe_classes_cannot_express(preset, change, refused):
    """Mixtral's class has no shared expert and always renormalizes its top-k weights; Qwen2-MoE's
    always has a shared expert: a model the class would compute differently is refused, naming what."""
    from llm_pretrain.checkpoint.hf_export import check_exportable

    with pytest.raises(UsageError, match=refused):
        check_exportable(ARCHITECTURES[preset].replace(**change))
    assert check_exportable(ARCHITECTURES[preset]).class_name == refused.split()[0]


def test_moe_refusal_is_one_line_exit_2(tmp_path, capsys):
    path, _ = random_checkpoint(tmp_path, ARCHITECTURES["qwen2-moe-tiny"].replace(shared_expert_intermediate_size=0))
    assert "Qwen2MoeForCausalLM cannot express no shared expert" in _error(capsys, [path, str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_last_save_in_hf_is_refused_before_any_work(embedded_corpus, tmp_path):
    """last_save_in_hf with save_steps 0 (no final checkpoint to export) and with a family without a
    Hugging Face class: one line, exit 2, from the preflight."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.layout import check_layout_and_model
    from llm_pretrain.run.preflight import check_startup

    base = ["configs/qwen/pretrain-qwen_tiny-dp.json", "--output_dir", str(tmp_path / "out"), "--last_save_in_hf", "true",
            "--tokenizer_name_or_path", embedded_corpus["tokenizer"], "--input_dir", embedded_corpus["input_dir"]]
    with pytest.raises(UsageError, match="last_save_in_hf"):
        parse_arguments(base + ["--save_steps", "0"])
    args, _ = parse_arguments(base + ["--save_steps", "5"])
    layout, config, _, _ = check_layout_and_model(args, 1, "cpu")
    with pytest.raises(UsageError, match="family 'qwen' has no Hugging Face class"):
        check_startup(args, config, layout, "cpu")


def test_deepseek_v3_directory_without_its_mtp_layer_trains_without_mtp(embedded_corpus, tmp_path):
    """transformers' DeepseekV3ForCausalLM has no MTP module: a directory it writes holds no layer
    num_hidden_layers though 5.x writes num_nextn_predict_layers 1. Such a directory (our export without that
    layer) imports as the model without MTP, its weights the main model's, and the run says so in a note; with the
    layer (our export, as the published files) the MTP module is built."""
    from safetensors.numpy import load_file, save_file

    from llm_pretrain.parallel.layout import build_model_config
    from parity_utils import base_arguments, write_json
    from llm_pretrain.arguments import parse_arguments

    config = ARCHITECTURES["deepseek-v3-tiny"]
    path, _ = random_checkpoint(tmp_path, config)
    export_hf(path, str(tmp_path / "hf"))
    assert resolve_model(str(tmp_path / "hf"))[0].num_nextn_predict_layers == 1
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    mtp = f"model.layers.{config.num_hidden_layers}."
    main_only = {name: value for name, value in tensors.items() if not name.startswith(mtp)}
    assert len(main_only) < len(tensors)
    save_file(main_only, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    imported, _ = resolve_model(str(tmp_path / "hf"))
    assert imported.architecture_dict() == config.replace(num_nextn_predict_layers=0).architecture_dict()
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "back"))
    back = paddle.load(resolve_model(str(tmp_path / "back"))[1], return_numpy=True)
    ours = ckpt.merge_checkpoint(path)
    assert sorted(back) == sorted(name for name in ours if not name.startswith("mtp."))
    assert all(np.array_equal(back[name], ours[name]) for name in back)
    args, _ = parse_arguments([str(write_json(tmp_path / "run.json", base_arguments(
        embedded_corpus, tmp_path, model_name_or_path=str(tmp_path / "hf"), num_hidden_layers=None)))])
    from llm_pretrain.parallel.layout import plan_layout

    built, _, notes = build_model_config(args, plan_layout(args, 1), "cpu")
    assert built.num_nextn_predict_layers == 0
    assert any(note.startswith("num_nextn_predict_layers: 1 in ") and "no MTP layer" in note for note in notes), notes
