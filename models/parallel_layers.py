"""The layers the decoder is built from, chosen by the run's tensor-parallel degree.

At tensor_parallel_degree 1 they are plain Paddle layers; above it they are
fleet's `meta_parallel` layers (ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding, ParallelCrossEntropy), so the model code reads the
same at every degree.

Every weight that tensor parallelism splits is tagged with where it is split
(`tp_split_axis`) and, for fused projections such as q|k|v, the sizes of the
fused parts along that axis (`tp_split_parts`): each rank holds its slice of
every part. Weight initialization, checkpoint merging and the export to
PaddleNLP use these tags to move between the full weight and a rank's slice.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from models.config import ModelConfig


def tag_split(param, axis: int | None, parts: tuple[int, ...] | None = None) -> None:
    """Record how tensor parallelism splits this parameter (axis None: replicated)."""
    param.tp_split_axis = axis
    param.tp_split_parts = parts


def _tensor_parallel(config: ModelConfig) -> bool:
    return config.tensor_parallel_degree > 1


def _sequence_parallel(config: ModelConfig) -> bool:
    return config.sequence_parallel and config.tensor_parallel_degree > 1


def _weight_attr():
    # Real values are set by models.weights.init_weights, identical at every degree.
    return paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))


def column_linear(config: ModelConfig, in_features: int, out_features: int, bias: bool,
                  parts: tuple[int, ...] | None = None) -> nn.Layer:
    """y = x W + b with W's output columns split across tensor-parallel ranks.

    `parts` lists the sizes of fused outputs (e.g. q, k, v); each is split separately.
    """
    if _sequence_parallel(config):
        # Gathers the sequence-split input from all ranks before the matmul.
        from paddle.distributed.fleet.utils.sequence_parallel_utils import ColumnSequenceParallelLinear

        layer = ColumnSequenceParallelLinear(in_features, out_features, weight_attr=_weight_attr(),
                                             has_bias=bias, gather_output=False)
    elif _tensor_parallel(config):
        from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear

        layer = ColumnParallelLinear(in_features, out_features, weight_attr=_weight_attr(),
                                     has_bias=bias, gather_output=False)
    else:
        layer = nn.Linear(in_features, out_features, weight_attr=_weight_attr(), bias_attr=None if bias else False)
    tag_split(layer.weight, 1, parts)
    if bias:
        tag_split(layer.bias, 0, parts)
    return layer


def row_linear(config: ModelConfig, in_features: int, out_features: int, bias: bool) -> nn.Layer:
    """y = x W + b with W's input rows split; the output is summed over ranks."""
    if _sequence_parallel(config):
        # Reduce-scatters the output back to this rank's part of the sequence
        # (and marks its bias as a sequence-parallel parameter).
        from paddle.distributed.fleet.utils.sequence_parallel_utils import RowSequenceParallelLinear

        layer = RowSequenceParallelLinear(in_features, out_features, weight_attr=_weight_attr(),
                                          has_bias=bias, input_is_parallel=True)
    elif _tensor_parallel(config):
        from paddle.distributed.fleet.meta_parallel import RowParallelLinear

        layer = RowParallelLinear(in_features, out_features, weight_attr=_weight_attr(),
                                  has_bias=bias, input_is_parallel=True)
    else:
        layer = nn.Linear(in_features, out_features, weight_attr=_weight_attr(), bias_attr=None if bias else False)
    tag_split(layer.weight, 0)
    if bias:
        tag_split(layer.bias, None)
    return layer


def replicated_linear(in_features: int, out_features: int, bias: bool, partial_grads: bool = False) -> nn.Layer:
    """A linear layer every tensor-parallel rank holds whole.

    `partial_grads`: each rank uses a different part of the output (the replicated key/value
    heads of grouped-query attention with fewer kv heads than ranks), so each rank's weight
    gradients are partial. They are marked like the norms under sequence parallelism, and
    fleet's hooks sum them over the tensor-parallel group (llm_pretrain/parallel/distributed.py
    wrap_for_training). Feed such a layer through `replicated_input`.
    """
    from paddle.distributed.fleet.utils.sequence_parallel_utils import mark_as_sequence_parallel_parameter

    layer = nn.Linear(in_features, out_features, weight_attr=_weight_attr(), bias_attr=None if bias else False)
    for param in layer.parameters():
        tag_split(param, None)
        if partial_grads:
            mark_as_sequence_parallel_parameter(param)
    return layer


def token_chunk_linear(config: ModelConfig, in_features: int, out_features: int, bias: bool) -> nn.Layer:
    """A linear layer every tensor-parallel rank holds whole, applied to the block's input as it comes: under
    sequence parallelism this rank's chunk of the tokens, so its gradients cover those tokens only and are summed
    over the ranks (marked as a sequence-parallel parameter, as the norms); without SP every token, and a
    column-parallel layer after it makes its gradients whole (DeepSeek-V3's latent projections, MTP's eh_proj)."""
    return replicated_linear(in_features, out_features, bias, partial_grads=_sequence_parallel(config))


def vocab_embedding(config: ModelConfig, vocab_size: int, hidden_size: int) -> nn.Layer:
    """Word embeddings with the vocabulary split across tensor-parallel ranks."""
    if _tensor_parallel(config):
        from paddle.distributed.fleet.meta_parallel import VocabParallelEmbedding

        layer = VocabParallelEmbedding(vocab_size, hidden_size, weight_attr=_weight_attr())
    else:
        layer = nn.Embedding(vocab_size, hidden_size, weight_attr=_weight_attr())
    tag_split(layer.weight, 0)
    return layer


def replicated_embedding(num_embeddings: int, hidden_size: int) -> nn.Layer:
    layer = nn.Embedding(num_embeddings, hidden_size, weight_attr=_weight_attr())
    tag_split(layer.weight, None)
    return layer


def norm(config: ModelConfig, hidden_size: int) -> nn.Layer:
    """RMSNorm or LayerNorm per the family; replicated on every rank."""
    if config.norm_type == "rmsnorm":
        layer = RMSNorm(hidden_size, config.norm_eps, fused=config.use_fused_rms_norm)
    else:
        layer = (FastLayerNorm if config.use_fast_layer_norm else nn.LayerNorm)(hidden_size, epsilon=config.norm_eps)
    for param in layer.parameters():
        tag_split(param, None)
        if _sequence_parallel(config):
            # Each rank normalizes its own part of the sequence, so the gradients of the
            # norm's weights are partial sums: fleet's hooks all-reduce them over the group.
            from paddle.distributed.fleet.utils.sequence_parallel_utils import mark_as_sequence_parallel_parameter

            mark_as_sequence_parallel_parameter(param)
    return layer


def head_norm(config: ModelConfig, head_dim: int) -> nn.Layer:
    """RMSNorm over each attention head (Qwen3's q_norm / k_norm), replicated on every rank.

    Each rank normalizes the heads it holds (tensor parallelism) of the tokens it holds (sep, cp): its
    weight gradients are partial sums. Under tensor parallelism they are marked like the norms under
    sequence parallelism, so that fleet's hooks sum them over the tensor-parallel group
    (llm_pretrain/parallel/distributed.py wrap_for_training); over the sep/cp group they are summed like
    every other replicated weight's."""
    layer = RMSNorm(head_dim, config.norm_eps, fused=config.use_fused_rms_norm)
    for param in layer.parameters():
        tag_split(param, None)
        if _tensor_parallel(config):
            from paddle.distributed.fleet.utils.sequence_parallel_utils import mark_as_sequence_parallel_parameter

            mark_as_sequence_parallel_parameter(param)
    return layer


class RMSNorm(nn.Layer):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 as in PaddleNLP's LLaMA."""

    def __init__(self, hidden_size: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        if self.fused:
            # GPU kernel. PaddleNLP 2.8.1's LlamaRMSNorm (paddlenlp/transformers/llama/modeling.py
            # rms_norm_fused) calls the separately built fused_ln op; here Paddle 3.3.1's own fused kernel,
            # paddle/incubate/nn/functional/fused_rms_norm.py (no bias; normalizes the last axis).
            from paddle.incubate.nn.functional import fused_rms_norm

            return fused_rms_norm(x, self.weight, None, self.eps, begin_norm_axis=x.ndim - 1)[0]
        if x.dtype == paddle.float32 and self.weight.dtype == paddle.float32 and x.place.is_cpu_place():
            return RMSNormCPU.apply(x, self.weight, self.eps)
        x32 = x.astype("float32")
        # paddle.square, not pow(2): Paddle's CPU pow kernel (and its gradient) is several times
        # slower; same values (benchmarks/cpu_speed.md).
        variance = paddle.square(x32).mean(-1, keepdim=True)
        x32 = paddle.rsqrt(variance + self.eps) * x32
        return x32.astype(self.weight.dtype) * self.weight


class FastLayerNorm(nn.LayerNorm):
    """LayerNorm through PaddleNLP's fast_ln custom GPU op (a separate package; its presence is
    checked before training starts), as paddlenlp/transformers/gpt/modeling.py GPTLayerNorm."""

    def forward(self, x):
        import fast_ln

        return fast_ln.fast_ln(x, self.weight, self.bias, self._epsilon)[0]


class RMSNormCPU(paddle.autograd.PyLayer):
    """RMSNorm in float32 on CPU with its gradient written out: the same function, 37 % less CPU time.

    Autograd's backward of `rsqrt(mean(x^2) + eps) * x * weight` goes through Paddle's CPU
    broadcast-gradient kernels, whose reduction for `weight` over every token is the slowest part
    (benchmarks/cpu_speed.md). Here, with n = x * r and r = rsqrt(mean(x^2) + eps):
    d weight = sum over tokens of g * n (one matrix-vector product), d x = r * (g w - n mean(g w n)).
    Equal to autograd's gradients up to float rounding (tests/test_reference_parity.py
    test_rms_norm_gradients_match_paddlenlp: against PaddleNLP's LlamaRMSNorm, relative 1e-5).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        r = paddle.rsqrt(paddle.square(x).mean(-1, keepdim=True) + eps)
        normed = r * x
        ctx.save_for_backward(normed, r, weight)
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        normed, r, weight = ctx.saved_tensor()
        hidden = grad.shape[-1]
        tokens = paddle.ones([1, math.prod(grad.shape) // hidden], grad.dtype)
        grad_weight = paddle.matmul(tokens, (grad * normed).reshape([-1, hidden])).reshape(weight.shape)
        grad_normed = grad * weight
        grad_x = r * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x, grad_weight


def tensor_parallel_input(config: ModelConfig, x):
    """Identity forward, all-reduce of the gradient backward: the entry of a block
    whose weights are split (needed where we multiply by a split weight ourselves)."""
    if not _tensor_parallel(config):
        return x
    from paddle.distributed.fleet.layers.mpu import mp_ops

    return mp_ops._c_identity(x, group=_model_parallel_group())


def replicated_input(config: ModelConfig, x):
    """The input of a `replicated_linear(partial_grads=True)`: forward, every token on every rank
    (gathered from the chunks under sequence parallelism); backward, the input gradient summed
    over the tensor-parallel ranks (and reduce-scattered back to the chunks under sequence
    parallelism), since each rank's gradient only covers the part of the output it used."""
    if _sequence_parallel(config):
        from paddle.distributed.fleet.utils.sequence_parallel_utils import AllGatherOp

        return AllGatherOp.apply(x)
    return tensor_parallel_input(config, x)


def _model_parallel_group():
    from paddle.distributed import fleet

    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def tensor_parallel_rank_and_degree(config: ModelConfig) -> tuple[int, int]:
    if not _tensor_parallel(config):
        return 0, 1
    group = _model_parallel_group()
    return group.rank, group.nranks


# ----------------------------------------------------------------------------- sequence parallelism
# Under sequence parallelism the activations between the attention and MLP blocks are
# [batch * seq / tp, hidden]: the tokens of the micro-batch, flattened and split into
# tp contiguous chunks (as PaddleNLP's LLaMA). Norms, residuals and dropout work on the
# local chunk; the sequence-parallel linears gather and scatter around the matmuls.
def split_sequence(config: ModelConfig, hidden):
    """[batch, seq, hidden] -> this rank's chunk of the flattened tokens (identity without SP)."""
    if not _sequence_parallel(config):
        return hidden
    from paddle.distributed.fleet.utils.sequence_parallel_utils import ScatterOp

    return ScatterOp.apply(hidden.reshape([-1, hidden.shape[-1]]))


def gather_sequence(config: ModelConfig, hidden):
    """This rank's chunk -> [batch, seq, hidden] with every token (identity without SP)."""
    if not _sequence_parallel(config):
        return hidden
    from paddle.distributed.fleet.utils.sequence_parallel_utils import GatherOp

    return GatherOp.apply(hidden).reshape([-1, config.tokens_per_rank, hidden.shape[-1]])


def cross_entropy_per_token(config: ModelConfig, logits, labels):
    """Loss per token, float32. With tensor parallelism the logits hold this rank's
    slice of the vocabulary and fleet's ParallelCrossEntropy combines the slices."""
    logits = logits.astype("float32")
    if _tensor_parallel(config):
        from paddle.distributed.fleet.meta_parallel import ParallelCrossEntropy

        return ParallelCrossEntropy()(logits, labels.unsqueeze(-1)).squeeze(-1)
    return F.cross_entropy(logits, labels.unsqueeze(-1), reduction="none", ignore_index=-100).squeeze(-1)


# ----------------------------------------------------------------------------- segment parallelism
# PaddleNLP's sep_parallel_degree (Ulysses-style; paddlenlp/transformers/segment_parallel_utils.py and
# the sep branches of paddlenlp/transformers/llama/modeling.py), on fleet's sep group: the ranks of a
# sep group read the same samples and each holds 1/sep of every sequence ([batch, seq / sep, ...])
# everywhere except inside attention, where an all-to-all switches to every token of 1/sep of the
# heads and back. The losses of the chunks are gathered so that each rank computes the loss of the
# whole sequence; each rank's parameter gradients cover its own tokens, and fleet's hybrid
# optimizer sums them over the sep group (hybrid_parallel_util.py fused_allreduce_gradients:
# "sep all reduce is not scaled").
#
# Context parallelism (context_parallel_degree, models/ring_attention.py) runs on the same fleet
# group (as Paddle's own ring attention, auto_parallel/ring_attention.py, runs on the "sep" mesh
# axis; fleet 3.3.1 builds its separate cp group only in the expert-parallel topology): the ranks
# also share samples and hold 1/cp of every sequence, in two causally balanced chunks, and k/v
# blocks travel around the ring instead of the all-to-all. The two are never combined.
def _segment_parallel(config: ModelConfig) -> bool:
    return config.sep_parallel_degree > 1


def _context_parallel(config: ModelConfig) -> bool:
    return config.context_parallel_degree > 1


def _splits_sequence(config: ModelConfig) -> bool:
    return _segment_parallel(config) or _context_parallel(config)


def splits_sequence(config: ModelConfig) -> bool:
    """Whether each rank holds part of every sequence (sep or cp)."""
    return _splits_sequence(config)


def sequence_group():
    """Fleet's sep group: the ranks that hold the parts of the same sequences (sep or cp)."""
    from paddle.distributed import fleet

    return fleet.get_hybrid_communicate_group().get_sep_parallel_group()


_sep_group = sequence_group


def sep_rank_and_degree(config: ModelConfig) -> tuple[int, int]:
    """This rank's place in segment parallelism (the all-to-all; (0, 1) under context parallelism)."""
    if not _segment_parallel(config):
        return 0, 1
    group = sequence_group()
    return group.rank, group.nranks


def split_segment(config: ModelConfig, tokens):
    """[batch, seq, ...] -> this rank's part [batch, seq / degree, ...] (identity without sep or cp):
    a contiguous chunk under sep (PaddleNLP's split_inputs_sequence_dim), chunks i and 2cp-1-i under cp."""
    if not _splits_sequence(config):
        return tokens
    group = sequence_group()
    if _context_parallel(config):
        from models.ring_attention import balanced_split

        return balanced_split(tokens, group.rank, group.nranks)
    return paddle.split(tokens, group.nranks, axis=1)[group.rank]


def token_positions(config: ModelConfig, local_tokens: int):
    """Global positions (int64) of the tokens `split_segment` gives this rank."""
    if not _splits_sequence(config):
        return paddle.arange(local_tokens, dtype="int64")
    group = sequence_group()
    if _context_parallel(config):
        from models.ring_attention import balanced_positions

        return balanced_positions(config.seq_length, group.rank, group.nranks)
    start = group.rank * local_tokens
    return paddle.arange(start, start + local_tokens, dtype="int64")


@paddle.no_grad()
def _all_to_all(x, group, split_axis: int, concat_axis: int):
    import paddle.distributed as dist

    parts = [part.contiguous() for part in paddle.split(x, group.nranks, axis=split_axis)]
    received = []
    dist.alltoall(received, parts, group=group)  # Paddle 3.3.1's order: (out_tensor_list, in_tensor_list)
    return paddle.concat(received, axis=concat_axis)


class _AllToAll(paddle.autograd.PyLayer):
    """Split one axis over the group, gather another; backward the inverse (PaddleNLP's ReshardQKV)."""

    @staticmethod
    def forward(ctx, x, group, split_axis, concat_axis):
        ctx.group, ctx.axes = group, (split_axis, concat_axis)
        return _all_to_all(x, group, split_axis, concat_axis)

    @staticmethod
    def backward(ctx, grad):
        split_axis, concat_axis = ctx.axes
        return _all_to_all(grad, ctx.group, concat_axis, split_axis)


def sequence_to_heads(config: ModelConfig, x):
    """[batch, seq / sep, heads, head_dim] -> [batch, seq, heads / sep, head_dim] (identity without sep)."""
    if not _segment_parallel(config):
        return x
    return _AllToAll.apply(x, _sep_group(), 2, 1)


def heads_to_sequence(config: ModelConfig, x):
    """[batch, seq, heads / sep, head_dim] -> [batch, seq / sep, heads, head_dim] (identity without sep)."""
    if not _segment_parallel(config):
        return x
    return _AllToAll.apply(x, _sep_group(), 1, 2)


class _GatherSegments(paddle.autograd.PyLayer):
    """Every rank's chunk concatenated along axis 1; backward this rank's part of the gradient (each
    rank computes the same loss from the gathered values), as PaddleNLP's ConcatSePMaskedLoss."""

    @staticmethod
    def forward(ctx, x, group):
        import paddle.distributed as dist

        ctx.group = group
        parts = []
        dist.all_gather(parts, x, group=group)
        return paddle.concat(parts, axis=1)

    @staticmethod
    def backward(ctx, grad):
        return paddle.split(grad, ctx.group.nranks, axis=1)[ctx.group.rank]


def gather_segments(config: ModelConfig, per_token):
    """[batch, seq / degree] per-token values of every rank -> [batch, seq] (identity without sep or cp;
    under cp in the ranks' chunk order, which a mean does not see)."""
    if not _splits_sequence(config):
        return per_token
    return _GatherSegments.apply(per_token, sequence_group())


class _SumOverGroup(paddle.autograd.PyLayer):
    """The sum of every rank's x; backward the gradient unchanged. Each rank computes the same loss from
    the sum, so the gradient reaching it is the same on every rank and is the gradient of this rank's
    own term (summing it over the group as well would count it degree times)."""

    @staticmethod
    def forward(ctx, x, group):
        import paddle.distributed as dist

        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def sum_over_segments(config: ModelConfig, x):
    """Statistics of this rank's tokens summed with those of the other parts of the same sequences
    (identity without sep or cp): the router's load-balancing statistics (models/moe.py)."""
    if not _splits_sequence(config):
        return x
    return _SumOverGroup.apply(x, sequence_group())


def sum_over_data_replicas(x):
    """`x` summed over the ranks that hold other samples of the step's batch (fleet's data-parallel and sharding
    groups), and how many they are: (x, 1) in one process. No gradient (the routers' pick counts)."""
    import paddle.distributed as dist

    if not dist.is_initialized():
        return x, 1
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    ranks = 1
    for group in (hcg.get_data_parallel_group(), hcg.get_sharding_parallel_group()):
        if group.nranks > 1:
            x = x.clone()
            dist.all_reduce(x, group=group)
            ranks *= group.nranks
    return x, ranks


def whole_sequences(config: ModelConfig, local):
    """This rank's part of every sequence (a tensor [batch, seq / degree, ...]) -> (every rank's parts in
    sequence order [batch, seq, ...], the positions of this rank's part, int64); without sep or cp
    (local, None). On the device: no host read."""
    if not _splits_sequence(config):
        return local, None
    import paddle.distributed as dist

    group = sequence_group()
    parts, positions = [], []
    mine = token_positions(config, local.shape[1])
    dist.all_gather(parts, local, group=group)
    dist.all_gather(positions, mine, group=group)
    order = paddle.argsort(paddle.concat(positions))
    return paddle.index_select(paddle.concat(parts, axis=1), order, axis=1), mine
