"""Every copy of a replicated tensor is the same on every rank that holds it.

A checkpoint stores each replicated tensor once (llm_pretrain/dist_checkpoint.py), so a replica
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

The trainer runs the check at the end of training and, with `check_replicas_interval` N > 0,
after every N-th step; the summary record of train_log.jsonl reports it ("replica_check").
"""

from __future__ import annotations

import hashlib

import numpy as np

from llm_pretrain.errors import RunError


def local_hashes(model, optimizer, layout) -> dict[str, str]:
    """'<tensor>@<offsets>' -> hash of that box's bytes, for every box this rank holds."""
    from llm_pretrain.dist_checkpoint import held_tensors

    hashes = {}
    for t in held_tensors(model, optimizer, layout):
        local = t.tensor.numpy()
        for piece in t.pieces:
            box = np.ascontiguousarray(piece.take(local))
            key = f"{t.name}@{','.join(map(str, piece.offsets))}"
            hashes[key] = hashlib.blake2b(box.data, digest_size=12).hexdigest() + f":{box.dtype}{list(box.shape)}"
    return hashes


def compare_replicas(hashes_by_rank: list[dict[str, str]], step: int) -> dict:
    """The groups of ranks holding the same box, each of which must agree; RunError naming the
    tensor and the ranks otherwise. Returns what was compared (for the run's summary)."""
    holders: dict[str, list[int]] = {}
    for rank, hashes in enumerate(hashes_by_rank):
        for key in hashes:
            holders.setdefault(key, []).append(rank)
    groups = {key: ranks for key, ranks in holders.items() if len(ranks) > 1}
    for key in sorted(groups):
        ranks = groups[key]
        first = hashes_by_rank[ranks[0]][key]
        differing = [r for r in ranks if hashes_by_rank[r][key] != first]
        if differing:
            tensor, offsets = key.rsplit("@", 1)
            raise RunError(f"replica check after step {step}: {tensor} (box at offsets [{offsets}]) differs between "
                           f"its replicas: rank(s) {differing} differ from rank {ranks[0]} (replicas on ranks {ranks})")
    return {"step": step, "replica_groups": len(groups), "replicas": sum(len(r) for r in groups.values()),
            "identical": True}


def check_replicas(model, optimizer, layout, step: int) -> dict:
    """On every rank (collective when distributed): hash, all-gather, compare. `model` is the
    unwrapped model (canonical parameter names), `optimizer` the one the trainer steps."""
    if not layout.distributed:  # one process holds one copy of everything
        return compare_replicas([{}], step)
    import paddle.distributed as dist

    hashes = local_hashes(model, optimizer, layout)

    gathered: list = []
    dist.all_gather_object(gathered, hashes)
    return compare_replicas(gathered, step)
