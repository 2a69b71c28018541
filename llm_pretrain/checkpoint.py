"""Checkpoints: output_dir/checkpoint-N, written so that a crash never destroys the previous one.

Layout of a checkpoint directory:

    trainer_state.json                  step, consumed samples, arguments, model config, layout
    model_state.tp00_pp00.pdparams      weights, one file per tensor/pipeline shard
    optimizer.tp00_pp00.pdopt           AdamW moments + learning-rate schedule, per shard
    rng_state.rank00000.pkl             every rank's Python/NumPy/Paddle RNG states
    COMPLETE                            written last: only such directories are resumed from

Every rank writes its own files into `checkpoint-N.partial/`; after a barrier
rank 0 writes COMPLETE and renames the directory to `checkpoint-N` (an atomic
rename on one filesystem), then deletes checkpoints beyond save_total_limit.
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

from llm_pretrain.distributed import Layout, barrier
from llm_pretrain.optim import STAGE3_SLICE_PREFIX

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
    # Sharding ranks hold identical weights, or (stage 3) slices gathered into whole weights to save.
    return f"model_state.{shard_tag(layout, with_sharding=False)}.pdparams"


def optimizer_file(layout: Layout) -> str:
    return f"optimizer.{shard_tag(layout, with_sharding=layout.sharding_stage > 0)}.pdopt"


def rng_file(layout: Layout) -> str:
    return f"rng_state.rank{layout.rank:05d}.pkl"


def saves_model(layout: Layout) -> bool:
    return layout.data_parallel_rank == 0 and layout.sharding_rank == 0


def saves_optimizer(layout: Layout) -> bool:
    return layout.data_parallel_rank == 0


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

    if layout.data_parallel_rank == 0:  # every sharding rank takes part in gathering stage-3 slices
        # Canonical names (those of the single-process model), so that shards can be merged
        # into full weights whatever the layout (see merge_checkpoint).
        named = model.canonical_named_parameters()
        weights = {name: stage3_whole_value(param) if is_stage3_sliced(param) else param
                   for name, param in named}
    if saves_model(layout):
        weights[SPLIT_KEY] = {name: [getattr(param, "tp_split_axis", None), getattr(param, "tp_split_parts", None),
                                     getattr(param, "is_firstly_shared", True) is False] for name, param in named}
        paddle.save(weights, os.path.join(staging, model_file(layout)))
    if saves_optimizer(layout):
        state = rename_optimizer_state(optimizer.state_dict(), _internal_to_canonical(model))
        paddle.save(state, os.path.join(staging, optimizer_file(layout)))
    with open(os.path.join(staging, rng_file(layout)), "wb") as f:
        pickle.dump(rng_states(), f)
    barrier(layout)

    if layout.is_main:
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
    renames = {}
    for name, param in model.canonical_named_parameters():
        renames[param.name] = name
        # Under stage 3 the optimizer updates (and keys its state by) the slices of sliced parameters.
        renames[STAGE3_SLICE_PREFIX + param.name] = STAGE3_SLICE_PREFIX + name
    return renames


# ----------------------------------------------------------------------------- sharding stage 3
# Paddle's GroupShardedStage3 (paddle/distributed/fleet/meta_parallel/sharding/group_sharded_stage3.py,
# _flatten_layer_params and _param_storage) slices every parameter of more than 2**20 elements
# (segment_size): it is flattened and zero-padded to a buffer of n x group size elements, rank r
# keeps elements [r*n, (r+1)*n) as `param.fw_storage` (a tensor named "slice@<name>", which the
# optimizer steps), `param.status` becomes "part" and the parameter's own tensor is cleared; a
# forward all-gathers it for the layer's use and clears it again afterwards. Smaller parameters
# stay whole on every rank (`param.unslice`). The saved weights are whole (as PaddleNLP's
# Trainer.save_model, which gathers them with get_all_parameters(convert2cpu=True) first,
# trainer.py:2125); we gather parameter by parameter without touching the wrapper's state.


def is_stage3_sliced(param) -> bool:
    return getattr(param, "status", None) == "part" and getattr(param, "fw_storage", None) is not None


def _sharding_group():
    from paddle.distributed import fleet

    return fleet.get_hybrid_communicate_group().get_sharding_parallel_group()


def stage3_whole_value(param) -> paddle.Tensor:
    """The whole parameter (on the host) from its slices on the sharding group: a collective."""
    import paddle.distributed as dist

    slices = []
    dist.all_gather(slices, param.fw_storage, group=_sharding_group())
    whole = paddle.concat(slices)[: int(np.prod(param.shape))].reshape(param.shape)
    return whole.cpu()


def set_stage3_slice(param, value, layout: Layout) -> None:
    """Load this rank's slice of a whole value into a sliced parameter (the inverse of the gather).

    On the host, in NumPy: bf16 arrives as its uint16 bit patterns, which set_value takes back as
    bf16 (all-zero bits are 0.0, so the padding is right in every dtype)."""
    flat = (value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)).reshape(-1)
    size = int(np.prod(param.fw_storage.shape))
    start = layout.sharding_rank * size
    piece = np.zeros([size], dtype=flat.dtype)  # beyond the parameter's end: the buffer's zero padding
    part = flat[start:start + size]
    piece[:part.size] = part
    param.fw_storage.set_value(piece)


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
    """Restore this rank's weights, optimizer and RNG state; returns the trainer state."""
    weights = paddle.load(os.path.join(path, model_file(layout)))
    with paddle.no_grad():
        for name, param in model.canonical_named_parameters():
            if is_stage3_sliced(param):
                set_stage3_slice(param, weights[name], layout)
            else:
                param.set_value(weights[name])
    canonical_to_internal = {v: k for k, v in _internal_to_canonical(model).items()}
    optimizer_state = paddle.load(os.path.join(path, optimizer_file(layout)))
    optimizer.set_state_dict(rename_optimizer_state(optimizer_state, canonical_to_internal))
    with open(os.path.join(path, rng_file(layout)), "rb") as f:
        set_rng_states(pickle.load(f))
    return read_trainer_state(path)


def merge_checkpoint(path: str) -> dict[str, np.ndarray]:
    """The full weights of a checkpoint (canonical names), merged across its tensor/pipeline shards."""
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
