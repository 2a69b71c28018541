"""Loading files someone else wrote runs no code (issue 37, item 5).

Every pickle the toolkit reads (PaddleNLP .pdparams, checkpoints of the per-layout format, their
RNG files, the fp16 scaler) goes through models/weights.py `read_paddle_pickle`, which builds only
NumPy arrays, dtypes and plain containers; checkpoints store their RNG state as JSON.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import random
import subprocess
import sys

import numpy as np
import paddle
import pytest

from llm_pretrain.checkpoint import checkpointer as ckpt
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.distributed import Layout
from models.weights import read_paddle_pickle

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _same(expected, got, where="") -> None:
    """got (read_paddle_pickle) equals expected (paddle.load(return_numpy=True)), arrays bitwise."""
    if isinstance(expected, dict):
        assert set(expected) == set(got), where
        for key in expected:
            _same(expected[key], got[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(got) and len(expected) == len(got), where
        for a, b in zip(expected, got):
            _same(a, b, where)
    else:
        assert type(expected) is type(got), (where, type(expected), type(got))
        assert np.array_equal(expected, got), where
        if isinstance(expected, np.ndarray):
            assert expected.dtype == got.dtype, where


def _saved_by_paddle():
    """What real paddle.save files hold: a layer's state dict, AdamW's state with master weights and its
    LR scheduler, a GradScaler's state, an OrderedDict (PaddleNLP), numpy values, a DenseTensor in a list
    (paddle.save's (eval, ("data", ...)) form, paddle/framework/io.py reduce_DenseTensor)."""
    paddle.seed(3)
    layer = paddle.nn.Linear(3, 4)
    optimizer = paddle.optimizer.AdamW(learning_rate=paddle.optimizer.lr.CosineAnnealingDecay(0.1, 10),
                                       parameters=layer.parameters(), multi_precision=True)
    layer(paddle.ones([2, 3])).sum().backward()
    optimizer.step()
    dense = paddle.base.core.DenseTensor()
    dense.set(np.arange(4, dtype="float32"), paddle.CPUPlace())
    return {"state_dict": layer.state_dict(), "optimizer": optimizer.state_dict(),
            # GradScaler.state_dict()'s keys (paddle/amp/grad_scaler.py:598; on CPU the scaler is off and empty)
            "scaler": {"scale": np.array([1024.0], np.float32), "incr_ratio": 2.0, "decr_ratio": 0.5,
                       "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2, "incr_count": 7, "decr_count": 0,
                       "use_dynamic_loss_scaling": True},
            "ordered": collections.OrderedDict(w=paddle.to_tensor([1.0, 2.0], dtype="float16")),
            "numpy": {"scalar": np.float32(3.5), "ints": np.arange(5), "bf16": paddle.ones([2], dtype="bfloat16")},
            "dense_in_list": [dense]}


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("kind", ["state_dict", "optimizer", "scaler", "ordered", "numpy", "dense_in_list"])
def test_paddle_save_files_read_as_paddle_load_reads_them(kind, protocol, tmp_path):
    path = str(tmp_path / f"{kind}.pdparams")
    paddle.save(_saved_by_paddle()[kind], path, protocol=protocol)
    _same(paddle.load(path, return_numpy=True), read_paddle_pickle(path))


def test_big_parameters_saved_in_slices_are_joined(tmp_path):
    """paddle.save under pickle protocol 2/3 cuts arrays above 1 GiB into slices (io_utils._unpack_saved_dict);
    the same layout, made small, is joined back as paddle.load joins it."""
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    flat = full.flatten()
    saved = {"w@@.0": flat[:10], "w@@.1": flat[10:20], "w@@.2": flat[20:], "b": np.ones(2, np.float32),
             "UnpackBigParamInfor@@": {"w": {"OriginShape": (4, 6), "slices": ["w@@.0", "w@@.1", "w@@.2"]}}}
    path = tmp_path / "big.pdparams"
    path.write_bytes(pickle.dumps(saved, protocol=2))
    got = read_paddle_pickle(str(path))
    assert set(got) == {"w", "b"} and np.array_equal(got["w"], full)
    _same(paddle.load(str(path), return_numpy=True), got)


class _RunsCommand:
    """Unpickling this runs a shell command (what a hostile .pdparams would hold)."""

    def __init__(self, how, marker):
        self.how, self.marker = how, marker

    def __reduce__(self):
        if self.how == "os.system":
            return os.system, (f"touch {self.marker}",)
        if self.how == "subprocess":
            return subprocess.call, (["touch", self.marker],)
        if self.how == "eval":  # paddle.save's DenseTensor form, with another expression
            return eval, (f"__import__('os').system('touch {self.marker}')", {"data": 1})
        raise ValueError(self.how)


def _hostile(path, how, marker) -> None:
    weights = {"llama.embed_tokens.weight": paddle.zeros([2, 2]).numpy(), "payload": _RunsCommand(how, marker)}
    with open(path, "wb") as f:
        pickle.dump(weights, f, protocol=4)


@pytest.mark.parametrize("how", ["os.system", "subprocess", "eval"])
def test_a_pickle_that_would_run_a_command_is_refused_and_runs_nothing(how, tmp_path):
    marker, path = tmp_path / "MARKER", str(tmp_path / "model_state.pdparams")
    _hostile(path, how, str(marker))
    with pytest.raises(UsageError) as refused:
        read_paddle_pickle(path)
    message = str(refused.value)
    assert path in message and "refused" in message and "\n" not in message, message
    assert not marker.exists()


def test_object_arrays_are_refused(tmp_path):
    path = str(tmp_path / "objects.pdparams")
    with open(path, "wb") as f:
        pickle.dump({"w": np.array([{"a": 1}, None], dtype=object)}, f)
    with pytest.raises(UsageError, match="Python objects"):
        read_paddle_pickle(path)


def test_import_script_refuses_a_hostile_pdparams_in_one_line_exit_2(tmp_path):
    directory, marker = tmp_path / "paddlenlp", tmp_path / "MARKER"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=2, hidden_size=2, num_hidden_layers=1, num_attention_heads=1,
        intermediate_size=4)))
    _hostile(str(directory / "model_state.pdparams"), "os.system", str(marker))
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "import_paddlenlp.py"), str(directory),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and str(directory / "model_state.pdparams") in done.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_continue_training_and_old_checkpoints_read_through_the_restricted_unpickler(tmp_path):
    """The trainer's weights file (continue_training) and an old checkpoint's model, optimizer and RNG files."""
    from models.decoder import CausalLM
    from models.registry import make_config
    from models.weights import load_weights_file

    marker = tmp_path / "MARKER"
    config = make_config("llama", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16)
    model = CausalLM(config)
    _hostile(str(tmp_path / "model_state.pdparams"), "os.system", str(marker))
    with pytest.raises(UsageError, match="model_state.pdparams refused"):
        load_weights_file(model, config, str(tmp_path / "model_state.pdparams"))
    old = tmp_path / "checkpoint-2"
    old.mkdir()
    _hostile(str(old / "rng_state.rank00000.pkl"), "subprocess", str(marker))
    with pytest.raises(UsageError, match="rng_state.rank00000.pkl refused"):
        ckpt.read_rng_states(str(old), Layout())
    _hostile(str(old / "model_state.tp00_pp00.pdparams"), "eval", str(marker))
    with pytest.raises(UsageError, match="model_state.tp00_pp00.pdparams refused"):
        ckpt.merge_checkpoint(str(old))
    assert not marker.exists()


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(np.random.randn()), paddle.rand([3]).numpy().tolist()


def test_rng_state_round_trips_through_json_and_old_pickles_still_resume(tmp_path):
    """The JSON file restores Python's, NumPy's (with a cached Gaussian) and Paddle's streams exactly;
    a checkpoint written before it (rng_state.rank*.pkl, pickled by the old code) restores the same."""
    random.seed(1), np.random.seed(2), paddle.seed(3)
    np.random.randn()  # NumPy now holds a cached Gaussian: part of its state
    states = ckpt.rng_states()
    expected = _draws()
    (tmp_path / ckpt.rng_file(Layout())).write_text(json.dumps(ckpt.rng_states_to_json(states)))
    ckpt.set_rng_states(ckpt.read_rng_states(str(tmp_path), Layout()))
    assert _draws() == expected
    os.remove(tmp_path / ckpt.rng_file(Layout()))
    with open(tmp_path / ckpt.legacy_rng_file(Layout()), "wb") as f:
        pickle.dump(states, f)  # what write_snapshot_files wrote before the JSON files
    ckpt.set_rng_states(ckpt.read_rng_states(str(tmp_path), Layout()))
    assert _draws() == expected

