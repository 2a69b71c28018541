"""Weight interchange with PaddleNLP: export (ours -> PaddleNLP loads it) and import (PaddleNLP -> we train from it).

The tiny models are those of the parity test (tests/test_reference_parity.py). Export is
checked from our own random weights -- given as (config, full weights), as a checkpoint
directory written by llm_pretrain.checkpoint.checkpointer (one shard, and two tensor-parallel shards
written by hand), and as an imported model directory -- by loading the result with
paddlenlp's AutoModelForCausalLM and comparing logits. Import is checked by loading the
converted directory through models.registry.resolve_model, as the trainer does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from llm_pretrain.checkpoint import checkpointer as ckpt
from llm_pretrain.parallel.layout import Layout
from llm_pretrain.errors import UsageError
from models.decoder import CausalLM
from llm_pretrain.checkpoint.interchange import export_to_paddlenlp, import_from_paddlenlp
from models.paddlenlp_interop import paddlenlp_config
from models.registry import config_from_dict, resolve_model
from models.weights import load_full_weights, local_slice
from models.families import FAMILIES
from test_reference_parity import (
    CASES, RECORD_CASES, TOLERANCE, build_ours, build_paddlenlp_model, inputs, load_reference, our_outputs,
    paddlenlp_outputs, randomize, reference_config_json, reference_state, save_reference,
)

paddlenlp_transformers = pytest.importorskip("paddlenlp.transformers")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One model per family, from its record: (parity case whose config we use, changes to our config). The families
# PaddleNLP 2.8.1 has no class for (Qwen3) have none: PaddleFormers judges them (scripts/verify_paddleformers.py).
FAMILY_CASES = {name: family.export_case for name, family in FAMILIES.items() if family.export_case}


def our_random_model(config, seed=5):
    paddle.seed(seed)
    model = CausalLM(config)
    randomize(model, seed)
    model.eval()
    return model


def full_state(model) -> dict:
    return {name: param.numpy() for name, param in model.canonical_named_parameters()}


def load_with_paddlenlp(directory):
    model = paddlenlp_transformers.AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    return model


def assert_same_outputs(ours, reference, seed=7):
    input_ids, labels = inputs(seed)
    logits, loss = our_outputs(ours, input_ids, labels)
    ref_logits, ref_loss = paddlenlp_outputs(reference, input_ids, labels)
    assert np.abs(ref_logits).std() > 0.5
    assert np.abs(logits - ref_logits).max() < TOLERANCE and abs(loss - ref_loss) < TOLERANCE


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_export_then_paddlenlp_loads_same_model(family, tmp_path):
    case, changes = FAMILY_CASES[family]
    config = CASES[case][3].replace(**changes)
    ours = our_random_model(config)
    result = export_to_paddlenlp(full_state(ours), str(tmp_path), config=config)
    written = json.loads((tmp_path / "config.json").read_text())
    expected_class = FAMILIES[family].paddlenlp.class_name
    assert written == result["config"] and written["architectures"] == [expected_class]
    reference = load_reference(case, str(tmp_path))
    if not RECORD_CASES[case].qkv_bias:  # PaddleNLP 2.8.1 loads it with its own class
        assert type(reference).__name__ == expected_class
    assert_same_outputs(ours, reference)


def test_export_from_checkpoint_directory(tmp_path):
    """A checkpoint written by llm_pretrain.checkpoint.checkpointer.save_checkpoint, read back with its tokenizer."""
    config = CASES["qwen"][3]
    model = our_random_model(config)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.model").write_bytes(b"not a real model")
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    trainer_state = {"global_step": 3, "consumed_samples": 24, "layout": {}, "model_config": config.architecture_dict(),
                     "args": {"model_name_or_path": "qwen-tiny", "tokenizer_name_or_path": str(tokenizer_dir)}}
    path = ckpt.save_checkpoint(str(tmp_path / "output"), 3, model, optimizer, trainer_state, Layout(), None)
    out = tmp_path / "exported"
    export_to_paddlenlp(path, str(out))
    assert (out / "tokenizer.model").read_bytes() == b"not a real model"
    assert_same_outputs(model, load_with_paddlenlp(str(out)))


def test_export_from_tensor_parallel_shards(tmp_path):
    """Two tensor-parallel shards with fused q|k|v and gate|up (the per-part slicing of models.weights)."""
    config = CASES["llama_fused"][3]
    model = our_random_model(config)
    path = tmp_path / "checkpoint-1"
    path.mkdir()
    named = model.canonical_named_parameters()
    split = {name: [param.tp_split_axis, param.tp_split_parts, False] for name, param in named}
    for rank in range(2):
        shard = {name: paddle.to_tensor(local_slice(param.numpy(), param, rank, 2)) for name, param in named}
        shard[ckpt.SPLIT_KEY] = split
        paddle.save(shard, str(path / f"model_state.tp{rank:02d}_pp00.pdparams"))
    (path / ckpt.TRAINER_STATE).write_text(json.dumps({"model_config": config.architecture_dict(), "args": {}}))
    out = tmp_path / "exported"
    export_to_paddlenlp(str(path), str(out))
    assert_same_outputs(model, load_with_paddlenlp(str(out)))


def test_norm_head_is_exported_normalized_and_comes_back(tmp_path):
    config = CASES["baichuan13b_alibi"][3].replace(norm_head=True)
    ours = our_random_model(config)
    export_to_paddlenlp(full_state(ours), str(tmp_path / "pd"), config=config)
    state = paddle.load(str(tmp_path / "pd" / "model_state.pdparams"))
    assert np.allclose(np.linalg.norm(state["lm_head.weight"].numpy(), axis=0), 1.0, atol=1e-5)
    import_from_paddlenlp(str(tmp_path / "pd"), str(tmp_path / "back"))
    back, _ = resolve_model(str(tmp_path / "back"))
    assert back.architecture_dict() == config.architecture_dict()


def test_export_refuses_what_paddlenlp_cannot_express(tmp_path):
    gqa = r"cannot express grouped-query attention \(num_key_value_heads 2 != num_attention_heads \d+\)"
    bad = {  # each refused for its own reason
        "qwen with GQA": (CASES["qwen"][3].replace(num_key_value_heads=2), "QWenForCausalLM " + gqa),
        "gpt3 with GQA": (CASES["gpt3"][3].replace(num_key_value_heads=2), "GPTForCausalLM " + gqa),
        "bloom with GQA": (CASES["bloom"][3].replace(num_key_value_heads=2), "BloomForCausalLM " + gqa),
        "bloom with a 3h MLP": (CASES["bloom"][3].replace(intermediate_size=288),
                                "BloomForCausalLM cannot express an MLP of intermediate_size 288"),
        "gpt3 with exact GELU": (CASES["gpt3"][3].replace(hidden_act="gelu"),
                                 "GPTForCausalLM cannot express hidden_act='gelu'"),
    }
    for what, (config, reason) in bad.items():
        state = full_state(our_random_model(config))
        with pytest.raises(UsageError, match="PaddleNLP's " + reason):
            export_to_paddlenlp(state, str(tmp_path / "x"), config=config)
        assert not (tmp_path / "x").exists(), what


# ----------------------------------------------------------------------------- import
@pytest.mark.parametrize("case", sorted(CASES))
def test_import_round_trip(case, tmp_path):
    """save_pretrained -> import -> our model computes PaddleNLP's logits; export gives back the same tensors."""
    reference, _, expected_config = build_paddlenlp_model(case, seed=11)
    save_reference(case, reference, str(tmp_path / "pd"))
    result = import_from_paddlenlp(str(tmp_path / "pd"), str(tmp_path / "ours"))
    config, weights_file = resolve_model(str(tmp_path / "ours"))
    assert result["config"] == config.architecture_dict() == expected_config.architecture_dict()
    assert weights_file == str(tmp_path / "ours" / "model_state.pdparams")
    ours = build_ours(config, paddle.load(weights_file))
    assert_same_outputs(ours, reference)

    if config.rope_scaling:  # PaddleNLP 2.8.1's LLaMA has no Llama 3.1 scaling: export refuses it
        with pytest.raises(UsageError, match="rope_scaling"):
            export_to_paddlenlp(str(tmp_path / "ours"), str(tmp_path / "again"))
        return
    export_to_paddlenlp(str(tmp_path / "ours"), str(tmp_path / "again"))
    assert_same_outputs(ours, load_reference(case, str(tmp_path / "again")))
    raw = json.loads((tmp_path / "pd" / "config.json").read_text())
    if not (raw.get("fuse_attention_qkv") or raw.get("fuse_attention_ffn")):  # export writes the unfused layout
        again = paddle.load(str(tmp_path / "again" / "model_state.pdparams"))
        assert sorted(again) == sorted(n for n in reference_state(case, reference) if n != "lm_head.decoder_weight")
        for name, value in reference_state(case, reference).items():
            if name != "lm_head.decoder_weight":  # Bloom's tied head, not saved by PaddleNLP either
                assert np.array_equal(again[name].numpy(), value.numpy()), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_paddlenlp_config_reads_as_our_config(case):
    _, config_name, kwargs, expected = CASES[case]
    raw = getattr(paddlenlp_transformers, config_name)(**kwargs).to_dict()
    raw = reference_config_json(case, raw)
    assert config_from_dict(raw, "test").architecture_dict() == expected.architecture_dict()
    # and our export config describes the same architecture
    exported = paddlenlp_config(expected.replace(fuse_attention_qkv=False, fuse_attention_ffn=False))
    assert config_from_dict(exported, "test").architecture_dict() == expected.replace(
        fuse_attention_qkv=False, fuse_attention_ffn=False).architecture_dict()


def test_import_hugging_face_baichuan_w_pack(tmp_path):
    """HF Baichuan-13B layout: W_pack = [q; k; v] and every linear in PyTorch's [out, in], from safetensors."""
    from safetensors.numpy import save_file

    reference, _, config = build_paddlenlp_model("baichuan13b_alibi", seed=13)
    pd = {k: v.numpy() for k, v in reference.state_dict().items()}
    hf = {"model.embed_tokens.weight": pd["llama.embed_tokens.weight"], "model.norm.weight": pd["llama.norm.weight"],
          "lm_head.weight": pd["lm_head.weight"].T}
    for i in range(config.num_hidden_layers):
        p, q = f"llama.layers.{i}.", f"model.layers.{i}."
        hf[q + "self_attn.W_pack.weight"] = np.concatenate(
            [pd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], axis=1).T
        for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            hf[q + name + ".weight"] = pd[p + name + ".weight"].T
        for name in ("input_layernorm", "post_attention_layernorm"):
            hf[q + name + ".weight"] = pd[p + name + ".weight"]
    (tmp_path / "hf").mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in hf.items()}, str(tmp_path / "hf" / "model.safetensors"))
    hf_config = {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan", "vocab_size": config.vocab_size,
                 "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                 "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
                 "model_max_length": 64, "rms_norm_eps": 1e-6}  # no max_position_embeddings: the 13B (ALiBi) model
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "ours"))
    imported, weights_file = resolve_model(str(tmp_path / "ours"))
    assert imported.position_embedding == "alibi" and imported.family == "baichuan" and not imported.norm_head
    assert_same_outputs(build_ours(imported, paddle.load(weights_file)), reference)


def test_import_baichuan_config_with_paddlenlp_llama_names(tmp_path):
    """model_type "baichuan" over weights in PaddleNLP's LLaMA names: PaddleNLP's own Baichuan conversion."""
    reference, _, config = build_paddlenlp_model("baichuan13b_alibi", seed=23)
    reference.save_pretrained(str(tmp_path / "pd"))
    raw = json.loads((tmp_path / "pd" / "config.json").read_text())
    (tmp_path / "pd" / "config.json").write_text(json.dumps({**raw, "model_type": "baichuan"}))
    import_from_paddlenlp(str(tmp_path / "pd"), str(tmp_path / "ours"))
    imported, weights_file = resolve_model(str(tmp_path / "ours"))
    assert imported.architecture_dict() == config.architecture_dict()
    assert_same_outputs(build_ours(imported, paddle.load(weights_file)), reference)


def test_imported_directory_continues_training(tmp_path):
    """The trainer's model setup takes the imported weights (continue_training) instead of a random init."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.layout import plan_layout
    from llm_pretrain.parallel.layout import build_model_config

    reference, _, _ = build_paddlenlp_model("qwen", seed=17)
    reference.save_pretrained(str(tmp_path / "pd"))
    import_from_paddlenlp(str(tmp_path / "pd"), str(tmp_path / "ours"))
    args, _ = parse_arguments(["--model_name_or_path", str(tmp_path / "ours"), "--continue_training", "true",
                               "--input_dir", str(tmp_path), "--max_steps", "1", "--max_seq_length", "16"])
    config, weights_file, notes = build_model_config(args, plan_layout(args, 1), "cpu")
    assert weights_file == str(tmp_path / "ours" / "model_state.pdparams") and not notes
    model = CausalLM(config)
    load_full_weights(model, config, paddle.load(weights_file), weights_file)
    model.eval()
    assert_same_outputs(model, reference)


def test_paddlenlp_directory_with_weights_must_be_imported_first(tmp_path):
    reference, _, _ = build_paddlenlp_model("llama_gqa")
    reference.save_pretrained(str(tmp_path))
    with pytest.raises(UsageError, match="import_paddlenlp.py"):
        resolve_model(str(tmp_path))
    os.remove(tmp_path / "model_state.pdparams")  # the architecture alone is fine
    config, weights = resolve_model(str(tmp_path))
    assert weights is None and config.architecture_dict() == CASES["llama_gqa"][3].architecture_dict()


def test_import_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 256,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "intermediate_size": 176}))
    with pytest.raises(UsageError, match="no weights"):
        import_from_paddlenlp(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(UsageError, match="model_type"):
        import_from_paddlenlp(str(tmp_path), str(tmp_path / "out"))
    reference, _, _ = build_paddlenlp_model("gpt3")
    reference.save_pretrained(str(tmp_path / "pd"))
    state = paddle.load(str(tmp_path / "pd" / "model_state.pdparams"))
    del state["gpt.decoder.layers.1.linear2.bias"]
    paddle.save(state, str(tmp_path / "pd" / "model_state.pdparams"))
    with pytest.raises(UsageError, match="linear2.bias"):
        import_from_paddlenlp(str(tmp_path / "pd"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- scripts
def _run(script, *args):
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", script), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_scripts_round_trip(tmp_path):
    reference, _, _ = build_paddlenlp_model("bloom", seed=19)
    reference.save_pretrained(str(tmp_path / "pd"))
    done = _run("import_paddlenlp.py", tmp_path / "pd", tmp_path / "ours")
    assert done.returncode == 0, done.stderr
    assert "bloom" in done.stdout and "continue_training" in done.stdout
    done = _run("export_paddlenlp.py", tmp_path / "ours", tmp_path / "again")
    assert done.returncode == 0, done.stderr
    assert "BloomForCausalLM" in done.stdout
    assert_same_outputs(build_ours(*_load_ours(tmp_path / "ours")), load_with_paddlenlp(str(tmp_path / "again")))
    # an existing model is not overwritten without --overwrite
    done = _run("export_paddlenlp.py", tmp_path / "ours", tmp_path / "again")
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "--overwrite" in done.stderr
    assert _run("export_paddlenlp.py", tmp_path / "ours", tmp_path / "again", "--overwrite").returncode == 0


def _load_ours(directory):
    config, weights_file = resolve_model(str(directory))
    return config, paddle.load(weights_file)


@pytest.mark.parametrize("script,args,message", [
    ("export_paddlenlp.py", ["/nonexistent/checkpoint-5", "out"], "not a directory"),
    ("export_paddlenlp.py", [REPO_ROOT, "out"], "neither a checkpoint"),
    ("import_paddlenlp.py", [REPO_ROOT, "out"], "no config.json"),
    ("import_paddlenlp.py", [], "required"),
])
def test_scripts_bad_input_is_one_line_exit_2(script, args, message, tmp_path):
    done = _run(script, *[a if a != "out" else tmp_path / "out" for a in args])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


HF_CLASSES = {"llama.": "LlamaForCausalLM", "qwen2.": "Qwen2ForCausalLM", "mixtral.": "MixtralForCausalLM",
              "qwen2_moe.": "Qwen2MoeForCausalLM"}


@pytest.mark.parametrize("case", ["qwen2", "llama3", "mixtral", "qwen2_moe"])
def test_import_hugging_face_safetensors(case, tmp_path):
    """Hugging Face's Qwen2 / Llama 3 / Mixtral / Qwen2-MoE checkpoints (model.safetensors: "model." names,
    PyTorch's [out, in] matrices (routers and the shared expert's gate too), no lm_head when tied) import
    to the model the reference computes."""
    from safetensors.numpy import save_file

    reference, raw, config = build_paddlenlp_model(case, seed=29)
    prefix = next(iter(reference_state(case, reference))).split(".")[0] + "."
    hf = {}
    for name, value in reference_state(case, reference).items():
        value = value.numpy()
        hf_name = "lm_head.weight" if name == "lm_head.weight" else "model." + name[len(prefix):]
        hf[hf_name] = np.ascontiguousarray(value.T if value.ndim == 2 and "embed_tokens" not in name else value)
    (tmp_path / "hf").mkdir()
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"))
    hf_config = {**raw, "architectures": [HF_CLASSES[prefix]],
                 "tie_word_embeddings": config.tie_word_embeddings}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "ours"))
    imported, weights_file = resolve_model(str(tmp_path / "ours"))
    assert imported.architecture_dict() == config.architecture_dict()
    assert_same_outputs(build_ours(imported, paddle.load(weights_file)), reference)


@pytest.mark.parametrize("prefix", ["transformer.", ""])
def test_import_hugging_face_gpt2(prefix, tmp_path):
    """Hugging Face GPT-2 (model_type "gpt2"): Conv1D [in, out] matrices, c_attn = [q | k | v], tied head;
    the original checkpoints have no "transformer." prefix. Built by hand from PaddleNLP's GPT weights."""
    from safetensors.numpy import save_file

    reference, _, config = build_paddlenlp_model("gpt3", seed=31)
    pd = {k: v.numpy() for k, v in reference.state_dict().items()}
    hf = {f"{prefix}wte.weight": pd["gpt.embeddings.word_embeddings.weight"],
          f"{prefix}wpe.weight": pd["gpt.embeddings.position_embeddings.weight"]}
    for i in range(config.num_hidden_layers):
        p, q = f"gpt.decoder.layers.{i}.", f"{prefix}h.{i}."
        for leaf in ("weight", "bias"):
            hf[q + "attn.c_attn." + leaf] = np.concatenate([pd[p + f"self_attn.{n}_proj.{leaf}"] for n in "qkv"], -1)
            for theirs, ours in (("attn.c_proj", "self_attn.out_proj"), ("ln_1", "norm1"), ("ln_2", "norm2"),
                                 ("mlp.c_fc", "linear1"), ("mlp.c_proj", "linear2")):
                hf[q + theirs + "." + leaf] = pd[p + ours + "." + leaf]
    hf[f"{prefix}ln_f.weight"], hf[f"{prefix}ln_f.bias"] = pd["gpt.decoder.norm.weight"], pd["gpt.decoder.norm.bias"]
    (tmp_path / "hf").mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in hf.items()}, str(tmp_path / "hf" / "model.safetensors"))
    hf_config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
                 "n_embd": config.hidden_size, "n_layer": config.num_hidden_layers,
                 "n_head": config.num_attention_heads, "n_positions": config.max_position_embeddings, "n_inner": None,
                 "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0,
                 "attn_pdrop": 0.0, "embd_pdrop": 0.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    import_from_paddlenlp(str(tmp_path / "hf"), str(tmp_path / "ours"))
    imported, weights_file = resolve_model(str(tmp_path / "ours"))
    assert imported.architecture_dict() == config.architecture_dict()
    assert_same_outputs(build_ours(imported, paddle.load(weights_file)), reference)
