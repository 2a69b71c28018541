"""The layout-free checkpoint format (llm_pretrain/checkpoint/dist_checkpoint.py) in one process: where a rank's
slices sit in the global tensors, old-format checkpoints, and bad input (one line, exit code 2).
Resuming under other layouts is tests/test_resume_any_layout.py."""

from __future__ import annotations

import json
import math
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from llm_pretrain.checkpoint import dist_checkpoint as dc
from llm_pretrain.errors import UsageError
from models.weights import local_slice
from parity_utils import argv, assert_same_training, base_arguments, run_single, write_json
from test_training import run_cli


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5)])
def test_flat_boxes_cover_a_flat_range_exactly(shape):
    size = math.prod(shape)
    for start, stop in [(0, size), (1, size - 1), (3, 4), (size // 3, 2 * size // 3), (0, 1), (size - 1, size)]:
        covered = np.zeros(shape, dtype=int)
        for offsets, box in dc.flat_boxes(shape, start, stop):
            covered[tuple(slice(o, o + n) for o, n in zip(offsets, box))] += 1
        expected = np.zeros(size, dtype=int)
        expected[start:stop] = 1
        assert np.array_equal(covered.reshape(-1), expected), (shape, start, stop)
        assert len(dc.flat_boxes(shape, start, stop)) <= 2 * len(shape) - 1


def test_stage3_pieces_read_back_paddles_padded_slices():
    """Rank r of a stage-3 group holds [r*L, (r+1)*L) of the flattened parameter, padded at the end."""
    full = np.arange(7 * 9, dtype=np.float32).reshape(7, 9)
    length = math.ceil(full.size / 3)  # 3 ranks, padding on the last
    for rank in range(3):
        storage = np.zeros(length, np.float32)
        flat = full.reshape(-1)[rank * length:(rank + 1) * length]
        storage[:flat.size] = flat
        rebuilt = np.zeros(length, np.float32)
        for piece in dc.stage3_pieces(full.shape, rank, length):
            box = full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))]
            assert np.array_equal(piece.take(storage), box)
            piece.put(rebuilt, box)
        assert np.array_equal(rebuilt, storage)


def test_tensor_parallel_pieces_of_fused_projection():
    """A fused q|k|v weight: each part is split on its own, so a rank's local weight is 3 boxes."""
    full = np.arange(4 * 24, dtype=np.float32).reshape(4, 24)
    tags = SimpleNamespace(tp_split_axis=1, tp_split_parts=(12, 6, 6), shape=[4, 12])
    for rank in range(2):
        local = local_slice(full, tags, rank, 2)
        pieces = dc.tensor_parallel_pieces(tags, rank, 2)
        assert len(pieces) == 3
        for piece in pieces:
            assert np.array_equal(piece.take(local), full[tuple(slice(o, o + n) for o, n in
                                                                zip(piece.offsets, piece.shape))])


def test_check_resumable_names_what_differs(tmp_path):
    architecture = {"family": "llama", "vocab_size": 512, "num_hidden_layers": 2, "hidden_dropout_prob": 0.0}
    layout = {"world_size": 1, "tensor_parallel_degree": 1}
    state = {"model_config": dict(architecture), "args": {"max_seq_length": 32}, "layout": layout}
    (tmp_path / dc.INDEX_FILE).write_text("{}")
    dc.check_resumable(str(tmp_path), state, {**architecture, "hidden_dropout_prob": 0.1}, 32,
                       {**layout, "world_size": 2})  # dropout and layout may change
    with pytest.raises(UsageError, match=r"vocab_size 512 in the checkpoint, 1024 now; max_seq_length 32 in the "
                                         r"checkpoint, 64 now"):
        dc.check_resumable(str(tmp_path), state, {**architecture, "vocab_size": 1024}, 64, layout)
    os.remove(tmp_path / dc.INDEX_FILE)  # the per-layout format of earlier versions
    dc.check_resumable(str(tmp_path), state, architecture, 32, layout)
    with pytest.raises(UsageError, match="per-layout format .* resume it under that layout until its next save"):
        dc.check_resumable(str(tmp_path), state, architecture, 32, {**layout, "world_size": 2})


def _to_legacy_format(checkpoint) -> None:
    """Rewrite a single-process checkpoint in the per-layout format written before dist_checkpoint."""
    import paddle

    from llm_pretrain.checkpoint import checkpointer as ckpt

    reader = dc.CheckpointReader(str(checkpoint))
    weights = {name: paddle.to_tensor(reader.read_full(name)) for name in reader.parameter_names()}
    weights[ckpt.SPLIT_KEY] = {name: [None, None, False] for name in reader.parameter_names()}
    optimizer = {f"{name}_{state}": paddle.to_tensor(reader.read_full(f"{name}/{state}"))
                 for name in reader.parameter_names() for state in reader.states_of(name)}
    optimizer["LR_Scheduler"] = reader.index["lr_scheduler"]
    paddle.save(weights, str(checkpoint / "model_state.tp00_pp00.pdparams"))
    paddle.save(optimizer, str(checkpoint / "optimizer.tp00_pp00.pdopt"))
    # The RNG states as the old code pickled them (rng_state.rank*.pkl, before the JSON files)
    rng_json = checkpoint / ckpt.rng_file(ckpt.Layout())
    with open(checkpoint / ckpt.legacy_rng_file(ckpt.Layout()), "wb") as f:
        pickle.dump(ckpt.rng_states_from_json(json.loads(rng_json.read_text())), f)
    os.remove(rng_json)
    for name in os.listdir(checkpoint):
        if name.startswith("tensors."):
            os.remove(checkpoint / name)
    # Its manifest lists the files just replaced: drop it, as in a checkpoint written before manifests
    # (verify_checkpoint then checks trainer_state.json only).
    os.remove(checkpoint / ckpt.MANIFEST)


def test_old_format_resumes_and_bad_checkpoints_are_one_line_errors(embedded_corpus, tmp_path):
    args_file = write_json(tmp_path / "small.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, max_steps=4, save_steps=4))
    straight, legacy, broken = tmp_path / "straight", tmp_path / "legacy", tmp_path / "broken"
    run_single([argv(args_file, straight), argv(args_file, legacy, exit_interval=2),
                argv(args_file, broken, exit_interval=2)], tmp_path, "first")

    # A checkpoint written before this format resumes under its own layout, exactly.
    _to_legacy_format(legacy / "checkpoint-2")
    run_single([argv(args_file, legacy)], tmp_path, "legacy")
    assert_same_training(straight, legacy, step=4, tolerance=0.0)

    # Another model: one line naming what differs, before any training.
    result = run_cli(args_file, "--output_dir", broken, "--num_hidden_layers", "3")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("error: checkpoint") and "num_hidden_layers 2 in the checkpoint, 3 now" \
        in result.stderr

    # A missing slice names the tensor and the file it should be in.
    index_path = broken / "checkpoint-2" / dc.INDEX_FILE
    index = json.loads(index_path.read_text())
    index["tensors"]["layers.1.mlp.up_proj.weight/moment2_0"]["slices"][0]["file"] = "tensors.rank00007.safetensors"
    index_path.write_text(json.dumps(index))
    # (The manifest would refuse the edited index by its size first: the reader's own check is
    # what a checkpoint without a manifest, or one damaged before its manifest was written, meets.)
    os.remove(broken / "checkpoint-2" / "manifest.json")
    result = run_cli(args_file, "--output_dir", broken)
    lines = result.stderr.splitlines()  # (before it, the warning that exit_interval changed)
    assert result.returncode == 2 and [line for line in lines if line.startswith("error:")] == lines[-1:], \
        result.stderr[-2000:]
    assert "layers.1.mlp.up_proj.weight/moment2_0" in result.stderr and "tensors.rank00007.safetensors" \
        in result.stderr


def test_bfloat16_weights_load_into_a_float32_model(tmp_path):
    """AMP O2 keeps bf16 weights (numpy has no bfloat16: stored as raw bits, dtype in the index);
    a float32 run (e.g. one process on CPU, or export) reads them back as the same values."""
    import paddle

    from llm_pretrain.parallel.distributed import Layout
    from models.registry import make_config
    from models.decoder import CausalLM

    config = make_config("llama", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32)
    paddle.seed(3)
    half = CausalLM(config)
    half.to(dtype="bfloat16")
    optimizer = paddle.optimizer.AdamW(parameters=half.parameters())
    dc.save_state(str(tmp_path), half, optimizer, Layout())
    dc.finish_save(str(tmp_path), 1, {})
    index = json.loads((tmp_path / dc.INDEX_FILE).read_text())
    assert {entry["dtype"] for entry in index["tensors"].values()} == {"bfloat16"}

    paddle.seed(4)
    full = CausalLM(config)
    dc.load_state(str(tmp_path), full, paddle.optimizer.AdamW(parameters=full.parameters()), Layout())
    merged = dc.read_full_weights(str(tmp_path))
    for (name, a), (_, b) in zip(half.canonical_named_parameters(), full.canonical_named_parameters()):
        expected = a.astype("float32").numpy()
        assert b.dtype == paddle.float32 and np.array_equal(b.numpy(), expected), name
        assert np.array_equal(merged[name], expected), name
