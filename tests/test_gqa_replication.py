"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks (kv heads replicated).

With TWO kv heads of 8 q heads under tp4 + sequence parallelism (one 4-process launch through the
mechanism probes, tests/workers/mechanism_runs.py), ranks 0-1 must attend with kv head 0 and ranks
2-3 with kv head 1: each rank's attention is seen to take the v columns of the kv head its first q
head belongs to (rank r with q heads [a..b] uses kv head a // (8 / 2); found by comparing values),
and the run trains exactly like one process (loss, grad norm, final weights within 1e-5). With one
kv head (below) every rank's head is head 0, so only this case notices a rank keeping the wrong
head. The same launch trains Baichuan's tiny ALiBi preset (4 heads, one per rank) like one
process: each rank's bias takes its own head's slope.
The same LLaMA also trains under pp2 x tp4 + SP (8 processes, about 35 s on 2 cores) like one
process, each rank of both stages keeping its q heads' kv head.

A LLaMA with 4 query heads and ONE kv head trains under tp2 and tp2 + sequence parallelism,
and a Qwen of that shape (q/k/v biases) under tp2 -- in the session's 2-process tp2 launch
(tests/shared_launches.py) -- exactly like one process: per-step loss and grad norm, and the final
weights merged from the tp shards (and exported to PaddleNLP), within 1e-5. Each rank holds the k/v projections whole, keeps the kv
head its q heads share, and the partial k/v gradients are summed over the ranks. Layouts where
neither kv heads nor tp divides the other, and fused qkv with replicated kv, are one-line
UsageErrors (exit code 2).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_pretrain.parallel.layout import Layout, check_model_fits_layout
from llm_pretrain.errors import UsageError, exit_with_usage_error
from models.registry import make_config
from launch_utils import REPO_ROOT, launch
from parity_utils import (argv, assert_same_training, base_arguments, final_weights, run_record, run_single,
                          write_json)
from shared_launches import contribute

TINY_GQA1 = dict(family="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, intermediate_size=176, max_position_embeddings=1024)
# 8 q heads of 16 in groups of 4 per kv head; under tp4 each rank holds 2 q heads (half a group)
TINY_GQA2 = dict(TINY_GQA1, hidden_size=128, num_attention_heads=8, num_key_value_heads=2)
MECHANISM_WORKER = REPO_ROOT / "tests" / "workers" / "mechanism_runs.py"
# Every run trains 2 steps (parity.base_arguments' 5 cut, the suite's budget): the second step's loss and grad norm
# are taken on the weights the first update left, so a rank keeping the wrong kv head or a missing sum shows by then
STEPS = {"max_steps": 2, "save_steps": 2}
STEP = STEPS["max_steps"]


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


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 1, 2), (8, 2, 4), (8, 1, 8)])
def test_fused_qkv_with_replicated_kv_is_a_usage_error(heads, kv_heads, tp):
    """One fused q/k/v matrix split by columns cannot hold every kv head whole on each rank: refused."""
    with pytest.raises(UsageError, match=rf"fuse_attention_qkv: .*num_key_value_heads {kv_heads} "
                                         rf".*tensor_parallel_degree {tp}") as error:
        check_model_fits_layout(_config(heads, kv_heads, fuse_attention_qkv=True), Layout(tensor_parallel_degree=tp))
    assert "\n" not in str(error.value)
    check_model_fits_layout(_config(heads, tp, fuse_attention_qkv=True), Layout(tensor_parallel_degree=tp))


@pytest.fixture(scope="module")
def tp4_sp(embedded_corpus, tmp_path_factory):
    """One process, then ONE 4-process launch (tp4 + SP, through the mechanism probes): the LLaMA with
    2 kv heads of 8 q heads, and Baichuan's tiny preset (4 ALiBi heads, one per rank) on 2 layers.
    Returns (work dir, {rank: {run name: observations}})."""
    work = tmp_path_factory.mktemp("tp4")
    model_dir = write_json(work / "llama-tiny-gqa2" / "config.json", TINY_GQA2).parent
    files = {name: write_json(work / f"{name}.json", base_arguments(embedded_corpus, work, model_name_or_path=model,
                                                                    num_hidden_layers=2, **STEPS))
             for name, model in (("gqa2", str(model_dir)), ("alibi", "baichuan-tiny"))}
    run_single([argv(file, work / "single" / name) for name, file in files.items()], work, "single")
    spec = [{"name": name, "argv": argv(file, work / "tp4_sp" / name, tensor_parallel_degree=4, sequence_parallel=True)}
            for name, file in files.items()]
    runs_file = write_json(work / "tp4.runs.json", spec)
    ranks = launch(MECHANISM_WORKER, 4, [str(runs_file)], log_dir=work / "tp4.log", timeout=900).check().results()
    return work, ranks


def test_tp4_sp_with_two_kv_heads_trains_like_one_process_and_keeps_each_ranks_kv_head(tp4_sp):
    work, ranks = tp4_sp
    single, run = work / "single" / "gqa2", work / "tp4_sp" / "gqa2"
    group = TINY_GQA2["num_attention_heads"] // TINY_GQA2["num_key_value_heads"]
    for rank, observed in ranks.items():
        layers = observed["gqa2"]["kv_heads"]
        assert sorted(layers) == ["0", "1"], f"rank {rank}: replicated kv heads not seen: {layers}"
        for layer, seen in layers.items():
            first_q_head = seen["q_heads"][0]
            assert seen["q_heads"] == [2 * rank, 2 * rank + 1] and seen["tp_rank"] == rank, seen
            assert seen["kv_heads_used"] == [first_q_head // group], \
                f"rank {rank} layer {layer}: q heads {seen['q_heads']} attend with kv head(s) " \
                f"{seen['kv_heads_used']}, expected {first_q_head // group}"
    built = run_record(run)["built"]
    assert built["sequence_parallel"]["enabled"] and built["layout"]["tensor_parallel_degree"] == 4
    print(f"tp4_sp vs single process: {assert_same_training(single, run, step=STEP)}")
    _check_replicas_identical(run / f"checkpoint-{STEP}", kv_width=2 * 16)


def test_pp2_tp4_sp_with_two_kv_heads_trains_like_one_process(tp4_sp):
    """The pipeline builds each stage's decoder layers from the same Attention: under pp2 x tp4 the
    ranks of both stages keep their q heads' kv head, and the run equals one process."""
    work, _ = tp4_sp
    run = work / "pp2tp4_sp" / "gqa2"
    spec = [{"name": "gqa2", "argv": argv(work / "gqa2.json", run, pipeline_parallel_degree=2, tensor_parallel_degree=4,
                                          sequence_parallel=True)}]
    runs_file = write_json(work / "pp2tp4.runs.json", spec)
    ranks = launch(MECHANISM_WORKER, 8, [str(runs_file)], log_dir=work / "pp2tp4.log", timeout=900).check().results()
    group = TINY_GQA2["num_attention_heads"] // TINY_GQA2["num_key_value_heads"]
    layers_seen = set()
    for rank, observed in ranks.items():
        for layer, seen in observed["gqa2"]["kv_heads"].items():
            layers_seen.add(layer)
            tp_rank = seen["tp_rank"]
            assert seen["q_heads"] == [2 * tp_rank, 2 * tp_rank + 1], seen
            assert seen["kv_heads_used"] == [seen["q_heads"][0] // group], f"rank {rank} layer {layer}: {seen}"
    assert layers_seen == {"0", "1"}, layers_seen  # one decoder layer per stage, both seen
    assert run_record(run)["layout"]["pipeline_parallel_degree"] == 2
    print(f"pp2tp4_sp vs single process: {assert_same_training(work / 'single' / 'gqa2', run, step=STEP)}")


def test_tp4_sp_alibi_takes_each_ranks_slopes(tp4_sp):
    """One ALiBi head per rank: each rank's bias must use its own head's slope (models/decoder.py
    Attention: the slopes of the rank's heads), or the rank's attention differs from one process's."""
    work, ranks = tp4_sp
    print(f"alibi tp4_sp vs single process: {assert_same_training(work / 'single' / 'alibi', work / 'tp4_sp' / 'alibi', step=STEP)}")
    assert all(not observed["alibi"]["kv_heads"] for observed in ranks.values())  # 4 kv heads: split, not replicated


def gqa1_files(work, corpus) -> dict:
    """LLaMA and Qwen (biases on q/k/v, whose gradients are summed too) with 4 q heads and ONE kv head."""
    files = {}
    for family in ("llama", "qwen"):
        model_dir = write_json(work / f"{family}-tiny-gqa1" / "config.json", {**TINY_GQA1, "family": family}).parent
        files[family] = write_json(work / f"{family}.json", base_arguments(
            corpus, work, model_name_or_path=str(model_dir), num_hidden_layers=2, **STEPS))
    return files


def gqa1_tp2_runs(work, corpus) -> list[dict]:
    files, out = gqa1_files(work, corpus), work / "runs"
    return [{"name": "tp2", "argv": argv(files["llama"], out / "tp2", tensor_parallel_degree=2)},
            {"name": "tp2_sp", "argv": argv(files["llama"], out / "tp2_sp", tensor_parallel_degree=2,
                                            sequence_parallel=True)},
            {"name": "qwen_tp2", "argv": argv(files["qwen"], out / "qwen_tp2", tensor_parallel_degree=2)}]


# tp2 trains in the session's tp2 launch (tests/shared_launches.py), beside the parity and mechanism tests' tp2 runs.
contribute("tp2", 2, "gqa", gqa1_tp2_runs)


def test_tp2_with_one_kv_head_trains_like_one_process(embedded_corpus, shared_launches):
    work = shared_launches.work_dir("gqa")
    files = gqa1_files(work, embedded_corpus)
    out = work / "runs"
    single, tp2, tp2_sp, qwen_single, qwen_tp2 = (out / n for n in ("single", "tp2", "tp2_sp", "qwen", "qwen_tp2"))

    run_single([argv(files["llama"], single), argv(files["qwen"], qwen_single)], work, "single")
    shared_launches.results("tp2", "gqa")

    for reference, run in ((single, tp2), (single, tp2_sp), (qwen_single, qwen_tp2)):
        diffs = assert_same_training(reference, run, step=STEP)
        print(f"{run.name} vs single process: {diffs}")
        _check_replicas_identical(run / f"checkpoint-{STEP}")
    assert "layers.1.self_attn.k_proj.bias" in final_weights(qwen_tp2, STEP)
    weights = final_weights(tp2, STEP)
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (64, 16)  # one kv head of 16, whole
    assert weights["layers.0.self_attn.q_proj.weight"].shape == (64, 64)

    # The export to PaddleNLP sees the same full weights as the single process's.
    from llm_pretrain.checkpoint.interchange import export_to_paddlenlp

    exported = {}
    for run in (single, tp2):
        export_to_paddlenlp(str(run / f"checkpoint-{STEP}"), str(work / "export" / run.name))
        exported[run.name] = _load(work / "export" / run.name / "model_state.pdparams")
    assert json.loads((work / "export" / "tp2" / "config.json").read_text())["num_key_value_heads"] == 1
    assert sorted(exported["tp2"]) == sorted(exported["single"])
    for name, value in exported["single"].items():
        np.testing.assert_allclose(exported["tp2"][name], value, rtol=0, atol=1e-5, err_msg=name)


def _load(path):
    import paddle

    return paddle.load(str(path), return_numpy=True)


def _check_replicas_identical(checkpoint, kv_width=16):
    """The replicated k/v weights (every kv head, kv_width columns, whole on every tensor-parallel rank) are written
    once, whole, by one of the ranks (llm_pretrain/checkpoint/dist_checkpoint.py); assert_same_training has
    compared that copy with the single process's after STEP steps (summed gradients keep it equal)."""
    tensors = json.loads((checkpoint / "tensors.index.json").read_text())["tensors"]
    names = [n for n in tensors if (".k_proj." in n or ".v_proj." in n) and "/" not in n]
    assert names
    for name in names:
        assert tensors[name]["shape"][-1] == kv_width
        assert [s["shape"] for s in tensors[name]["slices"]] == [tensors[name]["shape"]], name
