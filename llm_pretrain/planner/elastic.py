"""Elastic continuation: the layout a job continues with on the ranks it has left, same global batch.

Two users:

  * the run's preflight (llm_pretrain/run/preflight.py, `elastic: true`), before fleet.init, when the
    ranks present differ from the newest checkpoint's writers or cannot form the argument file's
    degrees: `continue_on(args, world_size, global_batch, device)` gives the argument overrides;
  * `llm-plan elastic ARGS.json --gpus 64 --gpus_per_node 8 --device A100-80G`: for 64, 56, 48 ... GPUs
    (whole nodes lost one at a time), `elastic_table` gives the layout the planner's search ranks first
    and its predicted tokens/card/s and memory, or that none fits and the smallest count that does.

What is held: the model, sequence length, global batch (micro-batch x accumulation x data replicas;
a data-parallel degree derived from fewer ranks must not shrink it) and device; tensor parallelism
stays inside a node (search's default); and the keys listed in elastic_keep.

The rule on the ranks present (`continue_on`; on CPU the planner has no speed model, so no ranking):
keep the run's own degrees when they form a valid layout there, the data-parallel (and sharding)
degree re-derived from the ranks; otherwise lower tensor parallelism, then pipeline parallelism,
to the largest divisors of the run's own that form a valid layout (tensor parallelism is tried
highest first: it holds the most memory per rank; virtual stages are kept only with the run's own
pipeline degree), and sep/cp to 1 if they no longer fit. The first valid layout whose data
replicas divide the global batch wins; the micro-batch is the run's own, else the largest divisor
of the per-replica batch below it, and accumulation makes up the rest.

May import what the planner may (arguments, errors, models, parallel, observe).
"""

from __future__ import annotations

import dataclasses

from llm_pretrain.arguments import Arguments
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.layout import check_layout_and_model, plan_layout


def _divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def _degree(value: int) -> int:
    return 1 if value == -1 else value


def global_batch_size(args: Arguments, world_size: int) -> int:
    """Samples per optimizer step of `args` on `world_size` ranks (its degrees must form a layout there)."""
    layout = plan_layout(args, world_size)
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * layout.data_replicas


def nearest_global_batches(global_batch: int, replicas: int) -> list[int]:
    """The multiples of `replicas` nearest to global_batch, below and above (those the ranks can split)."""
    below = global_batch // replicas * replicas
    return [b for b in (below, below + replicas) if b > 0]


def _micro_and_accumulation(args: Arguments, per_replica: int) -> tuple[int, int]:
    micro = max(d for d in _divisors_descending(per_replica) if d <= args.per_device_train_batch_size)
    return micro, per_replica // micro


def layout_overrides(args: Arguments, tp: int, pp: int, vpp: int, split: dict) -> dict:
    """The keys of one candidate layout; the sharding degree is re-derived from the ranks (PaddleNLP's
    default, world / (tp x pp x sep x cp)), the data-parallel degree is the rest."""
    return {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "virtual_pp_degree": vpp,
            "sharding_parallel_degree": -1, "sharding_degree": -1,
            "sequence_parallel": args.sequence_parallel and tp > 1,
            "pipeline_layers_per_stage": args.pipeline_layers_per_stage if pp == _degree(args.pipeline_parallel_degree)
            else None, **split}


def candidate_layouts(args: Arguments) -> list[dict]:
    """The rule's candidates, in order (module docstring): the run's own degrees first."""
    tp, pp = _degree(args.tensor_parallel_degree), _degree(args.pipeline_parallel_degree)
    splits = [{"sep_parallel_degree": args.sep_parallel_degree, "context_parallel_degree": args.context_parallel_degree}]
    if _degree(args.sep_parallel_degree) > 1 or _degree(args.context_parallel_degree) > 1:
        splits.append({"sep_parallel_degree": -1, "context_parallel_degree": -1})
    found = []
    for split in splits:
        for t in _divisors_descending(tp):
            for p in _divisors_descending(pp):
                vpp = args.virtual_pp_degree if p == pp else 1
                found.append(layout_overrides(args, t, p, vpp, split))
    return found


def _kept(args: Arguments, overrides: dict, keep: list[str]) -> list[str]:
    """The elastic_keep keys whose value the overrides would change."""
    changed = []
    for key in keep:
        if key in overrides and _degree(overrides[key]) != _degree(getattr(args, key)):
            changed.append(key)
    return changed


def continue_on(args: Arguments, world_size: int, global_batch: int | None, device: str,
                fits=None) -> tuple[Arguments, dict]:
    """The arguments of the layout the run continues with on `world_size` ranks keeping `global_batch`
    (the rule of the module docstring; None: no checkpoint, the file's micro-batch and accumulation per
    data replica), and what changed ({key: [old, new]}). `fits(args, config, layout, device)` raises a
    UsageError for a layout the ranks' memory cannot hold (the preflight's check before Paddle), and the
    rule moves on to the next candidate. UsageError, one line,
    when no layout keeps it: naming the elastic_keep key that prevents one, or the nearest global
    batches the ranks can split."""
    keep = list(args.elastic_keep or [])
    blocked_by_keep, indivisible, refusals = [], [], []
    for overrides in candidate_layouts(args):
        changed_kept = _kept(args, overrides, keep)
        if changed_kept:  # elastic_keep rules this layout out before anything else is asked of it
            blocked_by_keep.append(changed_kept[0])
            continue
        candidate = dataclasses.replace(args, **overrides)
        try:
            layout, _, _, _ = check_layout_and_model(candidate, world_size, device)
        except UsageError as error:
            refusals.append(str(error))
            continue
        if global_batch is None:  # no checkpoint: no global batch to keep, the file's per-replica batch
            per_replica = args.per_device_train_batch_size * args.gradient_accumulation_steps
        elif global_batch % layout.data_replicas:
            indivisible.append(layout.data_replicas)
            continue
        else:
            per_replica = global_batch // layout.data_replicas
        micro, accumulation = _micro_and_accumulation(args, per_replica)
        overrides = dict(overrides, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
        changed_kept = _kept(args, overrides, keep)
        if changed_kept:
            blocked_by_keep.append(changed_kept[0])
            continue
        candidate = dataclasses.replace(args, **overrides)
        layout, config, _, _ = check_layout_and_model(candidate, world_size, device)  # the micro-batch too
        if fits is not None:
            try:
                fits(candidate, config, layout, device)
            except UsageError as error:
                refusals.append(str(error))
                continue
        changes = {key: [getattr(args, key), value] for key, value in overrides.items()
                   if _degree(getattr(args, key)) != _degree(value) and key not in ("sharding_degree",)}
        return candidate, changes
    if indivisible:
        replicas = min(indivisible)
        nearest = " or ".join(map(str, nearest_global_batches(global_batch, replicas)))
        raise UsageError(f"elastic: the global batch {global_batch} cannot be split over the {world_size} ranks left "
                         f"({replicas} data replicas); the nearest global batches they can split: {nearest}")
    if blocked_by_keep:
        key = blocked_by_keep[0]
        why = f" ({refusals[0]})" if refusals else ""
        raise UsageError(f"elastic_keep: {key} {getattr(args, key)} cannot be kept on {world_size} ranks{why}; remove "
                         "it from elastic_keep or bring the ranks back")
    # the last candidate's refusal: the lowest degrees, the layout that asks least of the ranks
    raise UsageError(f"elastic: no layout of this run fits on {world_size} ranks: {refusals[-1]}")


def describe_change(changes: dict, world_size: int, why: str, global_batch: int) -> str:
    """The one line the preflight prints."""
    what = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items()) or "no key changes"
    return f"elastic: {why}; continuing on {world_size} ranks with {what}, global batch {global_batch}"


# ----------------------------------------------------------------------------- the planner's view (GPUs)
def kept_values(args: Arguments, keep: list[str]) -> dict:
    return {key: _degree(getattr(args, key)) if isinstance(getattr(args, key), int) else getattr(args, key)
            for key in keep}


def holds(arguments: dict, kept: dict) -> bool:
    """Whether a search result's argument dict keeps every elastic_keep value."""
    candidate = Arguments(**arguments)
    return all((_degree(getattr(candidate, key)) if isinstance(value, int) and not isinstance(value, bool)
                else getattr(candidate, key)) == value for key, value in kept.items())


def elastic_table(args: Arguments, device: str, gpus: int, gpus_per_node: int, headroom: float,
                  cluster_options: dict | None = None) -> dict:
    """For gpus, gpus - gpus_per_node, ... down to one node: the best layout search finds for the same
    model, sequence length and global batch (that of `args` on `gpus`) holding elastic_keep; and the
    smallest of those counts on which one fits."""
    from llm_pretrain.planner.search import search

    global_batch = global_batch_size(args, gpus)
    kept = kept_values(args, list(args.elastic_keep or []))
    rows = []
    for count in range(gpus, 0, -gpus_per_node):
        result = search(args.model_name_or_path, device, count, args.max_seq_length, global_batch, gpus_per_node,
                        top=10**9, headroom=headroom, cluster_options=cluster_options)
        held = [r for r in result["top"] if holds(r["arguments"], kept)]
        row = {"gpus": count, "nodes_lost": (gpus - count) // gpus_per_node, "best": held[0] if held else None,
               "fitting": len(held), "valid": result["examined"] - result["refused_by_trainer"]}
        if not held:
            row["why"] = ("no valid layout keeps the global batch" if not row["valid"]
                          else "no layout holding elastic_keep fits" if kept and result["fitting"]
                          else "no valid layout fits in memory")
        rows.append(row)
    fitting_counts = [row["gpus"] for row in rows if row["best"]]
    return {"global_batch_size": global_batch, "seq": args.max_seq_length, "model": args.model_name_or_path,
            "device": device, "gpus_per_node": gpus_per_node, "kept": kept, "rows": rows,
            "smallest_fitting": min(fitting_counts) if fitting_counts else None}
