"""Step time of a layout on a GPU cluster: compute, tensor-parallel collectives, pipeline bubble,
data-parallel / sharding gradient traffic.

    micro-batch time  t_mb = compute + TP collectives + pipeline send/recv     (nothing overlaps)
    pipeline          (m + (p - 1) / v) * t_mb       bubble (p - 1) / (v m) of the m micro-batches
    gradients         data-parallel all-reduce / sharding reduce-scatter + all-gather: overlapped with
                      the backward without pipeline parallelism (paddle.DataParallel's reducer starts
                      each fused group when it is ready), after the pipeline flush with it (fleet's
                      HybridParallelOptimizer reduces after train_batch; PaddleNLP's
                      enable_dp_comm_overlap is off by default). Stage 3 also gathers every sliced
                      weight for the forward and again for the backward of each micro-batch.
    sequence split    segment parallelism (sep): 4 all-to-alls per layer forward (q, k, v to heads, the
                      output back) and 4 backward, not overlapped; context parallelism (cp): per layer
                      cp - 1 ring steps forward (k, v) and cp backward (k, v, dk, dv; dk, dv home), each
                      step's transfer overlapping the attention of the block in hand (exposed: only
                      what a step's transfer takes beyond that block's compute; with document masks
                      the blocks they remove entirely are skipped and their steps expose the whole
                      transfer, `ring_steps_kept`). Each rank computes 1/(sep x cp) of the tokens.
    additive mask     ALiBi under flash attention: the kernel reads its [b, heads, s, s] mask from device
                      memory in forward, backward and a recomputed forward (`additive_mask_time`).
    optimizer step    neglected (AdamW reads/writes ~16 bytes per parameter: ~1 % of a step at the
                      Megatron table's sizes)

Compute is `training_flops_per_token` of llm_pretrain/observe/flops.py (recompute included) at a fraction
of the device's peak (`matmul_efficiency`). Collectives run at ring-algorithm volumes:
all-reduce 2 (n-1)/n x bytes, all-gather / reduce-scatter (n-1)/n x bytes, over NVLink when the
group lies inside a node and over InfiniBand otherwise.

Calibration (the only fitted numbers are in MATMUL_EFFICIENCY, one pair for every model): the ten
rows of Narayanan et al. 2021, Table 1 (`CALIBRATION_SOURCE`), reproduced by tests/test_planner.py
and listed with their errors in benchmarks/planner_accuracy.md.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from llm_pretrain.observe.flops import device_peak_tflops, model_flops_per_token, recompute_flops_args, training_flops_per_token
from llm_pretrain.planner.memory import Setup

CALIBRATION_SOURCE = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
                      "Megatron-LM (SC21), Table 1: GPT 1.7B-1T, seq 2048, vocab 51200, fp16, A100-80GB DGX nodes")
# That table as published (its columns: data/README.md), shipped with the package.
MEGATRON_TABLE1 = Path(__file__).resolve().parent / "data" / "megatron_table1.csv"

# Achievable fraction of the dense tensor-core peak for the matrix products of one GPU, growing with the
# width of its matrices (hidden / tp): eff = EFF_MAX * w / (w + EFF_HALF_WIDTH). Fitted once on the Megatron
# table (scripts/planner_accuracy.py --calibrate prints the fit); not per model.
EFF_MAX = 0.63
EFF_HALF_WIDTH = 100.0
# With these, the ten rows are reproduced within 15 % (worst: 1.7B, +14.6 %; 8 of 10 within 7.5 %).
MEGATRON_TOLERANCE = 0.15

# Link bandwidths per GPU, one direction, GB/s (gigabytes). NVLink: A100 (NVLink 3, NVSwitch) 600 GB/s
# bidirectional -> 300, H100 (NVLink 4) 900 -> 450 (NVIDIA A100/H100 datasheets); nccl-tests reach ~80 % of
# it as bus bandwidth. InfiniBand: DGX A100 has one HDR 200 Gb/s NIC per GPU = 25 GB/s, DGX H100 one NDR
# 400 Gb/s per GPU = 50 GB/s (DGX user guides).
DEFAULT_LINKS = {
    "A100": (240.0, 25.0), "A800": (160.0, 25.0),  # A800: NVLink cut to 400 GB/s bidirectional
    "H100 SXM": (360.0, 50.0), "H800": (160.0, 50.0), "H200": (360.0, 50.0),
    "V100": (120.0, 12.5),  # NVLink 2: 300 GB/s bidirectional; EDR 100 Gb/s per GPU
}
FALLBACK_LINKS = (100.0, 12.5)
DEFAULT_GPUS_PER_NODE = 8
# Device memory (HBM) bandwidth per GPU, GB/s, NVIDIA datasheets: A100 80GB SXM 2,039 (40GB: 1,555),
# A800 as A100, H100 SXM and H800 SXM 3,350, H200 4,800, V100 SXM2 900.
HBM_GBPS = {"A100": 2039.0, "A800": 2039.0, "H100 SXM": 3350.0, "H800": 3350.0, "H200": 4800.0, "V100": 900.0}
HBM_GBPS_A100_40G = 1555.0
FALLBACK_HBM_GBPS = 1555.0


@dataclass
class Cluster:
    device: str  # "A100-80G", "H100-80G", ...
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    intra_node_gbps: float | None = None  # GB/s per GPU; None: DEFAULT_LINKS for the device
    inter_node_gbps: float | None = None

    def hbm_gbps(self) -> float:
        from llm_pretrain.observe.flops import match_device

        key = match_device(self.device) or ""
        if key == "A100" and "40G" in self.device.upper():
            return HBM_GBPS_A100_40G
        return HBM_GBPS.get(key, FALLBACK_HBM_GBPS)

    def links(self) -> tuple[float, float]:
        from llm_pretrain.observe.flops import match_device

        default = DEFAULT_LINKS.get(match_device(self.device) or "", FALLBACK_LINKS)
        return (self.intra_node_gbps or default[0], self.inter_node_gbps or default[1])


def matmul_efficiency(width: float) -> float:
    return EFF_MAX * width / (width + EFF_HALF_WIDTH)


def _ring(kind: str, n: int, nbytes: float, gbps: float) -> float:
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / (gbps * 1e9)


def step_time(setup: Setup, cluster: Cluster, overlap_gradient_comm: bool = True) -> dict:
    """Seconds per optimizer step on the slowest pipeline stage, by term, and the derived rates."""
    c, p = setup.config, setup.precision
    tp, pp, vpp, dp, sd = setup.tp, setup.pp, setup.vpp, setup.dp, setup.sharding_degree
    dtype = p.compute if p.half else "fp32"
    peak = device_peak_tflops(cluster.device, dtype)
    if peak is None:
        raise ValueError(f"no peak TFLOPs for device {cluster.device} at {dtype}")
    intra, inter = cluster.links()
    node = cluster.gpus_per_node
    s, b, m = c.seq_length, setup.micro_batch, setup.accumulation
    split = setup.sep * setup.cp
    tokens_mb = b * s // split  # this rank's tokens of a micro-batch
    act_bytes = p.activation_bytes

    documents = setup.mean_document_length  # document masks: attention within documents only
    hardware_flops = training_flops_per_token(c, s, **recompute_flops_args(c),
                                              mean_document_length=attention_keys_computed(setup))
    flops_rate = peak * 1e12 * matmul_efficiency(c.hidden_size / tp)
    # Expert parallelism: per MoE layer (dense layers send nothing; the last stage also routes in the MTP block)
    # the dispatch and the combine all-to-alls forward and their two backward ones, each moving the k rows of
    # every token of which (ep - 1)/ep leave the rank (models/moe.py); the expert-parallel ranks are
    # data-parallel ranks, in one node when they fit. Group-limited routing (n_group / topk_group, DeepSeek-V3)
    # bounds the groups, hence the ranks and nodes, a token's k picks reach, but this dispatch (alltoall_single
    # over (token, expert) pairs, models/moe.py dispatch_and_combine) sends one row per pick whatever its
    # destination: still k rows, of which (ep - 1)/ep leave the rank (`expert_all_to_all_bytes`).
    ep = c.expert_parallel_degree if c.is_moe else 1
    ep_link = intra if tp * ep <= node else inter
    a2a_bytes = expert_all_to_all_bytes(c, tokens_mb, ep, act_bytes)
    a2a_layer = 4 * a2a_bytes / (ep_link * 1e9) if ep > 1 else 0.0
    # The slowest stage sets the pace: the one whose layers' compute and all-to-alls take longest, i.e. the one
    # with the most decoder layers when every layer is alike (layout.pipeline_split; an even split gives every
    # stage num_hidden_layers / pp, the calibrated case). DeepSeek-V3's first stage holds its dense layers.
    stage_layer_counts = [sum(map(len, setup.stage_chunks(stage))) for stage in range(pp)] if pp > 1 else [c.num_hidden_layers]
    stage_moe_layers = [moe_layers_on_stage(setup, stage) for stage in range(len(stage_layer_counts))]
    layer_compute = hardware_flops * tokens_mb / (tp * c.num_hidden_layers) / flops_rate
    slowest_stage = max(range(len(stage_layer_counts)),
                        key=lambda i: stage_layer_counts[i] * layer_compute + stage_moe_layers[i] * a2a_layer)
    layers_per_stage = stage_layer_counts[slowest_stage]
    ep_mb = stage_moe_layers[slowest_stage] * 4 * a2a_bytes / (ep_link * 1e9) if ep > 1 else 0.0
    imbalance = layers_per_stage * pp / c.num_hidden_layers
    compute_mb = hardware_flops * tokens_mb / (tp * pp) * imbalance / flops_rate
    sequence_mb = sequence_split_time(setup, cluster, tokens_mb, flops_rate)
    mask_mb = additive_mask_time(setup, cluster, layers_per_stage)

    # Tensor parallelism: per layer 2 all-reduces forward (attention, MLP outputs) and 2 backward (their
    # inputs' gradients), 2 more for a recomputed forward; sequence parallelism replaces each all-reduce by
    # an all-gather + reduce-scatter (same volume). Kept inside a node when tp <= gpus_per_node.
    tp_link = intra if tp <= node else inter
    collectives = 4 + (2 if c.recompute and c.recompute_granularity in ("full", "full_attn") else 0)
    tp_mb = layers_per_stage * collectives * _ring("all_reduce", tp, tokens_mb * c.hidden_size * act_bytes, tp_link)
    if c.is_moe and c.sequence_parallel and tp > 1:
        # models/moe.py under SP: the experts keep tensor parallelism's all-reduces (counted above as the MLP's),
        # and the block adds an all-gather of its input forward and of its output's gradient backward.
        tp_mb += layers_per_stage * 2 * _ring("all_gather", tp, tokens_mb * c.hidden_size * act_bytes, tp_link)

    # Pipeline: each micro-batch's activation goes forward and its gradient back across a stage boundary;
    # stages lie in different nodes once tp * pp exceeds a node.
    pp_link = intra if tp * pp <= node else inter
    p2p_bytes = tokens_mb * c.hidden_size * act_bytes / (tp if c.sequence_parallel else 1)
    pp_mb = 2 * p2p_bytes / (pp_link * 1e9) if pp > 1 else 0.0

    micro = compute_mb + tp_mb + pp_mb + ep_mb + sequence_mb + mask_mb
    pipeline = m * micro
    # Bubble: 1F1B fills and drains the pipeline in (p - 1) micro-batch times; the interleaved schedules
    # (PipelineParallelWithInterleave, its FthenB and VPPFhenBInBalancedMemory variants) in (p - 1) chunk
    # times of 1/v of a stage; DualPipeV's V runs two chunks of half a stage per device, so its fill and
    # drain also take (p - 1) half-stage times. Weight-gradient splitting (zero bubble) needs fleet's
    # SplitBWLinear layers, which this decoder does not use: no W term.
    chunks = 2 if setup.dualpipev else vpp
    bubble = (pp - 1) / chunks * micro if pp > 1 else 0.0

    # Gradient traffic of the rank holding the most parameters (the first stage).
    # (Under expert parallelism the experts' gradients are not all-reduced: each is on one rank.)
    params = sum(q.numel for q in setup.stage_parameters(0) if ep == 1 or ".experts." not in q.name)
    grad_bytes = params * (4 if (p.master_grad or not p.half or p.level == "O1") else 2)
    replicas_link = intra if tp * pp * dp * sd * split <= node else inter
    data = _ring("all_reduce", dp, grad_bytes, replicas_link)
    sharding = _ring("all_reduce", sd, grad_bytes, replicas_link) if setup.sharding_stage else 0.0
    if setup.sharding_stage == 3:
        # gather the weights for forward and backward of every micro-batch
        sharding += 2 * m * _ring("all_gather", sd, params * p.param_bytes, replicas_link)
    gradient_comm = data + sharding
    if pp == 1 and overlap_gradient_comm:
        backward = 2 / 3 * compute_mb  # the last micro-batch's backward hides the reduce of earlier groups
        exposed = max(0.0, gradient_comm - backward)
    else:
        exposed = gradient_comm
    total = pipeline + bubble + exposed

    world = setup.world_size
    tokens_per_card = b * m * dp * sd * s / world / total
    model_flops = model_flops_per_token(c, s, mean_document_length=documents)
    terms = {
        "compute": m * compute_mb,
        "tensor-parallel communication": m * tp_mb,
        "pipeline send/recv": m * pp_mb,
        "expert-parallel all-to-all": m * ep_mb,
        "sep all-to-all / cp ring (exposed)": m * sequence_mb,
        "flash attention's additive mask (ALiBi) reads": m * mask_mb,
        "pipeline bubble": bubble,
        "data-parallel/sharding communication (exposed)": exposed,
    }
    return {
        "step_time_s": total,
        "terms": terms,
        "tokens_per_card_per_sec": tokens_per_card,
        "tflops_per_card": model_flops * tokens_per_card / 1e12,
        "hardware_tflops_per_card": hardware_flops * tokens_per_card / 1e12,
        "mfu": model_flops * tokens_per_card / (peak * 1e12),
        "peak_tflops": peak,
        "bottleneck": bottleneck(terms),
        "slowest_stage": slowest_stage,
    }


def expert_all_to_all_bytes(config, tokens: int, ep: int, act_bytes: int) -> float:
    """Bytes these tokens send to other ranks in one expert-parallel all-to-all (models/moe.py): a row of h values
    per (token, expert) pair, k per token, of which (ep - 1)/ep leave the rank when the load is balanced. With
    group-limited routing each token's picks lie in topk_group of the n_group groups of consecutive experts,
    each group on ep / n_group ranks (DeepSeek-V3 at ep 32: 4 of 8 groups, at most 16 of 32 ranks, and at most
    4 nodes, the report's M = 4, sec. 2.1.2): that bounds where rows go, not how many this dispatch sends, since
    it does not merge a token's picks on one rank or node into one row (DeepSeek's DeepEP does, report sec. 3.2:
    then at most M rows per token cross the nodes)."""
    return tokens * config.num_experts_per_tok * config.hidden_size * act_bytes * (ep - 1) / ep


def moe_layers_on_stage(setup: Setup, stage: int) -> int:
    """Decoder layers with the mixture of experts on this pipeline stage (pp 1: all), plus the MTP block's on
    the last stage when it is one (models/pipeline.py: MTP on the last stage)."""
    c = setup.config
    layers = [i for chunk in setup.stage_chunks(stage) for i in chunk] if setup.pp > 1 else range(c.num_hidden_layers)
    mtp = range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers) if stage == setup.pp - 1 else ()
    return sum(c.is_moe_layer(i) for i in (*layers, *mtp))


def additive_mask_time(setup: Setup, cluster: Cluster, layers: int) -> float:
    """Seconds per micro-batch the flash kernel spends reading an additive mask (ALiBi), beyond its FLOPs.

    A causal model calls flash attention with is_causal and no mask; ALiBi goes in as an additive mask,
    [batch, heads / tp (/ sep), queries, keys] in the compute dtype (models/decoder.py flash_attention, as
    PaddleNLP 2.8.1's llama/modeling.py scaled_dot_product_attention), which the kernel reads from device
    memory in the forward and again in the backward (flash_attn_grad takes it too), and once more in a
    recomputed forward: 2-3 reads of b x h x s x s elements per layer, at HBM bandwidth. That mask is one
    tensor shared by every layer (models/constants.py), so building it costs nothing per layer. Under cp the
    ring reads its blocks' masks over this rank's rectangle (queries s / cp x keys s); the per-block builds are
    not counted. Baichuan2-13B at 4,096 tokens: 40 heads x 4096^2 x 2 bytes = 1.3 GB per read, 3 reads per
    layer, ~2 ms per layer on an A100 (~3 % of its step).

    Without flash attention no term: the plain path materialises the scores of every model alike (ALiBi only
    adds its bias to them), and that traffic is in the calibration, whose Megatron runs materialise theirs."""
    c, p = setup.config, setup.precision
    if c.position_embedding != "alibi" or not c.use_flash_attention:
        return 0.0
    heads = c.num_attention_heads / (setup.tp * setup.sep)
    mask_bytes = setup.micro_batch * heads * (c.seq_length / setup.cp) * c.seq_length * p.activation_bytes
    recomputed = c.recompute and c.recompute_granularity in ("full", "full_attn", "core_attn")
    reads = 3 if recomputed else 2
    return layers * reads * mask_bytes / (cluster.hbm_gbps() * 1e9)


def sequence_split_time(setup: Setup, cluster: Cluster, tokens: int, flops_rate: float) -> float:
    """Seconds per micro-batch of the sep all-to-alls or the exposed part of the cp ring (see the module
    docstring); 0 without a sequence split. The group lies inside a node when tp x degree fits in one."""
    c, p = setup.config, setup.precision
    degree = setup.sep * setup.cp
    if degree == 1:
        return 0.0
    intra, inter = cluster.links()
    link = intra if setup.tp * degree <= cluster.gpus_per_node else inter
    layers = c.num_hidden_layers / setup.pp
    q_width, kv_width = c.hidden_size / setup.tp, c.num_key_value_heads * c.head_dim / setup.tp
    # (q, k, v, output) widths per token on this rank; latent attention (models/mla.py) moves its heads' q and k of
    # qk_nope + qk_rope (k_pe expanded to every head), v and the output of v_head_dim, not hidden_size's
    widths = (q_width, kv_width, kv_width, q_width)
    attention_width = 2 * q_width  # q . k and p . v over every head (GQA's k and v repeated)
    if c.uses_mla:
        heads = c.num_attention_heads / setup.tp
        qk, v = heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), heads * c.v_head_dim
        widths, attention_width = (qk, qk, v, v), qk + v
    forwards = 2 if c.recompute and c.recompute_granularity in ("full", "full_attn") else 1
    a = p.activation_bytes
    if setup.sep > 1:
        # all-to-all: each rank sends (n - 1) / n of its q, k, v (and receives as much), then of the output.
        volume = tokens * sum(widths) * a * (degree - 1) / degree
        return layers * (forwards + 1) * volume / (link * 1e9)
    # Ring: a step moves one k/v block (forward) or k, v and their float32 gradients (backward) to the
    # neighbour while the block in hand is computed: 1/cp of the layer's attention (2x in backward). A block
    # that document masks remove entirely is skipped (models/ring_attention.py DocumentBlocks) but its transfer
    # still runs (the ring passes every block on): a skipped step exposes its whole transfer.
    block = tokens * (widths[1] + widths[2])  # k and v
    attention_step = 2 * tokens * tokens * attention_width / 2 / flops_rate  # causal: half of a (local x local) block
    kept = ring_steps_kept(c.seq_length, degree, setup.micro_batch, setup.mean_document_length)
    forward_transfer, backward_transfer = block * a / (link * 1e9), block * (a + 4) / (link * 1e9)
    # forward: the transfers of steps 0 .. cp - 2 overlap those steps' blocks; backward: cp steps (k, v and the
    # gradients of the block in hand)
    # (written so that without documents, every k = 1, the sums add exact zeros to the full-ring terms)
    exposed_forward = max(0.0, forward_transfer - attention_step)
    exposed_backward = max(0.0, backward_transfer - 2 * attention_step)
    forward = (degree - 1) * exposed_forward + sum((1 - k) * (forward_transfer - exposed_forward) for k in kept[:-1])
    backward = degree * exposed_backward + sum((1 - k) * (backward_transfer - exposed_backward) for k in kept)
    return layers * (forwards * forward + backward)


def attention_keys_computed(setup: Setup) -> float | None:
    """The keys per query the attention kernels compute with document masks (the `mean_document_length` that
    training_flops_per_token's hardware count takes; None: the whole sequence). Model FLOPs count the mean
    document length whatever the path; the hardware computes:
    - flash attention (Paddle's flashmask_attention, also after sep's all-to-all): the mean document length;
    - the cp ring's flash blocks (FlashMask per block, models/ring_attention.py FlashMaskBlocks): as flash;
    - the cp ring's plain blocks: every block it does not skip, whole (its partial blocks take the mask as a
      bias): s x (blocks kept / blocks), `ring_steps_kept`;
    - the plain path in one piece: the whole sequence (a dense mask, every score computed)."""
    c = setup.config
    if setup.mean_document_length is None:
        return None
    if setup.cp > 1 and not c.use_flash_attention:
        kept = ring_steps_kept(c.seq_length, setup.cp, setup.micro_batch, setup.mean_document_length)
        return c.seq_length * sum(kept) / setup.cp
    return setup.mean_document_length if c.use_flash_attention else None


def ring_steps_kept(seq_length: int, degree: int, micro_batch: int = 1,
                    mean_document_length: int | None = None) -> list[float]:
    """For each of the cp ring's steps (0 .. cp - 1), the expected fraction of ranks that compute their block
    (the others skip it: document masks remove it entirely); all 1.0 without documents.

    The ring (models/ring_attention.py) cuts each sequence of s tokens into 2 cp chunks of C = s / (2 cp);
    rank r holds chunks r and 2 cp - 1 - r; at step t it holds the k/v of owner o = (r - t) mod cp. Step 0
    (its own chunks, causal) is never skipped. At a later step the block is: owner o < r, both its query
    chunks against the owner's first chunk o; owner o > r, its second query chunk 2 cp - 1 - r against both
    the owner's chunks. In either case the nearest chunk pair is g = |r - o| chunks apart (the others lie
    further), and the block is computed iff some document crosses from the key chunk into the query chunk of
    that pair: iff none of the (g - 1) C + 1 positions from the key chunk's end (exclusive) to the query
    chunk's start (inclusive) starts a document. Documents of length L cut at a uniform place:

        p(g) = max(0, 1 - ((g - 1) C + 1) / L)

    and a micro-batch of b sequences cut independently skips a block only if all of them do:
    P(g) = 1 - (1 - p(g))^b. Step t is at distance t on the ranks r >= t (cp - t of them) and cp - t on the
    others (t of them):

        kept(t) = ((cp - t) P(t) + t P(cp - t)) / cp,    kept(0) = 1

    so the ring's blocks kept in total (forward, every rank) are cp + sum_t cp kept(t) of cp^2. Skewed lengths
    differ (a long document keeps more blocks than its mean says); tests/test_planner.py checks the formula
    against a brute-force count over packed sequences."""
    if mean_document_length is None or degree == 1:
        return [1.0] * degree
    chunk = seq_length / (2 * degree)

    def kept_at(distance: int) -> float:
        p = max(0.0, 1 - ((distance - 1) * chunk + 1) / mean_document_length)
        return 1 - (1 - p) ** micro_batch

    return [1.0] + [((degree - t) * kept_at(t) + t * kept_at(degree - t)) / degree for t in range(1, degree)]


def bottleneck(terms: dict[str, float]) -> str:
    names = {"compute": "compute", "tensor-parallel communication": "TP communication",
             "pipeline send/recv": "pipeline send/recv", "pipeline bubble": "bubble",
             "expert-parallel all-to-all": "expert all-to-all",
             "sep all-to-all / cp ring (exposed)": "sep/cp communication",
             "data-parallel/sharding communication (exposed)": "DP communication"}
    non_compute = {k: v for k, v in terms.items() if k != "compute"}
    worst = max(non_compute, key=non_compute.get)
    # Compute-bound unless one overhead is at least a quarter of the compute.
    return names[worst] if non_compute[worst] >= 0.25 * terms["compute"] else "compute"


def megatron_table1_rows() -> list[dict]:
    """The rows of MEGATRON_TABLE1, as csv.DictReader gives them (strings)."""
    with open(MEGATRON_TABLE1, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def megatron_row_setup(row: dict, micro_batch: int = 1) -> tuple[Setup, Cluster]:
    """A Megatron Table 1 row as a Setup: GPT (GELU 4h MLP, learned positions, tied head), fp16, full
    recompute, 1F1B (the table gives neither micro-batch size nor interleaving: micro-batch 1, no vpp)."""
    tp, pp, gpus = int(row["tensor_parallel"]), int(row["pipeline_parallel"]), int(row["gpus"])
    dp = gpus // (tp * pp)
    return published_gpt_setup(int(row["hidden_size"]), int(row["layers"]), int(row["attention_heads"]), tp, pp,
                               micro_batch, int(row["global_batch_size"]) // (dp * micro_batch), dp=dp)


def published_gpt_setup(hidden: int, layers: int, heads: int, tp: int, pp: int, micro_batch: int, accumulation: int,
                        dp: int = 1, vpp: int = 1, recompute_granularity: str | None = "full",
                        sequence_parallel: bool = False) -> tuple[Setup, Cluster]:
    """The GPT of NVIDIA's papers (GELU 4h MLP, learned positions, tied head, vocab 51,200, seq 2048) in
    fp16 on A100-80GB DGX nodes; recompute_granularity None: no recompute."""
    from llm_pretrain.planner.memory import Precision
    from models.registry import make_config

    config = make_config("gpt3", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, vocab_size=51200, max_position_embeddings=2048, seq_length=2048,
                         tensor_parallel_degree=tp, sequence_parallel=sequence_parallel,
                         recompute=recompute_granularity is not None,
                         recompute_granularity=recompute_granularity or "full")
    setup = Setup(config, micro_batch, accumulation, tp=tp, pp=pp, vpp=vpp, dp=dp,
                  precision=Precision("fp16", "O2", master_grad=True))
    return setup, Cluster("A100-80G")


# Korthikanti et al. 2022's recompute timings (data/README.md): a check of the recompute terms, not fitted on.
KORTHIKANTI_LAYER_OVERHEADS = Path(__file__).resolve().parent / "data" / "korthikanti_layer_overheads.csv"
KORTHIKANTI_END_TO_END = Path(__file__).resolve().parent / "data" / "korthikanti_end_to_end.csv"


def korthikanti_rows(path: Path) -> list[dict]:
    """The rows of one of the KORTHIKANTI_* tables (strings), without its '#' source lines."""
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def korthikanti_setup(row: dict, recompute_granularity: str | None, sequence_parallel: bool) -> tuple[Setup, Cluster]:
    """A row of KORTHIKANTI_END_TO_END (its Table 3 configuration: no data parallelism) as a Setup."""
    micro = int(row["micro_batch_size"])
    return published_gpt_setup(int(row["hidden_size"]), int(row["layers"]), int(row["attention_heads"]),
                               int(row["tensor_parallel"]), int(row["pipeline_parallel"]), micro,
                               int(row["global_batch_size"]) // micro, vpp=int(row["virtual_pipeline"]),
                               recompute_granularity=recompute_granularity, sequence_parallel=sequence_parallel)


def layer_time(setup: Setup, cluster: Cluster) -> float:
    """Seconds of the decoder layers' work in a step: compute and tensor-parallel collectives, the part
    that recompute lengthens (Korthikanti et al.'s Table 4 times one layer's forward + backward)."""
    terms = step_time(setup, cluster, overlap_gradient_comm=False)["terms"]
    return terms["compute"] + terms["tensor-parallel communication"]


def megatron_tflops(setup: Setup, cluster: Cluster) -> float:
    """Per-GPU TFLOP/s as the table counts them: 96 B s l h^2 (1 + s/6h + V/16lh) per iteration (with recompute)."""
    c = setup.config
    B = setup.micro_batch * setup.accumulation * setup.dp
    s, l, h, V = c.seq_length, c.num_hidden_layers, c.hidden_size, c.vocab_size
    flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    # Megatron-LM (2021) all-reduces the gradients after the last micro-batch's backward, not during it.
    return flops / step_time(setup, cluster, overlap_gradient_comm=False)["step_time_s"] / setup.world_size / 1e12


def fit_efficiency(rows: list[dict]) -> tuple[float, float, list[float]]:
    """Grid least-squares fit (log errors) of EFF_MAX (0.40-1.00 by 0.01) and EFF_HALF_WIDTH (0-1600 by 100)
    to the table's TFLOP/s; returns (EFF_MAX, EFF_HALF_WIDTH, relative error per row). A few minutes."""
    global EFF_MAX, EFF_HALF_WIDTH
    saved = EFF_MAX, EFF_HALF_WIDTH
    setups = [megatron_row_setup(r) for r in rows]
    best = None
    try:
        for half in range(0, 1601, 100):
            for eff in [x / 100 for x in range(40, 101)]:
                EFF_MAX, EFF_HALF_WIDTH = eff, float(half)
                errors = [math.log(megatron_tflops(*s) / float(r["tflops_per_gpu"])) for s, r in zip(setups, rows)]
                total = sum(e * e for e in errors)
                if best is None or total < best[0]:
                    best = (total, eff, float(half), [math.exp(e) - 1 for e in errors])
    finally:
        EFF_MAX, EFF_HALF_WIDTH = saved
    return best[1], best[2], best[3]
