"""Every layout the trainer accepts for a model on a GPU cluster, ranked by predicted tokens/card/s.

Candidates: tensor-parallel degree (inside a node unless allowed across), a sequence split (none,
segment parallelism sep or ring-attention context parallelism cp, of degrees dividing the rest),
pipeline degree with 1F1B or 2-4 virtual stages, sharding stage 0-3 with its degree, the data-parallel rest,
sequence parallelism with tensor parallelism, recompute none/full/full_attn/core_attn, and
micro-batch sizes dividing the global batch. Each candidate is an `Arguments` object checked by
the trainer's own functions (plan_layout, check_model_fits_layout, check_strategy): a layout
the trainer refuses never appears. Those whose predicted reserved memory stays under the card's
memory minus the headroom are kept and ranked.

Candidates are a product: `layout_degrees` (the degree tuples) x recompute x micro-batch. Memory prunes
before validation and timing, without changing the answer (`search`'s docstring): a layout whose weights
and optimizer states alone miss the limit is not validated, a valid candidate whose first pipeline stage
alone misses it is not timed, and stage parameters are built once per search (`_MemoSetup`).
(Llama-3.1-70B on 64 H100: 17,664 candidates, 7 s of CPU instead of 3 minutes.) A layout the trainer refuses by
its degrees is counted with all its variants at once (DeepSeek-V3: 64,400 candidates on 336 GPUs, 4,025 layouts).
`smallest` searches counts upwards and stops at the first on which a layout fits (`llm-plan search --gpus LOW-HIGH`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import re
import sys

from llm_pretrain.arguments import Arguments, validate_arguments
from llm_pretrain.errors import UsageError
from llm_pretrain.planner import device_memory_mb, estimate_setup
from llm_pretrain.planner.estimate import validated_setup
from llm_pretrain.parallel.layout import PROVEN_DEGREES, PROVEN_PAIRS, check_proven_layout, plan_layout
from llm_pretrain.planner.memory import MB, Setup, _sharding_ranks_to_check, rank_memory

DEFAULT_HEADROOM = 0.10  # keep 10 % of the card free (CUDA context, NCCL buffers, allocator growth)
RECOMPUTE_CHOICES = (None, "full_attn", "core_attn", "full")
PROGRESS_DELAY_S = 2  # search(progress=True) shows its bar once it has run this long
_PP_SD_EP = frozenset({"pipeline_parallel_degree", "sharding_parallel_degree", "expert_parallel_degree"})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def base_arguments(model: str, seq: int, device: str) -> dict:
    """The run-independent keys of a written file, in configs/ style (bf16 O2 on GPUs with bf16)."""
    from llm_pretrain.observe.flops import PEAK_TFLOPS, match_device

    bf16 = "bf16" in PEAK_TFLOPS.get(match_device(device) or "", {})
    return {
        "model_name_or_path": model, "tokenizer_name_or_path": model, "input_dir": "./data",
        "output_dir": "./output", "split": "949,50,1", "max_seq_length": seq,
        "learning_rate": 3e-05, "min_learning_rate": 3e-06, "weight_decay": 0.01, "warmup_ratio": 0.01,
        "max_grad_norm": 1.0, "max_steps": 1000, "logging_steps": 1, "save_steps": 1000, "eval_steps": 1000,
        "bf16": bf16, "fp16": not bf16, "fp16_opt_level": "O2", "amp_master_grad": True,
        "use_flash_attention": True, "do_train": True, "disable_tqdm": True,
    }


def _micro_batches(global_batch: int, replicas: int, max_micro_batch: int) -> list[int]:
    """Micro-batch sizes (powers of two up to max_micro_batch) that split the global batch over the replicas."""
    return [m for m in (2**k for k in range(max_micro_batch.bit_length())) if m <= max_micro_batch
            and global_batch % (replicas * m) == 0]


def layout_degrees(gpus: int, gpus_per_node: int, layers: int, allow_inter_node_tp: bool = False):
    """(tp, split_key, split, pp, vpp, stage, sd, dp, sp) of every layout of `gpus` GPUs, in search's order:
    tensor parallelism inside a node unless allowed across; no sequence split or sep / cp of a degree dividing
    the rest; pipeline degrees up to the layers (ones that do not divide them split them unevenly,
    layout.pipeline_split; one that would leave a stage empty is refused by check_strategy) with 1F1B or 2-4
    virtual stages; sharding stage 0-3 over every data replica (PaddleNLP's default degree) or, on small
    clusters (rest <= 64, the combinations multiply), over part of them with data parallelism across the
    groups; sequence parallelism whenever tp > 1."""
    for tp in _divisors(gpus):
        if tp > gpus_per_node and not allow_inter_node_tp:
            continue
        splits = [("", 1)] + [(key, d) for d in _divisors(gpus // tp) if d > 1
                              for key in ("sep_parallel_degree", "context_parallel_degree")]
        for split_key, split in splits:
            for pp in (p for p in _divisors(gpus // (tp * split)) if p <= layers):
                rest = gpus // (tp * pp * split)
                degrees = [d for d in _divisors(rest) if d > 1] if rest <= 64 else [rest]
                for vpp, stage in itertools.product([1] if pp <= 2 else [1, 2, 4], (0, 1, 2, 3)):
                    for sd in ([1] if stage == 0 else degrees):
                        yield tp, split_key, split, pp, vpp, stage, sd, rest // sd, tp > 1


def candidates(model: str, gpus: int, gpus_per_node: int, seq: int, global_batch: int, device: str,
               allow_inter_node_tp: bool = False, max_micro_batch: int = 8, documents: bool = False):
    """Arguments dicts of every combination, in search's order (the groups of `candidate_groups` one after
    another)."""
    for group in candidate_groups(model, gpus, gpus_per_node, seq, global_batch, device, allow_inter_node_tp,
                                  max_micro_batch, documents):
        yield from group


def candidate_groups(model: str, gpus: int, gpus_per_node: int, seq: int, global_batch: int, device: str,
                     allow_inter_node_tp: bool = False, max_micro_batch: int = 8, documents: bool = False):
    """For each layout of `layout_degrees`, the list of its Arguments dicts (validity is checked by `search`):
    that layout
    `layout_degrees` x recompute choices x micro-batch sizes, and with mixture-of-experts models the same
    with the experts split over the data-parallel ranks. documents: every candidate with reset_attention_mask
    (the trainer's checks then refuse the layouts that cannot honour document masks), its cp layouts on the
    ring's plain blocks (use_flash_attention false, as the search has timed them since before the ring's flash
    blocks took documents; FlashMask ring blocks are allowed, `estimate` times them). Within a group the dicts
    differ in VARIANT_KEYS and, for the experts' variants, in expert_parallel_degree only."""
    from models.registry import resolve_model

    config = resolve_model(model)[0]
    base = base_arguments(model, seq, device)
    if documents:
        base["reset_attention_mask"] = True
    for tp, split_key, split, pp, vpp, stage, sd, dp, sp in layout_degrees(
            gpus, gpus_per_node, config.num_hidden_layers, allow_inter_node_tp):
        replicas = dp * sd
        degrees = dict(tensor_parallel_degree=tp, pipeline_parallel_degree=pp, virtual_pp_degree=vpp,
                       sequence_parallel=sp)
        tail = dict(sharding=f"stage{stage}", sharding_parallel_degree=sd) if stage else {}
        if split_key:
            tail[split_key] = split
            if documents and split_key == "context_parallel_degree":
                tail["use_flash_attention"] = False
        # the experts split over the data-parallel ranks (models/moe.py)
        experts = config.is_moe and not stage and not split_key and dp > 1 and config.num_experts % dp == 0
        # or, under the pipeline, over the sharding ranks where that triple is proven (DeepSeek-V3's pp x sharding
        # stage 1 x ep, PaddleFormers' layout, and Qwen3-MoE's and ERNIE 4.5 MoE's: layout.py PROVEN_PAIRS); no other
        # family gets these candidates
        over_sharding = (config.is_moe and pp > 1 and dp == 1 and sd > 1 and not split_key and tp == 1
                         and config.num_experts % sd == 0
                         and stage in PROVEN_PAIRS.get(config.family, {}).get(_PP_SD_EP, ()))
        group = []
        for recompute, micro in itertools.product(RECOMPUTE_CHOICES,
                                                  _micro_batches(global_batch, replicas, max_micro_batch)):
            args = dict(base, **degrees, per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
                        gradient_accumulation_steps=global_batch // (replicas * micro),
                        recompute=recompute is not None, recompute_granularity=recompute or "full", **tail)
            group.append(args)
            if experts:
                group.append(dict(args, expert_parallel_degree=dp))
            if over_sharding:
                group.append(dict(args, expert_parallel_degree=sd))
        if group:
            yield group


def refusal_reason(message: str) -> str:
    """A refusal message with its numbers and lists replaced by N: one reason for many layouts."""
    return re.sub(r"\[[^\]]*\]|\d[\d,.]*", "N", message)


# Keys of a candidate that leave the weights, gradients and optimizer states of every rank unchanged: the variants
# of one layout that share a floor of memory (`_state_floor_mb`).
VARIANT_KEYS = frozenset({"per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                          "recompute", "recompute_granularity"})
# ModelConfig fields that differ between the candidates of one search but not in the parameters (params.py reads the
# architecture, the tensor-parallel and the expert-parallel degree only).
_NOT_IN_PARAMETERS = frozenset({"sequence_parallel", "recompute", "recompute_granularity"})


class _MemoSetup(Setup):
    """A Setup whose stage parameters and layer chunks are built once per search and shared by its candidates:
    memory.py and speed.py ask for them for every rank and term, and the parameter list of an 80-layer model
    takes milliseconds to build. Same values as Setup's (the memo is keyed on everything they depend on)."""

    @classmethod
    def of(cls, setup: Setup, memo: dict) -> "_MemoSetup":
        self = cls(**{f.name: getattr(setup, f.name) for f in dataclasses.fields(Setup)})
        config = self.config
        self._memo = memo
        self._architecture = repr([(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)
                                   if f.name not in _NOT_IN_PARAMETERS])
        return self

    def _remember(self, kind: str, stage: int, compute):
        key = (kind, self._architecture, self.tp, self.pp, self.vpp, stage, self.layers_per_stage, self.dualpipev)
        if key not in self._memo:
            self._memo[key] = compute(stage)
        return self._memo[key]

    def parameter_list(self):
        key = ("list", self._architecture, self.tp)
        if key not in self._memo:  # DeepSeek-V3's: 61 layers of 256 experts, a tenth of a second to build
            self._memo[key] = super().parameter_list()
        return self._memo[key]

    def stage_parameters(self, stage: int):
        return self._remember("parameters", stage, super().stage_parameters)

    def stage_chunks(self, stage: int):
        return self._remember("chunks", stage, super().stage_chunks)


def _first_rank_memory(setup: Setup):
    """The memory of one rank `peak_memory` checks (pipeline stage 0, its first sharding rank to check): its peak
    is at most the worst rank's, so the predicted reserved memory is at least this rank's peak."""
    return rank_memory(setup, 0, _sharding_ranks_to_check(setup, 0)[0])


def _state_floor_mb(values: dict, gpus: int, device: str, memo: dict) -> float | None:
    """At least the reserved memory (MiB) of every layout that differs from `values` only in VARIANT_KEYS: the
    persistent memory (weights, gradients, master weights, Adam moments, buffers) of one checked rank, which
    micro-batch size, accumulation and recompute do not change. Built without the trainer's checks (none is
    needed for a floor); None when the layout cannot even be set up or estimated (validation will say why)."""
    from llm_pretrain.planner.estimate import unchecked_setup

    try:
        setup = _MemoSetup.of(unchecked_setup(Arguments(**values), gpus, device), memo)
        return sum(_first_rank_memory(setup).persistent.values()) / MB
    except Exception:  # noqa: BLE001 -- unchecked, the layout may be one the trainer refuses: no floor, no pruning
        return None


def search(model: str, device: str, gpus: int, seq: int, global_batch: int, gpus_per_node: int = 8,
           top: int = 5, headroom: float = DEFAULT_HEADROOM, cluster_options: dict | None = None,
           allow_inter_node_tp: bool = False, closest: int = 5, progress: bool = False,
           mean_document_length: int | None = None, memo: dict | None = None) -> dict:
    """The fitting layouts, fastest first; and why the others were left out: `refusals` (the trainer's
    reasons, counted) and `closest` (the `closest` layouts that validate but miss the memory limit by the
    least: reserved and limit in MiB).

    mean_document_length: packed documents of that mean length with document masks: every candidate has
    reset_attention_mask (`candidates`) and is timed as `estimate` times it with --mean_document_length (the
    attention FLOPs within documents, the cp ring's skipped blocks); each row says the length.

    Pruning by memory before validation and timing, exact (the same `top` and `closest` as estimating every
    candidate): a layout whose memory floor already misses the limit by more than the `closest` misses kept so
    far is not estimated. The floors: per layout (all its micro-batch and recompute variants), the persistent
    memory of one rank, found before validation (`not_validated` counts those skipped); per candidate, after
    validation, the peak of one rank `peak_memory` checks (counted in `too_large`). Only the candidates left
    get the full estimate (every checked rank, then the step time). A layout the trainer refuses by its degrees
    (check_proven_layout) is refused with all its variants at once. progress: a tqdm bar on stderr when the
    search takes over 2 s. memo: a dict shared by searches of one model (`smallest`): the parameter lists and
    stage parameters _MemoSetup keeps, built once for every GPU count."""
    from tqdm import tqdm

    capacity = device_memory_mb(device)
    limit = capacity * (1 - headroom) if capacity is not None else None
    options = dict(cluster_options or {}, gpus_per_node=gpus_per_node)
    fitting, examined, refused, not_validated = [], 0, 0, 0
    reasons: dict[str, dict] = {}
    too_large: list[tuple[float, int, dict]] = []  # heap of (-excess, order, entry): the `closest` smallest
    memo = {} if memo is None else memo  # parameters and chunks shared by the candidates (_MemoSetup)
    floors: dict[tuple, float | None] = {}  # per layout (the candidate's keys but VARIANT_KEYS): _state_floor_mb
    # per layout: refused_by_degrees's message and its refusal_reason, None when proven
    degree_refusals: dict[tuple, tuple[str, str] | None] = {}

    def out_of_reach(floor_mb: float | None) -> bool:
        """A candidate needing at least floor_mb neither fits nor is among the closest misses: its excess would
        exceed every kept miss's (strictly: a tie would replace an earlier miss)."""
        if limit is None or floor_mb is None or floor_mb <= limit or len(too_large) < closest:
            return False
        return not too_large or floor_mb - limit > -too_large[0][0]

    groups = list(candidate_groups(model, gpus, gpus_per_node, seq, global_batch, device, allow_inter_node_tp,
                                   documents=mean_document_length is not None))
    from models.registry import resolve_model

    config = resolve_model(model)[0]

    def refused_by_degrees(values: dict) -> None:
        """The trainer's proven-degree refusal (check_proven_layout, one of validated_setup's checks) before the
        memory floor: for a family with PROVEN_DEGREES most layouts are refused, and DeepSeek-V3's floors (a
        671B-parameter setup each) took minutes. Same refusals, same picks; other families: nothing here."""
        if config.family in PROVEN_DEGREES:
            check_proven_layout(config, plan_layout(Arguments(**values), gpus), values.get("expert_parallel_degree", 1))
    def refuse(message: str, reason: str | None = None, count: int = 1) -> None:
        """Count `count` candidates refused with `message` (its refusal_reason if known already)."""
        nonlocal refused
        refused += count
        entry = reasons.setdefault(reason or refusal_reason(message), {"count": 0, "example": message})
        entry["count"] += count

    bar = tqdm(total=sum(map(len, groups)), desc="search", unit=" layouts", delay=PROGRESS_DELAY_S, file=sys.stderr,
               disable=not progress, dynamic_ncols=True, leave=False)
    for number, group in enumerate(groups):
        bar.update(len(group))
        # A candidate's layout (its keys but VARIANT_KEYS) is the group's, with or without the experts split: the
        # key (group number, split) names it without building a tuple of its items for each of 64,000 candidates.
        keys = [(number, "expert_parallel_degree" in values) for values in group]
        for key, values in zip(keys, group):
            if key not in degree_refusals:  # (the degrees are the same for a layout's variants)
                try:
                    refused_by_degrees(values)
                    degree_refusals[key] = None
                except UsageError as error:
                    degree_refusals[key] = (str(error), refusal_reason(str(error)))
        if all(degree_refusals[key] for key in keys):  # the whole group refused: counted at once, same order
            for key in dict.fromkeys(keys):
                refuse(*degree_refusals[key], count=keys.count(key))
            examined += len(group)
            continue
        for key, values in zip(keys, group):
            examined += 1
            if degree_refusals[key] is not None:
                refuse(*degree_refusals[key])
                continue
            if limit is not None:
                if key not in floors:
                    floors[key] = _state_floor_mb(values, gpus, device, memo)
                if out_of_reach(floors[key]):
                    not_validated += 1
                    continue
            try:
                args = Arguments(**values)
                validate_arguments(args)
                setup, layout, _ = validated_setup(args, gpus, device)
            except UsageError as error:
                refuse(str(error))
                continue
            setup = _MemoSetup.of(dataclasses.replace(setup, mean_document_length=mean_document_length), memo)
            if limit is not None and out_of_reach(_first_rank_memory(setup).peak_bytes / MB):
                continue  # valid and over the limit (counted in too_large)
            result = estimate_setup(setup, device, options)
            if limit is not None and result["peak_mem_reserved_mb"] > limit:
                excess = result["peak_mem_reserved_mb"] - limit
                entry = {"strategy": layout.strategy, "arguments": values, "reserved_mb": result["peak_mem_reserved_mb"],
                         "limit_mb": limit, "over_mb": excess, "peak_rank": result["peak_rank"]}
                heapq.heappush(too_large, (-excess, examined, entry))
                if len(too_large) > closest:
                    heapq.heappop(too_large)
                continue
            result["strategy"] = layout.strategy + (f"ep{values['expert_parallel_degree']}"
                                                    if values.get("expert_parallel_degree", 1) > 1 else "")
            result["arguments"] = values
            result["mean_document_length"] = mean_document_length
            fitting.append(result)
    bar.close()
    # Fastest first; among equally fast layouts the one with the most memory left.
    fitting.sort(key=lambda r: (-r["tokens_per_card_per_sec"], r["peak_mem_reserved_mb"]))
    refusals = sorted(({"reason": k, **v} for k, v in reasons.items()), key=lambda r: -r["count"])
    return {"examined": examined, "refused_by_trainer": refused, "not_validated": not_validated,
            "fitting": len(fitting), "headroom": headroom,
            "too_large": examined - not_validated - refused - len(fitting), "top": fitting[:top], "refusals": refusals,
            "closest": [entry for _, _, entry in sorted(too_large, key=lambda item: -item[0])]}


def node_counts(low: int, high: int, gpus_per_node: int) -> list[int]:
    """The GPU counts of whole nodes from low to high (as `llm-plan elastic` counts: nodes come whole)."""
    first = max(gpus_per_node, -(-low // gpus_per_node) * gpus_per_node)
    return list(range(first, high + 1, gpus_per_node))


def smallest(model: str, device: str, gpus: list[int], seq: int, global_batch: int, gpus_per_node: int = 8,
             progress: bool = False, **options) -> dict:
    """The smallest of the GPU counts `gpus` (ascending) on which a layout fits: `search`'s result on it (the
    same as searching that count alone) with "gpus" the count, and "smaller": each count searched before it with
    how many of its layouts the trainer accepts and its closest miss. None fits: "gpus" None, the last count's
    result. The searches share one memo (the model's parameter lists, built once)."""
    from tqdm import tqdm

    memo, smaller, result = {}, [], None
    for count in tqdm(gpus, desc="counts", unit=" counts", delay=PROGRESS_DELAY_S, file=sys.stderr,
                      disable=not progress, dynamic_ncols=True, leave=False):
        result = search(model, device, count, seq, global_batch, gpus_per_node, memo=memo, **options)
        if result["top"]:
            return dict(result, gpus=count, smaller=smaller)
        smaller.append({"gpus": count, "valid": result["examined"] - result["refused_by_trainer"],
                        "closest": result["closest"][0] if result["closest"] else None})
    return dict(result or {"top": []}, gpus=None, smaller=smaller)


def explain(result: dict) -> list[str]:
    """Lines saying why no layout was kept: the trainer's reasons with counts, then the closest misses."""
    lines = [f"{result['refused_by_trainer']} refused by the trainer's validation:"] if result["refusals"] else []
    lines += [f"  {r['count']:>6} x {r['example']}" for r in result["refusals"]]
    if result.get("not_validated"):
        lines.append(f"{result['not_validated']} not validated: their weights and optimizer states alone exceed the "
                     "limit by more than the closest misses below")
    if result["closest"]:
        lines.append(f"{result['too_large']} valid but over the memory limit ({100 * (1 - result['headroom']):.0f} % "
                     "of the card); the closest:")
        for c in result["closest"]:
            a = c["arguments"]
            recompute = a["recompute_granularity"] if a["recompute"] else "none"
            lines.append(f"  {c['strategy']} micro-batch {a['per_device_train_batch_size']}, recompute {recompute}: "
                         f"reserved {c['reserved_mb']:,.0f} MB > {c['limit_mb']:,.0f} MB by {c['over_mb']:,.0f} MB "
                         f"({100 * c['over_mb'] / c['limit_mb']:.1f} %) on {c['peak_rank']}")
    return lines


def file_strategy_name(arguments: dict) -> str:
    """The strategy part of a configs/ file name (data parallelism left out, as configs/README.md says)."""
    from llm_pretrain.parallel.layout import strategy_name

    stage = int(arguments["sharding"][-1]) if arguments.get("sharding") else 0
    return strategy_name(arguments.get("tensor_parallel_degree", 1), arguments.get("pipeline_parallel_degree", 1),
                         arguments.get("sharding_parallel_degree", 1) if stage else 1, stage,
                         arguments.get("virtual_pp_degree", 1), None, arguments.get("sep_parallel_degree", 1),
                         arguments.get("context_parallel_degree", 1))


def write_arguments(arguments: dict, path: str) -> str:
    """Write the chosen layout as an argument file. A directory (or a path ending in '/') gets the configs/
    name pretrain-<model>-<strategy>.json; the path written is returned."""
    import os

    if path.endswith(os.sep) or os.path.isdir(path):
        model = arguments["model_name_or_path"].rstrip("/").split("/")[-1].lower().replace("-", "_").replace(".", "_")
        path = os.path.join(path, f"pretrain-{model}-{file_strategy_name(arguments)}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(arguments, f, indent=4)
        f.write("\n")
    return path

