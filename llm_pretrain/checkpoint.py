"""Checkpoints: output_dir/checkpoint-N, written so that a crash never destroys the previous one.

Layout of a checkpoint directory:

    trainer_state.json                  step, consumed samples, arguments, model config, layout
    tensors.index.json                  every weight and optimizer tensor (single-process name, shape,
                                        dtype) -> its slices (offsets, shape) -> the file holding each
    tensors.rank00000.safetensors       the slices rank 0 holds (llm_pretrain/dist_checkpoint.py)
    rng_state.rank00000.pkl             every rank's Python/NumPy/Paddle RNG states
    COMPLETE                            written last: only such directories are resumed from

Every rank writes its own files into `checkpoint-N.partial/`; after a barrier
rank 0 writes COMPLETE and renames the directory to `checkpoint-N` (an atomic
rename on one filesystem), then deletes checkpoints beyond save_total_limit.
Checkpoints written before the layout-free format hold model_state.tpXX_ppXX.pdparams and
optimizer.tpXX_ppXX[_sdXX].pdopt per shard; they load under the layout that wrote them.
A crash at any point leaves either the `.partial` directory (ignored, removed
by the next save) or a complete checkpoint. Checkpoints live on a filesystem
shared by all nodes, as with PaddleNLP.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import paddle

from llm_pretrain import dist_checkpoint
from llm_pretrain.distributed import Layout, barrier

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
SPLIT_KEY = "__tensor_parallel_split__"  # in each model file: name -> [axis, fused part sizes, is replica]


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER)) and os.path.isfile(os.path.join(path, TRAINER_STATE))


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_PATTERN.match(name)
        path = os.path.join(output_dir, name)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    checkpoints = complete_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def shard_tag(layout: Layout, with_sharding: bool) -> str:
    tag = f"tp{layout.tensor_parallel_rank:02d}_pp{layout.pipeline_parallel_rank:02d}"
    return tag + (f"_sd{layout.sharding_rank:02d}" if with_sharding else "")


def model_file(layout: Layout) -> str:
    # Stage 3 shards the parameters themselves; otherwise sharding ranks hold identical weights.
    return f"model_state.{shard_tag(layout, with_sharding=layout.sharding_stage == 3)}.pdparams"


def optimizer_file(layout: Layout) -> str:
    return f"optimizer.{shard_tag(layout, with_sharding=layout.sharding_stage > 0)}.pdopt"


def rng_file(layout: Layout) -> str:
    return f"rng_state.rank{layout.rank:05d}.pkl"


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "paddle": paddle.get_rng_state()}
    try:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        states["tensor_parallel"] = get_rng_state_tracker().get_states_tracker()
    except Exception:  # fleet not initialized: no tensor-parallel RNG streams
        pass
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    paddle.set_rng_state(states["paddle"])
    if "tensor_parallel" in states:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        get_rng_state_tracker().set_states_tracker(states["tensor_parallel"])


def save_checkpoint(output_dir: str, step: int, model, optimizer, trainer_state: dict, layout: Layout,
                    save_total_limit: int | None) -> str:
    final = checkpoint_path(output_dir, step)
    staging = final + ".partial"
    if layout.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    barrier(layout)

    # Every rank writes the slices it holds (llm_pretrain/dist_checkpoint.py); no gathering.
    dist_checkpoint.save_state(staging, model, optimizer, layout)
    with open(os.path.join(staging, rng_file(layout)), "wb") as f:
        pickle.dump(rng_states(), f)
    barrier(layout)

    if layout.is_main:
        dist_checkpoint.finish_save(staging, layout.world_size, trainer_state.get("layout", {}))
        with open(os.path.join(staging, TRAINER_STATE), "w") as f:
            json.dump(trainer_state, f, indent=2)
        with open(os.path.join(staging, COMPLETE_MARKER), "w") as f:
            f.write(f"{step}\n")
        if os.path.exists(final):  # the same step saved again: the new one replaces it
            shutil.rmtree(final)
        os.replace(staging, final)
        _delete_old_checkpoints(output_dir, save_total_limit)
    barrier(layout)
    return final


def _delete_old_checkpoints(output_dir: str, save_total_limit: int | None) -> None:
    for name in os.listdir(output_dir):  # leftovers of crashed saves
        if name.startswith("checkpoint-") and name.endswith(".partial"):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    if save_total_limit:
        for _, path in complete_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(path, ignore_errors=True)


def _internal_to_canonical(model) -> dict[str, str]:
    return {param.name: name for name, param in model.canonical_named_parameters()}


def rename_optimizer_state(state: dict, renames: dict[str, str]) -> dict:
    """Rename the parameter part of optimizer state keys.

    Paddle keys optimizer state by internal parameter names ("linear_3.w_0_moment1_0"),
    which depend on the order layers were created in a process; checkpoints store them
    under the structured names ("layers.0.mlp.up_proj.weight_moment1_0") instead.
    """
    by_length = sorted(renames, key=len, reverse=True)

    def rename(key: str) -> str:
        for old in by_length:
            if key == old or key.startswith(old + "_"):
                return renames[old] + key[len(old):]
        return key

    renamed = {}
    for key, value in state.items():
        if key == "master_weights":
            renamed[key] = {rename(k): v for k, v in value.items()}
        elif key == "LR_Scheduler":
            renamed[key] = value
        else:
            renamed[rename(key)] = value
    return renamed


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)


def load_checkpoint(path: str, model, optimizer, layout: Layout) -> dict:
    """Restore this rank's weights, optimizer and RNG state; returns the trainer state.

    A checkpoint in the layout-free format loads under any layout; one written before it (per-layout
    model_state/optimizer files) only under the layout that wrote it (checked in trainer.py)."""
    trainer_state = read_trainer_state(path)
    if dist_checkpoint.is_layout_free(path):
        dist_checkpoint.load_state(path, model, optimizer, layout)
    else:
        load_legacy_state(path, model, optimizer, layout)
    # RNG streams: each rank's own when the layout is the same; otherwise every rank takes rank 0's
    # global streams (Python, NumPy, Paddle: seeded alike on all ranks) and keeps the tensor-parallel
    # streams fleet derived for its new rank (dropout masks differ across layouts, see README).
    saved_layout = trainer_state.get("layout") or {}
    same_layout = bool(saved_layout) and all(getattr(layout, key) == value for key, value in saved_layout.items())
    with open(os.path.join(path, rng_file(layout) if same_layout else rng_file(Layout())), "rb") as f:
        states = pickle.load(f)
    if not same_layout:
        states.pop("tensor_parallel", None)
    set_rng_states(states)
    return trainer_state


def load_legacy_state(path: str, model, optimizer, layout: Layout) -> None:
    """A checkpoint of the per-layout format (before the layout-free one), under its own layout."""
    weights = paddle.load(os.path.join(path, model_file(layout)))
    with paddle.no_grad():
        for name, param in model.canonical_named_parameters():
            param.set_value(weights[name])
    canonical_to_internal = {v: k for k, v in _internal_to_canonical(model).items()}
    optimizer_state = paddle.load(os.path.join(path, optimizer_file(layout)))
    optimizer.set_state_dict(rename_optimizer_state(optimizer_state, canonical_to_internal))


def has_weights(path: str) -> bool:
    return dist_checkpoint.is_layout_free(path) or any(
        f.startswith("model_state.") and f.endswith(".pdparams") for f in os.listdir(path))


def merge_checkpoint(path: str) -> dict[str, np.ndarray]:
    """The full weights of a checkpoint (canonical names), merged across its tensor/pipeline shards."""
    if dist_checkpoint.is_layout_free(path):
        return dist_checkpoint.read_full_weights(path)
    from types import SimpleNamespace

    from models.weights import merge_slices

    files = sorted(f for f in os.listdir(path) if f.startswith("model_state.") and f.endswith(".pdparams"))
    by_name: dict[str, dict[int, np.ndarray]] = {}
    split: dict[str, list] = {}
    for file in files:
        tp_rank = int(re.search(r"tp(\d+)", file).group(1))
        state = paddle.load(os.path.join(path, file), return_numpy=True)
        for name, (axis, parts, replica) in state.pop(SPLIT_KEY).items():
            if replica:
                continue
            split[name] = [axis, parts]
            by_name.setdefault(name, {})[tp_rank] = state[name]
    merged = {}
    for name, slices in by_name.items():
        axis, parts = split[name]
        tags = SimpleNamespace(tp_split_axis=axis, tp_split_parts=parts)
        merged[name] = merge_slices([slices[r] for r in sorted(slices)], tags)
    return merged
