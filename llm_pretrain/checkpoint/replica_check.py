"""Every copy of a replicated tensor is the same on every rank that holds it.

A checkpoint stores each replicated tensor once (llm_pretrain/checkpoint/dist_checkpoint.py), so a replica
that drifted from the others (a data-parallel rank that missed a gradient all-reduce, a
tensor-parallel norm whose sequence-parallel hook did not fire, the pipeline's second copy of a
tied embedding not updated like the first, a stage-1/2 broadcast that did not arrive) would
never be seen in it. As Megatron-LM's `--check-weight-hash-across-dp-replicas-interval`, each
rank hashes every box of every parameter and optimizer state it holds (the same boxes the
checkpoint writer uses: `dist_checkpoint.held_tensors`), one all_gather_object exchanges these
small dicts, and every box held by more than one rank must have one hash: data-parallel
replicas, tensor-parallel replicated parameters (norms, also under sequence parallelism, GQA's
replicated k/v projections), both pipeline ends' tied embedding, parameters held whole on every
sharding rank (stages 1 and 2; stage 3 below 2**20 elements), the beta-power accumulators, and
the optimizer states of all of them. Hashes are exact: replicas are computed from the same
all-reduced values, so they are bitwise equal.

Where replicas differ, what happens depends on whether the run is deterministic by construction:
- On CPU it is (gloo's reductions and the CPU kernels give the same bits for the same inputs):
  any difference is a bug (a missed all-reduce, a hook that did not fire) and a RunError.
- On GPU it is not: a kernel with atomics (an embedding or position gradient, the backward of a
  fused norm or of flash attention) can give two ranks different last bits from the same inputs,
  and Adam turns last-bit gradient differences into differences of a sizeable fraction of the
  learning rate (see tests/parity_utils.py base_arguments), so no bound derived from the dtype
  holds over a long run. There the replicas are resynchronized from the first rank holding them,
  as fleet's hybrid-parallel optimizer does with `sync_param`/`sync_moment` for tensor-parallel
  replicas (paddle/distributed/fleet/meta_optimizers/dygraph_optimizer/hybrid_parallel_optimizer.py:
  482-520, broadcast from the group's first rank), with one warning naming each tensor and its
  largest difference; the summary lists them ("resynchronized"). A finished run is never lost to
  rounding; the GPU self-check's fp32 rows (deterministic kernels) still require bitwise replicas.

The trainer runs the check at the end of training and, with `check_replicas_interval` N > 0,
after every N-th step; the summary record of train_log.jsonl reports it ("replica_check").
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from llm_pretrain.errors import RunError


def local_hashes(model, optimizer, layout) -> dict[str, str]:
    """'<tensor>@<offsets>' -> hash of that box's bytes, for every box this rank holds."""
    from llm_pretrain.checkpoint.dist_checkpoint import held_tensors

    hashes = {}
    for t in held_tensors(model, optimizer, layout):
        local = t.tensor.numpy()
        for piece in t.pieces:
            box = np.ascontiguousarray(piece.take(local))
            key = f"{t.name}@{','.join(map(str, piece.offsets))}"
            hashes[key] = hashlib.blake2b(box.data, digest_size=12).hexdigest() + f":{box.dtype}{list(box.shape)}"
    return hashes


def differing_replicas(hashes_by_rank: list[dict[str, str]]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(the groups of ranks holding the same box, the groups whose copies differ)."""
    holders: dict[str, list[int]] = {}
    for rank, hashes in enumerate(hashes_by_rank):
        for key in hashes:
            holders.setdefault(key, []).append(rank)
    groups = {key: ranks for key, ranks in holders.items() if len(ranks) > 1}
    differing = {key: ranks for key, ranks in sorted(groups.items())
                 if len({hashes_by_rank[r][key] for r in ranks}) > 1}
    return groups, differing


def compare_replicas(hashes_by_rank: list[dict[str, str]], step: int) -> dict:
    """The groups of ranks holding the same box, each of which must agree; RunError naming the
    tensor and the ranks otherwise. Returns what was compared (for the run's summary)."""
    groups, differing = differing_replicas(hashes_by_rank)
    for key, ranks in differing.items():
        first = hashes_by_rank[ranks[0]][key]
        tensor, offsets = key.rsplit("@", 1)
        raise RunError(f"replica check after step {step}: {tensor} (box at offsets [{offsets}]) differs between "
                       f"its replicas: rank(s) {[r for r in ranks if hashes_by_rank[r][key] != first]} differ from "
                       f"rank {ranks[0]} (replicas on ranks {ranks})")
    return {"step": step, "replica_groups": len(groups), "replicas": sum(len(r) for r in groups.values()),
            "identical": True}


def as_float64(box: np.ndarray) -> np.ndarray:
    """The values of a box; bfloat16 travels as its uint16 bits (Tensor.numpy())."""
    if box.dtype == np.uint16:
        return (box.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return box.astype(np.float64)


def resynchronize(model, optimizer, layout, step: int, differing: dict[str, list[int]]) -> list[dict]:
    """Every rank holding a box of `differing` takes the copy of the first rank holding it (one
    all_gather_object of those boxes; they are few and small: the replicated tensors whose kernels
    were not deterministic). Returns each box's largest absolute and relative difference."""
    import paddle.distributed as dist

    from llm_pretrain.checkpoint.dist_checkpoint import held_tensors

    mine = {}  # key -> (held tensor, piece) on this rank
    for t in held_tensors(model, optimizer, layout):
        for piece in t.pieces:
            key = f"{t.name}@{','.join(map(str, piece.offsets))}"
            if key in differing:
                mine[key] = (t, piece)
    local = {key: np.ascontiguousarray(piece.take(t.tensor.numpy())) for key, (t, piece) in mine.items()}
    gathered: list = []
    dist.all_gather_object(gathered, local)
    report = []
    for key, ranks in differing.items():
        source = gathered[ranks[0]][key]
        reference = as_float64(source)
        worst = max(float(np.abs(as_float64(gathered[r][key]) - reference).max()) for r in ranks[1:])
        report.append({"tensor": key, "ranks": ranks, "source_rank": ranks[0], "max_difference": worst,
                       "relative_difference": worst / max(float(np.abs(reference).max()), 1e-30)})
        if key in mine and layout.rank != ranks[0]:
            t, piece = mine[key]
            values = t.tensor.numpy()
            piece.put(values, source)
            t.tensor.set_value(values)
    return report


def check_replicas(model, optimizer, layout, step: int, resynchronize_differences: bool = False) -> dict:
    """On every rank (collective when distributed): hash, all-gather, compare. `model` is the
    unwrapped model (canonical parameter names), `optimizer` the one the trainer steps.

    Replicas that differ: a RunError, or with `resynchronize_differences` (GPU, see the module's
    docstring) the first holder's copy everywhere, a warning, and the summary lists them."""
    if not layout.distributed:  # one process holds one copy of everything
        return compare_replicas([{}], step)
    import paddle.distributed as dist

    hashes = local_hashes(model, optimizer, layout)
    gathered: list = []
    dist.all_gather_object(gathered, hashes)
    groups, differing = differing_replicas(gathered)
    if not differing or not resynchronize_differences:
        return compare_replicas(gathered, step)
    report = resynchronize(model, optimizer, layout, step, differing)
    if layout.rank == 0:
        worst = max(report, key=lambda entry: entry["relative_difference"])
        print(f"warning: replica check after step {step}: {len(report)} replicated box(es) differed between "
              f"ranks (GPU kernels that are not deterministic); resynchronized from the first rank holding "
              f"each; the largest difference is {worst['max_difference']:.3g} ({worst['relative_difference']:.3g} "
              f"relative) in {worst['tensor']} on ranks {worst['ranks']}", file=sys.stderr, flush=True)
    return {"step": step, "replica_groups": len(groups), "replicas": sum(len(r) for r in groups.values()),
            "identical": False, "resynchronized": report}
