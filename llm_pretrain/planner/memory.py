"""Per-rank peak memory of a training run of this toolkit, tensor by tensor.

What a rank holds (bytes), from the code that allocates it:

    persistent   weights, gradients, fp32 master weights, Adam moments (by precision and
                 sharding stage), data-parallel / stage-2 gradient buffers
    activations  what the forward of each in-flight micro-batch keeps for backward
                 (`layer_activation_bytes`: every saved tensor of models/decoder.py by name)
    transients   the largest short-lived tensors at the moment of the peak: the weight gradient
                 of the head (or the largest weight) computed before it is added into .grad,
                 one fused communication buffer, stage 3's gathered weights

The peak is persistent + the largest of the phases "backward start" (all activations of the
in-flight micro-batches alive, the first weight gradient being computed), "recompute" (one
layer's activations rebuilt inside backward), "backward end" (the embedding's gradient) and
"optimizer step". Measured on CPU against Paddle's allocator statistics
(`host_memory_stat_peak_value`, tests/test_planner.py, benchmarks/planner_accuracy.md).

Constants and where they come from:

* Activations: which tensors each op keeps follows Paddle's eager grad nodes (matmul keeps both
  inputs, softmax keeps its output, silu keeps input and output, add/scale/transpose/reshape keep
  none); measured per term on llama-real (hidden 1024): 26.25 hidden-sized floats per token per
  layer at seq 128 (25 + the scores 8 x 128 / 1024 + the rotary tables), exactly as counted below.
* fleet's column-parallel linears (ColumnParallelLinear: mp_ops._c_identity; sequence-parallel
  ColumnSequenceParallelLinear: AllGatherOp, paddle/distributed/fleet/utils/
  sequence_parallel_utils.py:551) each keep their own [tokens, hidden] copy of the input.
* ClipGradByGlobalNorm scales gradients in place (paddle/nn/clip.py: `g.multiply_(clip_input)`),
  AdamW updates moments in place: the optimizer step adds no full-size temporaries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from llm_pretrain.planner.params import Param, parameter_list, stage_chunks, stage_parameters
from models.config import ModelConfig

MB = 2**20

# fleet.DistributedStrategy().fuse_grad_size_in_MB (default 32, paddle/fluid/framework/
# distributed_strategy.proto) is the DataParallel comm_buffer_size fleet passes
# (paddle/distributed/fleet/model.py:176): one such fused group is in flight while backward runs.
DP_FUSED_GROUP_BYTES = 32 * 2**20
# paddle.distributed.sharding.group_sharded_parallel defaults (paddle/distributed/sharding/group_sharded.py:58-59):
STAGE2_BUFFER_MAX_ELEMENTS = 2**23  # stage 2: gradients of parameters that fit go into GradStorage buffers
STAGE3_SEGMENT_ELEMENTS = 2**20  # stage 3: parameters with more elements are sliced over the ranks
# Stage 3 gathers a sliced weight for its forward and again for its backward, computes the full weight
# gradient and reduce-scatters it (group_sharded_stage3.py _allgather_buffer / _get_allreduce_fn): at the
# backward of the largest sliced weight four full-size copies are alive (measured on llama-real: 157.7 MiB
# above the activations-free baseline vs 4 x 32.5 + 31.8 activations).
STAGE3_FULL_COPIES = 4


# The persistent terms a checkpoint holds (gradients and communication buffers are not saved).
CHECKPOINTED_TERMS = ("weights", "master weights (fp32)", "Adam moments (fp32)")


@dataclass
class Precision:
    """dtype of weights/activations and what AMP adds (PaddleNLP's bf16/fp16, fp16_opt_level, amp_master_grad)."""

    compute: str = "fp32"  # "fp32" | "bf16" | "fp16"
    level: str = "O1"
    master_grad: bool = False

    @property
    def half(self) -> bool:
        return self.compute != "fp32"

    @property
    def param_bytes(self) -> int:
        # O2 casts the weights to half (paddle.amp.decorate level O2); O1 keeps fp32 weights.
        return 2 if self.half and self.level == "O2" else 4

    @property
    def grad_bytes(self) -> int:
        return self.param_bytes

    @property
    def activation_bytes(self) -> int:
        # O1 autocasts matmul outputs (and what follows them) to half; fp32 runs in fp32.
        return 2 if self.half else 4


@dataclass
class Setup:
    """Everything the memory of a rank depends on (built from an argument file by planner.estimate)."""

    config: ModelConfig  # with the run's runtime fields (seq_length, tp, sp, recompute, flash attention)
    micro_batch: int
    accumulation: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    sharding_degree: int = 1
    sharding_stage: int = 0
    precision: Precision = field(default_factory=Precision)
    sep: int = 1  # segment parallelism: 1/sep of the tokens per rank, all-to-all around attention
    cp: int = 1  # context parallelism: 1/cp of the tokens per rank, ring attention
    layers_per_stage: tuple[int, ...] | None = None  # explicit pipeline split (layout.pipeline_split)
    dualpipev: bool = False  # fleet's DualPipeV schedule (two chunks per stage in a V)
    # packed documents with document masks (reset_attention_mask): their mean length, which bounds the keys a
    # query attends to (llm_pretrain/observe/flops.py); None: every token attends to the whole sequence
    mean_document_length: int | None = None

    def parameter_list(self) -> list[Param]:
        """The whole model's parameters on one tensor-parallel rank (params.parameter_list)."""
        return parameter_list(self.config, self.tp)

    def stage_parameters(self, stage: int) -> list[Param]:
        if self.dualpipev:  # the embedding and the head are both on stage 0 (the V starts and ends there)
            layers = {i for chunk in self.stage_chunks(stage) for i in chunk}
            return [p for p in self.parameter_list()
                    if (p.part == "layer" and p.layer in layers) or (p.part != "layer" and stage == 0)]
        return stage_parameters(self.config, self.tp, self.pp, self.vpp, stage, self.layers_per_stage,
                                self.parameter_list())

    def stage_chunks(self, stage: int) -> list[list[int]]:
        return stage_chunks(self.config, self.pp, self.vpp, stage, self.layers_per_stage, self.dualpipev)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.sharding_degree * self.sep * self.cp

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one micro-batch this rank holds between layers (1/sep or 1/cp of each sequence)."""
        return self.micro_batch * self.config.seq_length // (self.sep * self.cp)


# Transient terms that are each one tensor (one allocator block); the others are sums of many tensors.
SINGLE_BLOCK_TERMS = ("weight gradient before accumulation", "embedding gradient before accumulation",
                      "squared gradient (grad norm)", "data-parallel fused group in flight")


@dataclass
class RankMemory:
    rank: str  # which rank (e.g. "pipeline stage 0, sharding rank 1")
    persistent: dict[str, float]  # bytes
    phases: dict[str, dict[str, float]]  # phase -> transient terms (bytes)
    largest_activation_tensor: float = 0.0  # bytes: the largest single tensor the forward keeps

    @property
    def largest_transient_block(self) -> float:
        """The largest short-lived single tensor of any phase: what the allocator may hold free but unusable
        at the peak (see planner.reserved_mb)."""
        blocks = [v for terms in self.phases.values() for k, v in terms.items() if k in SINGLE_BLOCK_TERMS]
        return max(blocks + [self.largest_activation_tensor])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_bytes(self) -> float:
        return sum(self.persistent.values()) + sum(self.phases[self.peak_phase].values())

    @property
    def checkpoint_state_bytes(self) -> float:
        """The host copy an asynchronous save holds while its background write runs (async_save,
        llm_pretrain/checkpoint/checkpointer.py save_async): the weights, master weights and Adam moments this rank
        holds; at most, as a rank copies only what it writes (one data-parallel replica writes)."""
        return sum(v for k, v in self.persistent.items() if k in CHECKPOINTED_TERMS)

    def breakdown(self) -> list[dict]:
        rows = [{"term": k, "mb": v / MB, "rank": self.rank, "phase": "persistent"} for k, v in self.persistent.items()]
        rows += [{"term": k, "mb": v / MB, "rank": self.rank, "phase": self.peak_phase}
                 for k, v in self.phases[self.peak_phase].items()]
        return rows


# ----------------------------------------------------------------------------- activations
def _norm_saved(config: ModelConfig, p: Precision) -> float:
    """Bytes per token a norm keeps besides its input: RMSNorm (decoder/parallel_layers.RMSNorm) keeps the
    float32 normalized x and its output (multiply keeps both inputs); under AMP also x cast to float32.
    LayerNorm keeps its input (already counted), mean and variance (per token) and the output."""
    h = config.hidden_size
    if config.norm_type == "rmsnorm" and config.use_fused_rms_norm:
        return p.activation_bytes * h + 4  # fused_rms_norm keeps its input and 1/rms per token
    if config.norm_type == "rmsnorm":
        return 4 * h + p.activation_bytes * h + (4 * h if p.half else 0)
    return p.activation_bytes * h + 8


def layer_activation_bytes(config: ModelConfig, setup: Setup, layer_index: int, recomputed: bool | None = None) -> float:
    """Bytes one decoder layer keeps for backward for one micro-batch (models/decoder.py DecoderLayer).

    recomputed: None -> as the run's recompute settings say for this layer; False -> everything
    (the layer rebuilt inside backward by full recompute)."""
    c, p = config, setup.precision
    a = p.activation_bytes
    tp = setup.tp
    sp = c.sequence_parallel and tp > 1
    tokens = setup.tokens_per_micro_batch
    local_tokens = tokens / tp if sp else tokens  # norms, residuals: this rank's chunk under SP
    h, d, s = c.hidden_size, c.head_dim, c.seq_length  # under sep, attention sees all s tokens of heads / sep
    heads = c.num_attention_heads // tp
    kv_heads = max(1, c.num_key_value_heads // tp)
    f = c.intermediate_size // tp
    granularity = None
    if recomputed is None and c.recompute and layer_index not in c.no_recompute_layers:
        granularity = c.recompute_granularity
    if granularity == "full":
        return local_tokens * a * h  # recompute() keeps only the layer's input

    # Residual stream and norms (per local token): layer input, norm 1, the residual after attention, norm 2.
    attention_norm = local_tokens * (a * h + _norm_saved(c, p))
    mlp_norm = local_tokens * (a * h + _norm_saved(c, p))
    # Column-parallel inputs: each projection keeps its own gathered / identity copy (module docstring).
    if tp > 1:
        attention_inputs = 1 if c.fuse_attention_qkv else (2 if c.num_key_value_heads < tp else 3)
        mlp_inputs = 2 if c.uses_swiglu and not c.fuse_attention_ffn else 1
        attention_copies, mlp_copies = tokens * a * h * attention_inputs, tokens * a * h * mlp_inputs
    else:
        attention_copies = mlp_copies = 0.0  # they share the norm's output
    # q/k rotary (decoder.apply_rotary casts to float32: multiply keeps x and rotate_half(x), 4 bytes each;
    # the cos/sin tables are built per layer). The fused GPU kernel keeps neither.
    q_size, kv_size = heads * d, kv_heads * d
    rope = c.position_embedding == "rope" and not c.use_fused_rope
    qk = tokens * 4 * 2 * (q_size + kv_size) if rope else 0.0
    tables = 2 * s * d * 4 if c.position_embedding == "rope" else 0.0
    gqa = kv_heads != heads
    if setup.cp > 1:
        # models/ring_attention.py RingAttention saves q, k, v (the rotary outputs), its output (in
        # the compute dtype, which is also the o_proj input, `out`) and the float32 log-sum-exp per
        # head and token; no scores are kept. The tables are indexed per rank.
        core = tokens * (a * (q_size + 2 * kv_size) + 4 * heads)
        gqa_saved = 0.0
        core_inputs = tokens * a * (q_size + 2 * kv_size)
        tables += 2 * tokens / setup.micro_batch * d * 4
    elif c.use_flash_attention and c.position_embedding != "alibi":
        # flash attention keeps q, k, v (repeated for GQA) and the log-sum-exp per head and token; its
        # output is the o_proj input (`out`).
        core = tokens * (a * 3 * q_size + 4 * heads)
        gqa_saved = 0.0
        core_inputs = tokens * a * (q_size + 2 * kv_size)
    else:
        # core_attention: q scaled (float32), k transposed and v transposed (matmul inputs), the softmax
        # output [b, heads, s, s] in float32 (+ its cast to the compute dtype under AMP).
        scores = tokens * heads * s * (4 + (a if p.half else 0))
        core = tokens * (4 * q_size + 4 * q_size + a * q_size) + scores
        gqa_saved = tokens * a * 2 * kv_size if gqa else 0.0  # repeat_interleave keeps k and v
        core_inputs = tokens * a * (q_size + 2 * kv_size)  # what recompute(core_attention, q, k, v) keeps
    out = tokens * a * q_size  # o_proj input
    if c.uses_mla:  # DeepSeek-V3's latent attention instead of the terms above
        attention_copies, qk, tables, core, core_inputs, out = _latent_attention_bytes(c, setup)
        gqa_saved = 0.0
    if c.is_moe:
        # models/moe.py: router logits and probabilities (float32, [tokens, E]); the k rows per token gathered
        # for the experts (and received by the all-to-all under expert parallelism), each expert's SwiGLU
        # on its rows, the rows' outputs scattered back and weighted; the shared expert on every token.
        pairs = tokens * c.num_experts_per_tok
        f_expert = c.expert_intermediate_size // tp
        router = tokens * 4 * 2 * c.num_experts
        computed = pairs  # rows the experts run on
        if c.moe_capacity_factor and c.expert_parallel_degree <= 1:
            # _fixed_capacity_experts: each expert on a block of min(capacity, tokens) rows (zeros where no pair)
            whole_pairs = pairs * setup.sep * setup.cp
            computed = c.num_experts * min(math.ceil(c.moe_capacity_factor * whole_pairs / c.num_experts), tokens)
        rows = (pairs + computed + (pairs if c.expert_parallel_degree > 1 else 0)) * a * h
        mlp = router + rows + computed * a * 4 * f_expert + pairs * 4 * 2
        if c.shared_expert_intermediate_size:
            mlp += tokens * a * (4 * c.shared_expert_intermediate_size // tp + 2 * h)
    elif c.uses_swiglu:
        mlp = tokens * a * 4 * f  # gate, up, silu(gate) (kept by silu and the product), silu * up
    else:
        mlp = tokens * a * 2 * f  # up (kept by gelu), gelu(up)
    attention_block = attention_norm + attention_copies + qk + gqa_saved + core + out + tables
    mlp_block = mlp_norm + mlp_copies + mlp
    if granularity == "full_attn":
        return local_tokens * a * h + mlp_block  # the attention block is recomputed from its input
    if granularity == "core_attn":
        return attention_block - core - gqa_saved + core_inputs + mlp_block
    return attention_block + mlp_block


def _latent_attention_bytes(config: ModelConfig, setup: Setup) -> tuple[float, ...]:
    """DeepSeek-V3's latent attention (models/mla.py LatentAttention) for one micro-batch, as layer_activation_bytes'
    attention terms: (column-parallel input copies, latents and rotary, per-layer rotary rows, core, what core_attn
    recompute keeps, the o_proj input). q and k are nope + rope wide per head, v and the output v_head_dim; the latent
    projections are replicated under tp (this rank's tokens under SP), only q_b_proj / kv_b_proj split the heads.

    Kept for backward: each latent's RMSNorm keeps its float32 normalized input and its output, not the latent itself
    (models/parallel_layers.py RMSNorm: the CPU PyLayer saves normed, r; the half path casts first; only the fused
    kernel keeps its input), q_b_proj / kv_b_proj their own gathered / identity copy under tp; split's outputs are
    new tensors (q_nope, k_nope and the kv_a latent are kept by nobody); rotate_pairs keeps the float32 pairs of q_pe
    (every head) and of k_pe (one for every head; under sep expanded to the heads before the all-to-all). The pair
    tables are cached once per length (shared_mask_bytes); a layer gathers its own rows with packed documents or
    the ring's positions. Measured per tensor on deepseek-v3-real (tests/test_planner.py
    test_latent_attention_activations_are_counted_tensor_by_tensor)."""
    c, p = config, setup.precision
    a, tp = p.activation_bytes, setup.tp
    sp = c.sequence_parallel and tp > 1
    tokens = setup.tokens_per_micro_batch
    local_tokens = tokens / tp if sp else tokens
    heads, rope = c.num_attention_heads // tp, c.qk_rope_head_dim
    qk_size, v_size = heads * (c.qk_nope_head_dim + rope), heads * c.v_head_dim

    def latent(width: int) -> float:
        kept_input = a * width if c.use_fused_rms_norm else 0.0
        return local_tokens * (kept_input + _norm_saved(c.replace(norm_type="rmsnorm", hidden_size=width), p))

    copies = tokens * a * (c.q_lora_rank + c.kv_lora_rank) if tp > 1 else 0.0
    k_rope = heads * rope if setup.sep > 1 else rope
    latents = latent(c.q_lora_rank) + latent(c.kv_lora_rank) + tokens * 4 * (heads * rope + k_rope)
    ring = setup.cp > 1
    rows = tokens if ring else (tokens * setup.sep if setup.mean_document_length else 0)  # packed documents: whole
    tables = rows * rope * 4  # cos and sin [rows, rope / 2] float32
    core_inputs = tokens * a * (2 * qk_size + v_size)  # recompute(core, q, k, v): the concats and v
    if ring:
        # models/ring_attention.py keeps q (scaled), k, v, the log-sum-exp and its output (the o_proj input, `out`);
        # MLA does not recompute the ring
        core = tokens * (a * (2 * qk_size + v_size) + 4 * heads)
        core_inputs = core
    elif c.use_flash_attention:
        # flash_attention: the kernel keeps q (pre-scaled), k, v padded to nope + rope, its padded output and the
        # log-sum-exp per head and token; the output's slice to v's head dim is the o_proj input (`out`)
        core = tokens * (a * 4 * qk_size + 4 * heads)
    else:
        # plain_attention: q scaled and k in float32 (matmul inputs), v transposed, the softmax output [b, heads, s, s]
        # in float32 (+ its cast under AMP); the causal mask is built per call (transient)
        scores = tokens * heads * c.seq_length * (4 + (a if p.half else 0))
        core = tokens * (4 * qk_size + 4 * qk_size + a * v_size) + scores
    return copies, latents, tables, core, core_inputs, tokens * a * v_size


def shared_mask_bytes(config: ModelConfig, setup: Setup) -> float:
    """The masks models/constants.py keeps once per process for every layer: the plain path's causal mask
    [s, s] and ALiBi bias [heads, 1, s] (float32); under flash attention with ALiBi also the kernel's mask
    [b, heads, s, s] in the compute dtype (a causal flash call takes none); the ring's diagonal block's
    causal mask [s / cp, s / cp] float32 (its flash blocks without ALiBi take none)."""
    c = config
    s, heads = c.seq_length, c.num_attention_heads // (setup.tp * setup.sep)
    alibi = c.position_embedding == "alibi"
    if c.uses_mla:
        # models/mla.py: its pair tables (cos, sin [s, rope / 2] float32) cached once per length; its plain path
        # builds the causal mask per call (transient), the ring's plain blocks keep theirs as below
        tables = s * c.qk_rope_head_dim * 4
        return tables + ((s / setup.cp) ** 2 * 4 if setup.cp > 1 else 0.0)
    if setup.cp > 1:
        local = s / setup.cp
        return local * local * 4 if (alibi or not c.use_flash_attention) else 0.0
    if c.use_flash_attention and not alibi:
        return 0.0
    masks = s * s * 4 + (heads * s * 4 if alibi else 0.0)
    if c.use_flash_attention:
        masks += setup.micro_batch * heads * s * s * setup.precision.activation_bytes
    return masks


def attention_backward_bytes(config: ModelConfig, setup: Setup) -> float:
    """Short-lived tensors of one layer's core-attention backward, at long sequences the peak.

    Plain attention: the gradients of the softmax output and of the scores, [b, heads / tp (/ sep),
    s, s] float32 each (flash attention: none of that size, in the ring's flash blocks neither).
    Ring attention's plain blocks (models/ring_attention.py PlainBlocks.backward), at the largest
    block (the own one, [b, heads / tp, s / cp, s / cp] float32): the probabilities, their gradient,
    that gradient minus rowsum(dO * O) and the scores' gradient."""
    c = config
    heads = c.num_attention_heads // setup.tp
    tokens = setup.tokens_per_micro_batch  # queries this rank attends with (x heads / sep under sep)
    if c.use_flash_attention and c.position_embedding != "alibi":
        return 0.0
    if setup.cp > 1:
        return 4 * tokens * heads * (tokens / setup.micro_batch) * 4
    return 2 * tokens * heads * c.seq_length * 4


def head_activation_bytes(config: ModelConfig, setup: Setup) -> float:
    """The final norm, the head's input and the loss (decoder.output_logits / causal_lm_loss) for one
    micro-batch: cross entropy keeps its softmax [tokens, vocab / tp] in float32."""
    c, p = config, setup.precision
    tp, a = setup.tp, p.activation_bytes
    sp = c.sequence_parallel and tp > 1
    tokens = setup.tokens_per_micro_batch
    local_tokens = tokens / tp if sp else tokens
    h = c.hidden_size
    total = local_tokens * (a * h + _norm_saved(c, p))
    if tp > 1:
        total += tokens * a * h  # gather_sequence / _c_identity copy kept by the head's matmul
    total += tokens * (c.vocab_size // tp) * 4
    if c.norm_head:
        total += h * (c.vocab_size // tp) * p.param_bytes  # F.normalize(weight) kept by the matmul
    if c.num_nextn_predict_layers:
        # DeepSeek-V3's MTP block (models/decoder.py MTPLayer) on the last stage: its own final norm, head input and
        # loss softmax (the same again), and what its segment keeps: under full recompute the segment's input [hidden;
        # next embeddings], otherwise the next tokens' embeddings, the two RMSNorms (enorm, hnorm), their
        # concatenation and the decoder layer it runs (deepseek-v3-real's estimate against its CPU peak: -5.1 % before,
        # -2.8 % with it)
        total *= 2
        if c.recompute and c.recompute_granularity == "full":
            total += local_tokens * a * 2 * h
        else:
            total += local_tokens * (a * h + 2 * _norm_saved(c, p) + a * 2 * h)
            total += layer_activation_bytes(c, setup, c.num_hidden_layers)
    return total


def stage_output_bytes(config: ModelConfig, setup: Setup) -> float:
    """A pipeline stage keeps each in-flight micro-batch's output until its backward (PipelineParallel's
    output_tensors)."""
    tokens = setup.tokens_per_micro_batch
    if config.sequence_parallel and setup.tp > 1:
        tokens /= setup.tp
    return tokens * config.hidden_size * setup.precision.activation_bytes


def in_flight_micro_batches(setup: Setup, stage: int) -> int:
    """Micro-batches (chunks, for the interleaved schedule) whose activations a stage holds at once.

    1F1B (pipeline_parallel.py:1101): startup_steps = num_stages - stage_id - 1 forwards, then one more
    before the first backward. Interleaved (pipeline_parallel.py:2617): startup_steps =
    2 (num_stages - stage_id - 1) + (num_model_chunks - 1) * (accumulate_steps % num_stages + num_stages),
    capped at accumulate_steps * num_model_chunks, plus one.
    """
    pp, vpp, acc = setup.pp, setup.vpp, setup.accumulation
    if pp == 1:
        return 1
    if setup.dualpipev:
        # DualPipeV keeps PP + 1 micro-batches' activations of a device (deepseek-ai/DualPipe README's table:
        # 1F1B PP, DualPipeV PP + 1), here counted on every stage
        return min(pp + 1, acc)
    if vpp == 1:
        return min(pp - stage, acc)
    steps = acc * vpp
    startup = min(2 * (pp - stage - 1) + (vpp - 1) * (acc % pp + pp), steps)
    # Measured, not derived: every stage of pp4 vpp2 with 4 micro-batches holds all 8 chunk activations
    # (llama-real, 8 layers: stage peaks 609/479/479/650 MiB), (vpp - 1) * pp more than startup + 1 says.
    return min(startup + 1 + (vpp - 1) * pp, steps)


# ----------------------------------------------------------------------------- optimizer state ownership
@functools.lru_cache(maxsize=64)
def stage1_owned(params: tuple[Param, ...], degree: int) -> list[list[Param]]:
    """Stage 1 (fleet's DygraphShardingOptimizer._partition_parameters): parameters sorted by size, largest
    first (FLAGS_sharding_sort_parameters defaults to 1), each to the rank with the least so far."""
    owned, sizes = [[] for _ in range(degree)], [0] * degree
    for param in sorted(params, key=lambda q: q.numel, reverse=True):
        rank = sizes.index(min(sizes))
        owned[rank].append(param)
        sizes[rank] += param.numel
    return owned


@functools.lru_cache(maxsize=64)
def stage2_owned(params: tuple[Param, ...], degree: int) -> list[list[Param]]:
    """Stage 2/3 (GroupShardedOptimizerStage2._segment_params): in model order, each to the rank with the
    least so far (not sorted: uneven when the large embedding and head come first and last)."""
    owned, sizes = [[] for _ in range(degree)], [0] * degree
    for param in params:
        rank = sizes.index(min(sizes))
        owned[rank].append(param)
        sizes[rank] += param.numel
    return owned


# ----------------------------------------------------------------------------- one rank
def rank_memory(setup: Setup, stage: int = 0, sharding_rank: int = 0, single_process: bool | None = None) -> RankMemory:
    c, p = setup.config, setup.precision
    params = tuple(setup.stage_parameters(stage))
    numel = sum(q.numel for q in params)
    pb, gb = p.param_bytes, p.grad_bytes
    name = []
    if setup.pp > 1:
        name.append(f"pipeline stage {stage}")
    if setup.sharding_stage:
        name.append(f"sharding rank {sharding_rank}")
    rank = ", ".join(name) or "every rank"
    persistent: dict[str, float] = {}
    stage_ = setup.sharding_stage if setup.sharding_degree > 1 else 0
    degree = setup.sharding_degree

    # Which parameters' optimizer state (and, for stages 2/3, gradients) this rank owns.
    # Expert parallelism over sharding ranks (dp 1): the experts stay out of fleet's sharding wrappers; their
    # states are split over fleet's moe_sharding group (the degree / ep ranks holding the same experts; this
    # rank is number sharding_rank // ep there) by fleet's stage-1 partition, and every rank keeps the whole
    # gradients of its experts (llm_pretrain/parallel/expert_optimizer.py).
    ep = c.expert_parallel_degree
    split_experts = stage_ in (1, 2) and ep > 1 and setup.dp == 1
    experts = [q for q in params if ".experts." in q.name] if split_experts else []
    # the others by name, not `q not in experts` (a list: quadratic, minutes for DeepSeek-V3's 256 experts a layer)
    sharded = tuple(q for q in params if ".experts." not in q.name) if split_experts else params
    if stage_ == 1:
        owned = stage1_owned(sharded, degree)[sharding_rank]
    elif stage_ == 2:
        owned = stage2_owned(sharded, degree)[sharding_rank]
    else:
        owned = params
    expert_replicas = degree // ep if experts else 1
    owned_experts = (stage1_owned(tuple(experts), expert_replicas)[sharding_rank // ep] if expert_replicas > 1
                     else experts)
    expert_numel = sum(q.numel for q in experts)
    owned_numel = sum(q.numel for q in owned) + sum(q.numel for q in owned_experts)
    largest = max(q.numel for q in params)

    if stage_ == 3:
        # group_sharded_stage3.py:467: parameters above segment_size are sliced (padded) over the ranks;
        # smaller ones stay whole on every rank and every rank updates them.
        sliced = [q for q in params if q.numel > STAGE3_SEGMENT_ELEMENTS]
        whole = [q for q in params if q.numel <= STAGE3_SEGMENT_ELEMENTS]
        local = sum(-(-q.numel // degree) for q in sliced) + sum(q.numel for q in whole)
        persistent["weights"] = local * pb
        persistent["gradients"] = local * gb
        state_numel = local
        largest_sliced = max((q.numel for q in sliced), default=0)
    else:
        persistent["weights"] = numel * pb
        if stage_ == 2:
            # GroupShardedStage2: gradients of parameters that fit go into one GradStorage per destination
            # rank (buffer_max_size elements, allocated whole, group_sharded_stage2.py:568); the others keep
            # their own .grad; after the reduce, gradients this rank does not own are freed.
            buffer = min(STAGE2_BUFFER_MAX_ELEMENTS, max(sum(q.numel for q in r) for r in stage2_owned(sharded, degree)))
            fill = 0
            for q in sorted(owned, key=lambda q: q.numel):  # filled smallest first (group_sharded_stage2.py:315)
                if fill + q.numel <= buffer:
                    fill += q.numel
            persistent["gradients"] = (sum(q.numel for q in owned) - fill + expert_numel) * gb
            persistent["gradient buffer (stage 2, own rank)"] = buffer * gb
            # Measured, not derived: on a rank that does not own the word embedding its gradient stays
            # allocated after backward (llama-real stage 2 degree 2: +32.5 MiB, exactly the embedding's size,
            # on the rank without it; the head's gradient is freed as the reduce callback says).
            embedding = [q for q in params if q.name == "embeddings.word_embeddings.weight"]
            if embedding and embedding[0] not in owned:
                persistent["word embedding gradient (not owned, kept)"] = embedding[0].numel * gb
        else:
            persistent["gradients"] = numel * gb  # stage 1 keeps every gradient (reduced to the owner)
        state_numel = owned_numel
    if p.half and p.level == "O2":
        persistent["master weights (fp32)"] = state_numel * 4
        if p.master_grad:
            persistent["master gradients (fp32)"] = state_numel * 4
    persistent["Adam moments (fp32)"] = state_numel * 8
    if setup.dp > 1 and setup.tp == 1 and setup.pp == 1 and stage_ == 0:
        # paddle.DataParallel's reducer copies every gradient into its fused group buffers (kept).
        persistent["data-parallel fused gradient buffers"] = numel * gb

    # Activations of the in-flight micro-batches at the start of backward.
    layers = [i for chunk in setup.stage_chunks(stage) for i in chunk] if setup.pp > 1 else list(range(c.num_hidden_layers))
    if layers:
        persistent["attention masks shared by the layers"] = shared_mask_bytes(c, setup)
    last = stage == setup.pp - 1 or (setup.dualpipev and stage == 0)  # DualPipeV's V ends on stage 0
    first = stage == 0
    if setup.vpp > 1:
        # Chunks of one micro-batch count separately (bounded by this stage's heaviest chunk).
        in_flight = in_flight_micro_batches(setup, stage)
        per_chunk = max(sum(layer_activation_bytes(c, setup, i) for i in chunk) for chunk in setup.stage_chunks(stage))
        activations = in_flight * (per_chunk + stage_output_bytes(c, setup))
        if last:  # the micro-batches in flight in the last chunk went through the head and loss
            last_chunk = max(1, in_flight - setup.accumulation * (setup.vpp - 1))
            activations += last_chunk * head_activation_bytes(c, setup)
    else:
        in_flight = in_flight_micro_batches(setup, stage)
        per_micro_batch = sum(layer_activation_bytes(c, setup, i) for i in layers)
        if last:
            per_micro_batch += head_activation_bytes(c, setup)
        elif setup.pp > 1:
            per_micro_batch += stage_output_bytes(c, setup)
        activations = in_flight * per_micro_batch

    head = [q for q in params if q.part == "head"] or ([q for q in params if q.part == "embedding"] if last and c.tie_word_embeddings else [])
    layer_params = [q for q in params if q.part == "layer"]
    first_grad = max((q.numel for q in (head if last else layer_params)), default=0)
    phases: dict[str, dict[str, float]] = {}
    backward = {"activations (in-flight micro-batches)": activations,
                "weight gradient before accumulation": first_grad * gb}
    if "data-parallel fused gradient buffers" in persistent:
        backward["data-parallel fused group in flight"] = DP_FUSED_GROUP_BYTES
    if stage_ == 2:
        backward["gradient buffers of the other ranks (stage 2)"] = buffer * gb * (degree - 1)
    if stage_ == 3:
        backward["gathered weights and full gradient (stage 3)"] = STAGE3_FULL_COPIES * largest_sliced * pb
        backward["weight gradient before accumulation"] = 0.0
    phases["backward start"] = backward
    if layers:
        phases["core-attention backward"] = {"activations (in-flight micro-batches)": activations,
                                             "attention backward transients (one layer)": attention_backward_bytes(c, setup)}
    if c.recompute and c.recompute_granularity == "full":
        # Inside backward, one layer runs its forward again and keeps everything until its own backward.
        rebuilt = max(layer_activation_bytes(c, setup, i, recomputed=False) for i in layers) if layers else 0
        phases["recompute of one layer"] = {"activations (in-flight micro-batches)": activations,
                                            "one layer rebuilt": rebuilt,
                                            "weight gradient before accumulation": max((q.numel for q in layer_params), default=0) * gb}
    if first:
        embedding = max((q.numel for q in params if q.part == "embedding"), default=0)
        phases["backward end"] = {"embedding gradient before accumulation": embedding * gb}
    if single_process is None:
        single_process = setup.world_size == 1
    if single_process:
        # trainer.global_grad_norm squares each gradient (one at a time) before the step.
        phases["optimizer step"] = {"squared gradient (grad norm)": largest * gb}
    return RankMemory(rank, persistent, phases, largest_activation_tensor(c, setup, last))


def largest_activation_tensor(config: ModelConfig, setup: Setup, last_stage: bool) -> float:
    """The largest single tensor a micro-batch's forward keeps: the loss's float32 softmax [tokens, vocab / tp]
    on the last stage, the MLP's intermediate [tokens, ffn / tp], or the attention scores [b, heads, s, s]
    without flash attention (layer_activation_bytes). Tokens are this rank's: 1/sep or 1/cp of each sequence
    (the loss is computed per chunk, decoder.causal_lm_loss); sep's scores cover every key of heads / sep,
    the ring's plain blocks its own block's keys."""
    c, a = config, setup.precision.activation_bytes
    tokens = setup.tokens_per_micro_batch
    sizes = [tokens * (c.intermediate_size // setup.tp) * a]
    if last_stage:
        sizes.append(tokens * (c.vocab_size // setup.tp) * 4)
    if not c.use_flash_attention or c.position_embedding == "alibi":
        keys = tokens / setup.micro_batch if setup.cp > 1 else c.seq_length
        sizes.append(tokens * c.num_attention_heads // setup.tp * keys * 4)
    return float(max(sizes))


def peak_memory(setup: Setup) -> tuple[RankMemory, list[RankMemory]]:
    """(the rank with the highest peak, every distinct rank)."""
    ranks = []
    # A middle stage's parameters and activations depend only on how many decoder layers its chunks hold, and an
    # earlier stage has at least as many micro-batches in flight (1F1B: fewer further on; interleaved and
    # DualPipeV: as many): the first stage, the last, and the earliest middle stage of each layer count bound
    # every stage (an even split: stages 0, 1 and pp - 1).
    shapes = [tuple(sorted(map(len, setup.stage_chunks(s)))) for s in range(setup.pp)] if setup.pp > 1 else [()]
    middle = {shape: min(s for s in range(1, setup.pp - 1) if shapes[s] == shape) for shape in shapes[1:-1]}
    stages = sorted({0, setup.pp - 1, *middle.values()})
    for stage in stages:
        for sharding_rank in _sharding_ranks_to_check(setup, stage):
            ranks.append(rank_memory(setup, stage, sharding_rank))
    return max(ranks, key=lambda r: r.peak_bytes), ranks


def _sharding_ranks_to_check(setup: Setup, stage: int) -> list[int]:
    """Stage 1/2 ranks own different parameters: every rank of a small group; of a large one the rank owning
    the most elements and the ranks with and without the word embedding (stage 2 keeps its gradient on the
    others), which bound the rest."""
    degree = setup.sharding_degree
    if setup.sharding_stage not in (1, 2) or degree == 1:
        return [0]
    if degree <= 8:
        return list(range(degree))
    params = tuple(setup.stage_parameters(stage))
    owned = (stage1_owned if setup.sharding_stage == 1 else stage2_owned)(params, degree)
    largest = max(range(degree), key=lambda r: sum(q.numel for q in owned[r]))
    with_embedding = [r for r in range(degree) if any(q.part == "embedding" for q in owned[r])]
    without = [r for r in range(degree) if r not in with_embedding]
    return sorted({largest, *with_embedding[:1], *without[:1]})
