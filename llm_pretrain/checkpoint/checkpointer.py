"""Checkpoints: output_dir/checkpoint-N, written so that a run never trades a good checkpoint for a bad one.

Layout of a checkpoint directory:

    trainer_state.json                  step, consumed samples, arguments, model config, layout
    tensors.index.json                  every weight and optimizer tensor (single-process name, shape,
                                        dtype) -> its slices (offsets, shape) -> the file holding each
    tensors.rank00000.safetensors       the slices rank 0 holds (llm_pretrain/checkpoint/dist_checkpoint.py)
    rng_state.rank00000.json            every rank's Python/NumPy/Paddle RNG states (JSON: reading it runs no code;
                                        checkpoints written before hold rng_state.rank00000.pkl, still read)
    scaler.pdparams                     fp16 only: the loss scaler's scale and good/bad step counters
    manifest.json                       size and sha256 of every file above, and which rank wrote it
    COMPLETE                            written last: only such directories are resumed from

What goes into the files is `write_rank_files` / `load_checkpoint` (the layout-free format of
llm_pretrain/checkpoint/dist_checkpoint.py); the lifecycle
around them treats the files generically (whatever a rank writes is listed in the
manifest), so the file format can change without touching it:

  * save (`Checkpointer.save`): every rank writes its files into `checkpoint-N.partial/`,
    fsyncs them and records their sizes and checksums; the ranks agree that every write
    succeeded (one all-reduce); rank 0 writes trainer_state.json and manifest.json, then
    COMPLETE, fsyncs the directory, renames it to `checkpoint-N` (atomic on one filesystem)
    and fsyncs output_dir. A failure (disk full) on any rank removes the `.partial`
    directory on every rank and is one line naming the checkpoint: the previous one is intact.
  * rotation: save_total_limit keeps the newest N complete checkpoints, and never deletes
    the newest one whose weights were finite (each manifest records it).
  * resume (`find_resume_checkpoint` before fleet.init, `agree_on_checkpoint` after):
    the newest complete checkpoint is verified (every file present with its size; the
    checksums split over the ranks, each rank hashing the files of one share); a damaged
    one is one warning naming the file, and the previous complete one is used.
  * start: stale `.partial` directories are removed; an exclusive lock (`OutputDirLock`)
    keeps a second run off the same output_dir.
Checkpoints live on a filesystem shared by all nodes, as with PaddleNLP.
Checkpoints written before the layout-free format hold model_state.tpXX_ppXX.pdparams and
optimizer.tpXX_ppXX[_sdXX].pdopt per shard; they load under the layout that wrote them.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
from dataclasses import dataclass

import numpy as np
import paddle

from llm_pretrain.checkpoint import dist_checkpoint
from llm_pretrain.parallel.distributed import Layout, all_reduce_max, barrier
from llm_pretrain.errors import DivergenceError, RunError, UsageError
from models.weights import merge_slices, read_paddle_pickle

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
RANK_MANIFEST = "manifest.rank{rank:05d}.json"  # each rank's entries, merged into MANIFEST by rank 0
LOCK_FILE = ".lock"
SCALER_FILE = "scaler.pdparams"  # paddlenlp/trainer/trainer.py:170 SCALER_NAME
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
    return f"rng_state.rank{layout.rank:05d}.json"


def legacy_rng_file(layout: Layout) -> str:
    """The pickle checkpoints written before the JSON RNG files hold (read by the restricted unpickler)."""
    return f"rng_state.rank{layout.rank:05d}.pkl"


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "paddle": paddle.get_rng_state()}
    try:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        states["tensor_parallel"] = get_rng_state_tracker().get_states_tracker()
    except Exception:  # fleet not initialized: no tensor-parallel RNG streams
        pass
    return states


def _generator_state(saved):
    """A paddle GeneratorState from its __getstate__ tuple (the form pybind11 pickles it in)."""
    from paddle.base.libpaddle import GeneratorState

    state = GeneratorState.__new__(GeneratorState)
    state.__setstate__(tuple(saved))
    return state


def rng_states_to_json(states: dict) -> dict:
    """rng_states() as JSON values: Python's and NumPy's state tuples as lists, every paddle
    GeneratorState as its __getstate__ tuple (device, seed, offset, the Mersenne Twister's text)."""
    kind, keys, position, has_gauss, cached_gaussian = states["numpy"]
    version, internal, gauss_next = states["python"]
    encoded = {"python": [version, list(internal), gauss_next],
               "numpy": [kind, np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached_gaussian)],
               "paddle": [list(s.__getstate__()) for s in states["paddle"]]}
    if "tensor_parallel" in states:
        encoded["tensor_parallel"] = {name: [list(s.__getstate__()) for s in generators]
                                      for name, generators in states["tensor_parallel"].items()}
    return encoded


def rng_states_from_json(encoded: dict) -> dict:
    version, internal, gauss_next = encoded["python"]
    kind, keys, position, has_gauss, cached_gaussian = encoded["numpy"]
    states = {"python": (version, tuple(internal), gauss_next),
              "numpy": (kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian),
              "paddle": [_generator_state(s) for s in encoded["paddle"]]}
    if "tensor_parallel" in encoded:
        states["tensor_parallel"] = {name: [_generator_state(s) for s in generators]
                                     for name, generators in encoded["tensor_parallel"].items()}
    return states


def read_rng_states(path: str, layout: Layout) -> dict:
    """The RNG states `layout`'s rank saved in checkpoint `path`: the JSON file, or the pickle of a
    checkpoint written before it, unpickled admitting only paddle's GeneratorState besides arrays."""
    json_file = os.path.join(path, rng_file(layout))
    if os.path.isfile(json_file) or not os.path.isfile(os.path.join(path, legacy_rng_file(layout))):
        with open(json_file) as f:
            return rng_states_from_json(json.load(f))
    from paddle.base.libpaddle import GeneratorState

    return read_paddle_pickle(os.path.join(path, legacy_rng_file(layout)),
                              allow={("paddle.base.libpaddle", "GeneratorState"): GeneratorState})


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    paddle.set_rng_state(states["paddle"])
    if "tensor_parallel" in states:
        from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

        get_rng_state_tracker().set_states_tracker(states["tensor_parallel"])


def write_rank_files(staging: str, model, optimizer, layout: Layout, scaler=None) -> list[str]:
    """This rank's part of a checkpoint: the slices it holds of every weight and optimizer tensor
    (llm_pretrain/checkpoint/dist_checkpoint.py; nothing is gathered), its RNG states and, on rank 0 under fp16,
    the loss scaler's state. Returns the file names."""
    return write_snapshot_files(staging, snapshot_rank_state(model, optimizer, layout, scaler, copy=False), layout)


def snapshot_rank_state(model, optimizer, layout: Layout, scaler=None, copy: bool = True) -> dict:
    """What write_rank_files writes, taken now; copy: the tensors copied to host memory (async_save)."""
    # As paddlenlp/trainer/trainer.py:2232-2233 (_save_checkpoint): GradScaler.state_dict() (scale,
    # incr/decr counters and ratios; paddle/amp/grad_scaler.py:598). One copy: the overflow check
    # is shared by every rank (precision.py), so the scale and counters are the same on all ranks.
    scaler_state = scaler.state_dict() if scaler is not None and layout.rank == 0 else None
    return {"tensors": dist_checkpoint.snapshot_state(model, optimizer, layout, copy), "rng": rng_states(),
            "scaler": scaler_state}


def write_snapshot_files(staging: str, snapshot: dict, layout: Layout) -> list[str]:
    written = dist_checkpoint.write_snapshot(staging, layout, snapshot["tensors"])
    with open(os.path.join(staging, rng_file(layout)), "w") as f:
        json.dump(rng_states_to_json(snapshot["rng"]), f)
    written.append(rng_file(layout))
    if snapshot["scaler"] is not None:
        paddle.save(snapshot["scaler"], os.path.join(staging, SCALER_FILE))
        written.append(SCALER_FILE)
    return written


def load_scaler_state(path: str, scaler) -> bool:
    """Restore the fp16 loss scaler from checkpoint `path` (every rank, any layout); False when the
    checkpoint has no scaler state (a bf16/fp32 run, or written before it was saved): the scaler then
    starts from scale_loss, as PaddleNLP does (paddlenlp/trainer/trainer.py:2532-2535)."""
    file = os.path.join(path, SCALER_FILE)
    if scaler is None or not os.path.isfile(file):
        return False
    scaler.load_state_dict(read_paddle_pickle(file))  # paddle/amp/grad_scaler.py:628
    return True


def save_checkpoint(output_dir: str, step: int, model, optimizer, trainer_state: dict, layout: Layout,
                    save_total_limit: int | None, scaler=None) -> str:
    """Write checkpoint-`step` now (see Checkpointer.save)."""
    return Checkpointer(output_dir, layout, save_steps=0, save_total_limit=save_total_limit).save(
        step, model, optimizer, trainer_state, scaler)


# ----------------------------------------------------------------------------- files: fsync and checksums
def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: str, rank: int) -> dict:
    """Size and checksum of a file that is on disk (fsynced first)."""
    fsync_file(path)
    return {"size": os.path.getsize(path), "sha256": sha256_of(path), "rank": rank}


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _weights_are_finite(model) -> bool:
    """Whether every local weight is finite (one reduction per parameter, one host read).

    A parameter that stage 3 slices holds no memory between steps (group_sharded_stage3.py:565,
    param._clear_data()); its values are this rank's flat slice, param.fw_storage (what
    dist_checkpoint saves, _stage3_storage)."""
    flags = []
    for _, param in model.canonical_named_parameters():
        storage = getattr(param, "fw_storage", None)
        flags.append(paddle.isfinite(param if storage is None else storage).all().astype("int32"))
    return bool(int(paddle.stack(flags).min())) if flags else True


# ----------------------------------------------------------------------------- the checkpointer
class Checkpointer:
    """Owns output_dir's checkpoints: cadence, staged verified writes, rotation.

    The training loop asks `due(step, max_steps)` and calls `save(...)`; resuming is
    `find_resume_checkpoint` + `agree_on_checkpoint` + `load`.
    """

    def __init__(self, output_dir: str, layout: Layout, save_steps: int, save_total_limit: int | None,
                 exit_interval: int | None = None, async_save: bool = False):
        self.output_dir = output_dir
        self.layout = layout
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.exit_interval = exit_interval
        self.async_save = async_save
        self.pending: PendingSave | None = None  # the asynchronous save in flight (at most one)

    # -- cadence
    def exit_due(self, step: int, max_steps: int) -> bool:
        """exit_interval: stop (with a checkpoint) after every N-th step, except the last."""
        return bool(self.exit_interval) and step % self.exit_interval == 0 and step < max_steps

    def due(self, step: int, max_steps: int) -> bool:
        every = bool(self.save_steps) and (step % self.save_steps == 0 or step == max_steps)
        return every or self.exit_due(step, max_steps)

    # -- writing
    def save(self, step: int, model, optimizer, trainer_state: dict, scaler=None) -> str:
        """checkpoint-`step`, complete and verified, or nothing (and the previous one untouched).

        `scaler`: the fp16 GradScaler (None without one), saved with the checkpoint."""
        self.complete_pending()
        final, staging = self._begin(step, model)
        failure = None
        try:
            self._write_files(staging, snapshot_rank_state(model, optimizer, self.layout, scaler, copy=False))
        except OSError as error:
            failure = error
        self._complete(step, final, staging, trainer_state, failure)
        return final

    def save_async(self, step: int, model, optimizer, trainer_state: dict, scaler=None) -> str:
        """Start checkpoint-`step`: the state is copied to host memory now and written by a background
        thread while training goes on; `complete_pending` (main thread, every rank at the same step)
        then agrees that every rank's write succeeded and finalizes it as `save` does. Until then
        the previous checkpoint is the newest complete one."""
        from concurrent.futures import ThreadPoolExecutor

        self.complete_pending()  # at most one in flight: the next save waits for the previous one
        final, staging = self._begin(step, model)
        snapshot = snapshot_rank_state(model, optimizer, self.layout, scaler, copy=True)
        host_bytes = dist_checkpoint.host_state_bytes(snapshot["tensors"])
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.pending = PendingSave(step, final, staging, trainer_state, host_bytes, pool,
                                   pool.submit(self._write_files_noting_failure, staging, snapshot))
        pool.shutdown(wait=False)
        return final

    def write_pending(self) -> bool:
        """Whether this rank's background write is still running (the loop agrees on it every step)."""
        return self.pending is not None and not self.pending.future.done()

    def complete_pending(self) -> PendingSave | None:
        """Wait for the save in flight, then agree and finalize it (a collective: every rank calls it
        at the same step, on the main thread). Returns it (None when there was none)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            failure = pending.future.result()
            self._complete(pending.step, pending.final, pending.staging, pending.trainer_state, failure)
        return pending

    def _write_files_noting_failure(self, staging: str, snapshot: dict) -> OSError | None:
        try:
            self._write_files(staging, snapshot)
        except OSError as error:
            return error
        return None

    def _write_files(self, staging: str, snapshot: dict) -> None:
        """This rank's files, fsynced, with their sizes and checksums in its rank manifest (any thread)."""
        layout = self.layout
        entries = {name: file_entry(os.path.join(staging, name), layout.rank)
                   for name in write_snapshot_files(staging, snapshot, layout)}
        _write_synced(os.path.join(staging, RANK_MANIFEST.format(rank=layout.rank)), json.dumps(entries))

    def _begin(self, step: int, model) -> tuple[str, str]:
        """The finite-weights check and the staging directory, agreed by every rank."""
        layout = self.layout
        if all_reduce_max(0.0 if _weights_are_finite(model) else 1.0, layout):
            raise DivergenceError(f"the weights after step {step} are not finite; checkpoint-{step} was not "
                                  "written (the previous checkpoints hold finite weights)")
        final = checkpoint_path(self.output_dir, step)
        staging = final + ".partial"
        failure = None
        if layout.is_main:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                os.makedirs(staging)
            except OSError as error:
                failure = error
        self._agree_or_raise(failure, step, staging)
        return final, staging

    def _complete(self, step: int, final: str, staging: str, trainer_state: dict, failure: OSError | None) -> None:
        """Every rank's write succeeded (agreed), then rank 0 finalizes: manifest, COMPLETE, rename."""
        layout = self.layout
        self._agree_or_raise(failure, step, staging)

        if layout.is_main:
            try:
                self._finalize(staging, final, step, trainer_state)
            except OSError as error:
                failure = error
        self._agree_or_raise(failure, step, staging)
        if layout.is_main:
            self.rotate()
        barrier(layout)

    def _finalize(self, staging: str, final: str, step: int, trainer_state: dict) -> None:
        """Rank 0: the tensor index, trainer_state.json, the merged manifest, COMPLETE, fsync, rename, fsync."""
        # The ranks' slice lists become tensors.index.json (finish_save removes the lists).
        dist_checkpoint.finish_save(staging, self.layout.world_size, trainer_state.get("layout", {}))
        _write_synced(os.path.join(staging, TRAINER_STATE), json.dumps(trainer_state, indent=2))
        files = {TRAINER_STATE: file_entry(os.path.join(staging, TRAINER_STATE), 0)}
        parts = sorted(name for name in os.listdir(staging) if re.fullmatch(r"manifest\.rank\d+\.json", name))
        for part in parts:
            with open(os.path.join(staging, part)) as f:
                files.update(json.load(f))
        files = {name: entry for name, entry in files.items() if os.path.exists(os.path.join(staging, name))}
        for name in _files_under(staging):  # anything written without being listed: rank 0 vouches for it
            if name not in files and name not in parts:
                files[name] = file_entry(os.path.join(staging, name), 0)
        manifest = {"step": step, "weights_finite": True, "files": dict(sorted(files.items()))}
        _write_synced(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1))
        for part in parts:
            os.remove(os.path.join(staging, part))
        _write_synced(os.path.join(staging, COMPLETE_MARKER), f"{step}\n")
        for root, _, _ in os.walk(staging, topdown=False):  # the entries of every directory, staging last
            fsync_dir(root)
        if os.path.exists(final):  # the same step saved again: the new one replaces it
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(self.output_dir)

    def _agree_or_raise(self, failure: OSError | None, step: int, staging: str) -> None:
        """Every rank learns whether any rank failed (the all-reduce doubles as the barrier)."""
        code = (failure.errno or 1) if failure is not None else 0
        agreed = int(all_reduce_max(float(code), self.layout))
        if not agreed:
            return
        if self.layout.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        previous = latest_checkpoint(self.output_dir)
        if agreed == errno.ENOSPC:
            what = "no space left on device"
        elif failure is not None:
            what = failure.strerror or str(failure)
        else:
            what = f"another rank failed to write its files ({os.strerror(agreed)})"
        intact = (f"the previous checkpoint {os.path.basename(previous)} is intact" if previous
                  else "there is no previous checkpoint")
        raise CheckpointWriteError(f"cannot write checkpoint-{step} in {self.output_dir}: {what}; "
                                   f"{os.path.basename(staging)} was removed and {intact}")

    # -- rotation
    def rotate(self) -> None:
        """Keep the newest save_total_limit complete checkpoints and the newest one with finite weights."""
        if not self.save_total_limit:
            return
        checkpoints = complete_checkpoints(self.output_dir)
        keep = {path for _, path in checkpoints[-self.save_total_limit:]}
        finite = [path for _, path in checkpoints if _manifest_says_finite(path)]
        if finite:
            keep.add(finite[-1])
        for _, path in checkpoints:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # -- reading
    def load(self, path: str, model, optimizer, scaler=None) -> dict:
        return load_checkpoint(path, model, optimizer, self.layout, scaler)


@dataclass
class PendingSave:
    """An asynchronous save whose files a background thread is writing."""

    step: int
    final: str
    staging: str
    trainer_state: dict
    host_bytes: int  # the host copy of this rank's state it holds until the write ends
    pool: object
    future: object


class CheckpointWriteError(RunError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


def _files_under(directory: str) -> list[str]:
    """Every file below directory, as paths relative to it (a format may use subdirectories)."""
    found = []
    for root, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(root, name), directory) for name in names]
    return sorted(found)


def _manifest_says_finite(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return bool(json.load(f).get("weights_finite"))
    except (OSError, ValueError):
        return False


def remove_stale_partials(output_dir: str) -> list[str]:
    """Remove `checkpoint-N.partial` directories left by interrupted saves (rank 0, at start)."""
    removed = []
    if os.path.isdir(output_dir):
        for name in sorted(os.listdir(output_dir)):
            if name.startswith("checkpoint-") and name.endswith(".partial"):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
                removed.append(name)
    return removed


def remove_checkpoints(output_dir: str) -> list[str]:
    """overwrite_output_dir: every checkpoint of an earlier run goes before this run's first save."""
    removed = []
    if os.path.isdir(output_dir):
        for name in sorted(os.listdir(output_dir)):
            path = os.path.join(output_dir, name)
            if name.startswith("checkpoint-") and os.path.isdir(path):
                shutil.rmtree(path)
                removed.append(name)
    return removed


# ----------------------------------------------------------------------------- verification and resume
def verify_checkpoint(path: str, checksum_share=None) -> str | None:
    """None if the checkpoint is usable, else what is wrong (naming the file).

    Every file listed in the manifest must exist with its recorded size; the checksums of the
    entries for which `checksum_share(entry)` is true are recomputed (all when None).
    A checkpoint without a manifest (written before manifests existed) is checked for
    trainer_state.json only.
    """
    if not is_complete(path):
        return f"{path} is not complete (no {COMPLETE_MARKER} or {TRAINER_STATE})"
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.isfile(manifest_path):
        try:
            with open(manifest_path) as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{manifest_path} is damaged (not a valid manifest)"
        for name, entry in files.items():
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return f"{file} is missing"
            size = os.path.getsize(file)
            if size != entry["size"]:
                return f"{file} has {size} bytes, the manifest says {entry['size']}"
        for name, entry in files.items():
            if (checksum_share is None or checksum_share(entry)) and sha256_of(os.path.join(path, name)) != entry["sha256"]:
                return f"{os.path.join(path, name)} does not match its checksum in the manifest"
    try:
        state = read_trainer_state(path)
        state["global_step"], state["consumed_samples"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{os.path.join(path, TRAINER_STATE)} is damaged (not valid JSON with global_step)"
    return None


def _share_of(rank: int, world_size: int):
    """The manifest entries this rank re-hashes on resume: together the ranks hash every file once."""
    return lambda entry: int(entry.get("rank", 0)) % world_size == rank


def find_resume_checkpoint(output_dir: str, rank: int, world_size: int, start: int = 0,
                           candidates: list[str] | None = None) -> tuple[int, list[str], list[str]]:
    """Before fleet.init: (index into candidates of the newest usable one, candidates newest first, warnings).

    The index is len(candidates) when none is usable.
    """
    if candidates is None:
        candidates = [path for _, path in reversed(complete_checkpoints(output_dir))]
    warnings = []
    for index in range(start, len(candidates)):
        problem = verify_checkpoint(candidates[index], _share_of(rank, world_size))
        if problem is None:
            return index, candidates, warnings
        older = candidates[index + 1] if index + 1 < len(candidates) else None
        warnings.append(f"checkpoint {candidates[index]} is damaged: {problem}; "
                        + (f"trying the previous one, {older}" if older else "no older complete checkpoint"))
    return len(candidates), candidates, warnings


def agree_on_checkpoint(index: int, candidates: list[str], layout: Layout) -> tuple[int, list[str]]:
    """After fleet.init: the newest checkpoint that every rank found intact (each verified its own share)."""
    warnings = []
    while True:
        agreed = int(all_reduce_max(float(index), layout))
        index, _, more = find_resume_checkpoint("", layout.rank, layout.world_size, agreed, candidates)
        warnings += more
        if int(all_reduce_max(float(index), layout)) == agreed:
            return agreed, warnings


# ----------------------------------------------------------------------------- the output_dir lock
class OutputDirLock:
    """An exclusive flock on output_dir/.lock held for the whole run; the file names the holder."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd = None

    def acquire(self) -> "OutputDirLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = os.read(fd, 1000).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"output_dir: {os.path.dirname(self.path)} is in use by another run ({holder}); "
                             "wait for it to finish or choose another output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


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


def load_checkpoint(path: str, model, optimizer, layout: Layout, scaler=None) -> dict:
    """Restore this rank's weights, optimizer, RNG state and the fp16 loss scaler (when `scaler` is
    given); returns the trainer state.

    A checkpoint in the layout-free format loads under any layout; one written before it (per-layout
    model_state/optimizer files) only under the layout that wrote it (checked by the preflight, llm_pretrain/run/preflight.py)."""
    trainer_state = read_trainer_state(path)
    if dist_checkpoint.is_layout_free(path):
        dist_checkpoint.load_state(path, model, optimizer, layout)
    else:
        load_legacy_state(path, model, optimizer, layout)
    # RNG streams: each rank's own when the layout is the same; otherwise every rank takes rank 0's
    # global streams (Python, NumPy, Paddle: seeded alike on all ranks) and keeps the tensor-parallel
    # streams fleet derived for its new rank (dropout masks differ across layouts, see docs/checkpoints.md).
    saved_layout = trainer_state.get("layout") or {}
    same_layout = bool(saved_layout) and all(getattr(layout, key) == value for key, value in saved_layout.items())
    states = read_rng_states(path, layout if same_layout else Layout())
    if not same_layout:
        states.pop("tensor_parallel", None)
    set_rng_states(states)
    load_scaler_state(path, scaler)
    return trainer_state


def load_legacy_state(path: str, model, optimizer, layout: Layout) -> None:
    """A checkpoint of the per-layout format (before the layout-free one), under its own layout."""
    weights = read_paddle_pickle(os.path.join(path, model_file(layout)))
    with paddle.no_grad():
        for name, param in model.canonical_named_parameters():
            param.set_value(weights[name])
    canonical_to_internal = {v: k for k, v in _internal_to_canonical(model).items()}
    optimizer_state = read_paddle_pickle(os.path.join(path, optimizer_file(layout)))
    if "master_weights" in optimizer_state:  # the optimizer computes with these, as tensors (paddle.load gives them so)
        optimizer_state["master_weights"] = {name: paddle.to_tensor(value)
                                             for name, value in optimizer_state["master_weights"].items()}
    optimizer.set_state_dict(rename_optimizer_state(optimizer_state, canonical_to_internal))


def has_weights(path: str) -> bool:
    return dist_checkpoint.is_layout_free(path) or any(
        f.startswith("model_state.") and f.endswith(".pdparams") for f in os.listdir(path))


def merge_checkpoint(path: str) -> dict[str, np.ndarray]:
    """The full weights of a checkpoint (canonical names), merged across its tensor/pipeline shards."""
    if dist_checkpoint.is_layout_free(path):
        return dist_checkpoint.read_full_weights(path)
    from types import SimpleNamespace

    files = sorted(f for f in os.listdir(path) if f.startswith("model_state.") and f.endswith(".pdparams"))
    by_name: dict[str, dict[int, np.ndarray]] = {}
    split: dict[str, list] = {}
    for file in files:
        tp_rank = int(re.search(r"tp(\d+)", file).group(1))
        state = read_paddle_pickle(os.path.join(path, file))
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
