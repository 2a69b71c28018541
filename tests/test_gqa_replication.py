"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks (kv heads replicated).

A LLaMA with 4 query heads and ONE kv head trains under tp2 and tp2 + sequence parallelism,
and a Qwen of that shape (q/k/v biases) under tp2 -- one 2-process launch -- exactly like one
process: per-step loss and grad norm, and the final weights merged from the tp shards (and
exported to PaddleNLP), within 1e-5. Each rank holds the k/v projections whole, keeps the kv
head its q heads share, and the partial k/v gradients are summed over the ranks. Layouts where
neither kv heads nor tp divides the other, and fused qkv with replicated kv, are one-line
UsageErrors (exit code 2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_pretrain.layout import Layout, check_model_fits_layout
from llm_pretrain.errors import UsageError, exit_with_usage_error
from models.registry import make_config
from parity_utils import argv, assert_same_training, base_arguments, final_weights, run_launch, run_single, write_json

TINY_GQA1 = dict(family="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, intermediate_size=176, max_position_embeddings=1024)


def _config(heads: int, kv_heads: int, **extra):
    # vocabulary and MLP width divisible by every tp below, so that only the heads can fail
    return make_config("llama", vocab_size=768, hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=192, **extra)


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 1, 2), (8, 2, 4), (8, 1, 8), (4, 2, 2), (4, 4, 2)])
def test_kv_heads_split_or_replicated_are_accepted(heads, kv_heads, tp):
    check_model_fits_layout(_config(heads, kv_heads), Layout(tensor_parallel_degree=tp))


@pytest.mark.parametrize("heads, kv_heads, tp", [(6, 3, 2), (12, 2, 3), (12, 4, 6)])
def test_kv_heads_and_tp_not_dividing_each_other_is_a_usage_error(heads, kv_heads, tp, capsys):
    with pytest.raises(UsageError) as error:
        check_model_fits_layout(_config(heads, kv_heads), Layout(tensor_parallel_degree=tp))
    message = str(error.value)
    assert "\n" not in message
    assert f"tensor_parallel_degree: {tp}" in message and f"num_key_value_heads {kv_heads}" in message
    with pytest.raises(SystemExit) as exit_info:  # what run_pretrain.py does with it
        exit_with_usage_error(error.value)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_fused_qkv_with_replicated_kv_is_a_usage_error():
    with pytest.raises(UsageError, match=r"fuse_attention_qkv: .*num_key_value_heads 1 .*tensor_parallel_degree 2"):
        check_model_fits_layout(_config(4, 1, fuse_attention_qkv=True), Layout(tensor_parallel_degree=2))
    check_model_fits_layout(_config(4, 2, fuse_attention_qkv=True), Layout(tensor_parallel_degree=2))


def test_tp2_with_one_kv_head_trains_like_one_process(embedded_corpus, tmp_path):
    files = {}
    for family in ("llama", "qwen"):  # Qwen: biases on q/k/v, whose gradients are summed too
        model_dir = write_json(tmp_path / f"{family}-tiny-gqa1" / "config.json", {**TINY_GQA1, "family": family}).parent
        files[family] = write_json(tmp_path / f"{family}.json", base_arguments(
            embedded_corpus, tmp_path, model_name_or_path=str(model_dir), num_hidden_layers=2))
    out = tmp_path / "runs"
    single, tp2, tp2_sp, qwen_single, qwen_tp2 = (out / n for n in ("single", "tp2", "tp2_sp", "qwen", "qwen_tp2"))

    run_single([argv(files["llama"], single), argv(files["qwen"], qwen_single)], tmp_path, "single")
    run_launch(2, [argv(files["llama"], tp2, tensor_parallel_degree=2),
                   argv(files["llama"], tp2_sp, tensor_parallel_degree=2, sequence_parallel=True),
                   argv(files["qwen"], qwen_tp2, tensor_parallel_degree=2)], tmp_path, "tp2")

    for reference, run in ((single, tp2), (single, tp2_sp), (qwen_single, qwen_tp2)):
        diffs = assert_same_training(reference, run)
        print(f"{run.name} vs single process: {diffs}")
        _check_replicas_identical(run / "checkpoint-5")
    assert "layers.1.self_attn.k_proj.bias" in final_weights(qwen_tp2)
    weights = final_weights(tp2)
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (64, 16)  # one kv head of 16, whole
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (64, 64)

    # The export to PaddleNLP sees the same full weights as the single process's.
    from llm_pretrain.interchange import export_to_paddlenlp

    exported = {}
    for run in (single, tp2):
        export_to_paddlenlp(str(run / "checkpoint-5"), str(tmp_path / "export" / run.name))
        exported[run.name] = _load(tmp_path / "export" / run.name / "model_state.pdparams")
    assert json.loads((tmp_path / "export" / "tp2" / "config.json").read_text())["num_key_value_heads"] == 1
    assert sorted(exported["tp2"]) == sorted(exported["single"])
    for name, value in exported["single"].items():
        np.testing.assert_allclose(exported["tp2"][name], value, rtol=0, atol=1e-5, err_msg=name)


def _load(path):
    import paddle

    return paddle.load(str(path), return_numpy=True)


def _check_replicas_identical(checkpoint):
    """The replicated k/v weights (one kv head of 16, whole on both tensor-parallel ranks) are written
    once, whole, by one of the ranks (llm_pretrain/dist_checkpoint.py); assert_same_training has
    compared that copy with the single process's after 5 steps (summed gradients keep it equal)."""
    tensors = json.loads((checkpoint / "tensors.index.json").read_text())["tensors"]
    names = [n for n in tensors if (".k_proj." in n or ".v_proj." in n) and "/" not in n]
    assert names
    for name in names:
        assert tensors[name]["shape"][-1] == 16
        assert [s["shape"] for s in tensors[name]["slices"]] == [tensors[name]["shape"]], name
