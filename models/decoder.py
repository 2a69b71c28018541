"""One decoder-only transformer for every family this toolkit trains.

    tokens -> Embeddings -> DecoderLayer x N -> final norm -> LMHead -> logits -> loss

The families (LLaMA, Baichuan, Qwen, Qwen2, GPT-3, Bloom; each one record in
models/families/) differ only in the switches of `ModelConfig`: RMSNorm or LayerNorm,
rotary (Llama 3.1's scaled frequencies too) / ALiBi / learned positions, SwiGLU or
GELU MLP, biases, a LayerNorm after the word embedding, tied or normalized output head; Mixtral and
Qwen2-MoE replace the MLP by a mixture of experts (models/moe.py), whose router losses join the loss.
The blocks below are also the stages of the pipeline
model (models/pipeline.py), so both paths run the same code.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from models import parallel_layers as pl
from models.config import ModelConfig, recomputes
from models.constants import shared_constant
from models.moe import MoE, RouterMetrics, router_losses
from models.rope import scaled_inv_freq, yarn_cos_sin_factor


# ----------------------------------------------------------------------------- positions
def rotary_cos_sin(seq_length: int, head_dim: int, theta: float, scaling: dict | None = None):
    """cos/sin tables of rotary embeddings, [1, seq, 1, head_dim], float32 (scaling: linear, Llama 3.1's or YaRN,
    models/rope.py; YaRN also scales both tables by its attention factor, as transformers' rotary embedding does)."""
    inv_freq = 1.0 / (theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim))
    if scaling:
        inv_freq = paddle.to_tensor(scaled_inv_freq(inv_freq.numpy(), scaling, theta))
    positions = paddle.arange(seq_length, dtype="float32")
    freqs = paddle.outer(positions, inv_freq)
    angles = paddle.concat([freqs, freqs], axis=-1)
    factor = yarn_cos_sin_factor(scaling)
    return (angles.cos() * factor)[None, :, None, :], (angles.sin() * factor)[None, :, None, :]


_ROTARY_TABLES: dict = {}


def rotary_tables(seq_length: int, head_dim: int, theta: float, scaling: dict | None = None):
    """`rotary_cos_sin`, built once per (sequence length, head size, theta) on the current device and
    shared by every layer and every forward of this process (they are constants). Built in float32
    outside autocast: under O2 the angles (position x frequency) would otherwise be rounded to half."""
    key = (seq_length, head_dim, float(theta), tuple(sorted(scaling.items())) if scaling else None,
           paddle.get_device())
    if key not in _ROTARY_TABLES:
        with paddle.no_grad(), paddle.amp.auto_cast(False):
            _ROTARY_TABLES[key] = rotary_cos_sin(seq_length, head_dim, theta, scaling)
    return _ROTARY_TABLES[key]


def apply_rotary(x, cos, sin):
    """Rotate query/key vectors, x: [batch, seq, heads, head_dim]: x * cos + rotate_half(x) * sin.

    rotate_half(x) = [-x2, x1] (x1, x2 the halves of the last axis), so rotate_half(x) * sin =
    roll(x, half) * [-sin1, sin2]: one roll of x instead of a split, a negation and a concat (and
    their gradients) per call, with the sign moved into the table. The products are taken on
    [batch, seq, heads x head_dim] views with the tables repeated over the heads ([seq, heads x
    head_dim]): Paddle's CPU kernels broadcast over leading axes much faster than over the
    [1, seq, 1, head_dim] pattern (2.3x forward + backward on q at width 1024). The same products
    and sums, so the same values to the bit (benchmarks/cpu_speed.md).
    """
    batch, seq, heads, head_dim = x.shape
    half = head_dim // 2
    x32 = x.astype("float32")
    signed_sin = paddle.concat([-sin[..., :half], sin[..., half:]], axis=-1)
    # Tables are [1, seq, 1, head_dim], or [batch, seq, 1, head_dim] when positions restart at each
    # document (each sample its own rows, `document_positions`).
    tables = cos.shape[0]
    cos_rows, sin_rows = (t.expand([tables, seq, heads, head_dim]).reshape([tables, seq, heads * head_dim])
                          for t in (cos, signed_sin))
    rolled = paddle.roll(x32, half, axis=-1)  # per head: the last axis only
    rows = [batch, seq, heads * head_dim]
    return (x32.reshape(rows) * cos_rows + rolled.reshape(rows) * sin_rows).reshape(x.shape).astype(x.dtype)


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al. 2022), also for head counts that are not powers of 2."""
    closest_power = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest_power) - 3)))
    slopes = [base ** (i + 1) for i in range(closest_power)]
    if closest_power != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest_power) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest_power)]
    return slopes


def alibi_bias(slopes, seq_length: int):
    """[heads, 1, seq] float32: slope x key position, added to the scores of every query (softmax is
    invariant to a per-query constant, so this equals slope x (key - query) under the causal mask)."""
    positions = paddle.arange(seq_length, dtype="float32")
    return slopes[:, None, None] * positions[None, None, :]


def causal_mask(seq_length: int):
    """[seq, seq] float32: 0 where a query may attend (key position <= query position), -inf elsewhere."""
    return paddle.triu(paddle.full([seq_length, seq_length], float("-inf"), dtype="float32"), diagonal=1)


# ----------------------------------------------------------------------------- packed documents
# A training sample packs several documents. `document_ids` [batch, seq] numbers each input token's
# document within its sample (0, 0, 0, 1, 1, 2, ...: non-decreasing); with them attention stops at the
# documents' boundaries (Megatron's --reset-attention-mask) and, with config.reset_position_ids,
# positions restart at 0 in every document (--reset-position-ids).
def document_mask(document_ids):
    """[batch, 1, seq, seq] float32: 0 where query and key are in the same document, -inf elsewhere
    (the causal mask is added on its own)."""
    same = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    return paddle.where(same, paddle.zeros([], "float32"), paddle.full([], float("-inf"), "float32"))


def document_row_indices(document_ids):
    """[batch, 1, seq, 1] int32: for each key, the first query row that must not see it, the first row of the
    next document (the sequence length for the last one). This is FlashMask's causal `startend_row_indices`
    with one bound (Paddle 3.3.1 paddle/nn/functional/flash_attention.py flashmask_attention: with causal=True
    and shape [b, 1 or heads, seq_k, 1], rows >= the value are masked below the diagonal), built as
    PaddleFormers builds it for packed sequences (paddleformers/datasets/collate.py
    gen_attn_mask_startend_row_indices: offset + len(document) for each token of a document).
    The ids are non-decreasing in a row, so the next document's first row is the count of ids <= this one."""
    ends = paddle.searchsorted(document_ids, document_ids, right=True, out_int32=True)
    return ends.reshape([document_ids.shape[0], 1, document_ids.shape[1], 1])


def document_positions(document_ids):
    """[batch, seq] int64: each token's position within its document."""
    seq = document_ids.shape[1]
    index = paddle.arange(seq, dtype="int64").expand(document_ids.shape)
    starts_here = paddle.concat([paddle.ones_like(document_ids[:, :1], dtype="bool"),
                                 document_ids[:, 1:] != document_ids[:, :-1]], axis=1)
    first_token = paddle.cummax(paddle.where(starts_here, index, paddle.zeros_like(index)), axis=1)[0]
    return index - first_token


class Documents:
    """What every layer needs of the packed documents, computed once per forward: the additive mask and,
    when positions restart, each token's position in its document (None otherwise)."""

    def __init__(self, config: ModelConfig, document_ids):
        self.ids = document_ids  # whole sequences: under cp the ring masks each block from them
        self.positions = document_positions(document_ids) if config.reset_position_ids else None
        self._mask = None
        self._row_indices = None

    @property
    def mask(self):
        """[batch, 1, seq, seq], built when first asked (the ring under cp never asks for it)."""
        if self._mask is None:
            self._mask = document_mask(self.ids)
        return self._mask

    @property
    def row_indices(self):
        """[batch, 1, seq, 1] int32 for the flashmask kernel (use_flash_attention), built when first asked."""
        if self._row_indices is None:
            self._row_indices = document_row_indices(self.ids)
        return self._row_indices


# ----------------------------------------------------------------------------- blocks
class Embeddings(nn.Layer):
    """Word embeddings (+ learned positions for GPT-3) (+ LayerNorm for Bloom)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = pl.vocab_embedding(config, config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned":
            self.position_embeddings = pl.replicated_embedding(config.max_position_embeddings, config.hidden_size)
        if config.embedding_layernorm:
            self.word_embeddings_layernorm = pl.norm(config, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    @property
    def tied_weight(self):
        """The matrix a tied output head shares (named for fleet's SharedLayerDesc)."""
        return self.word_embeddings.weight

    def forward(self, input_ids, documents: Documents | None = None):
        # Segment / context parallelism: this rank's part of every sequence (whole sequences come in,
        # in one process as in the pipeline's first stage; the loss splits the labels alike).
        input_ids = pl.split_segment(self.config, input_ids)
        hidden = self.word_embeddings(input_ids)
        if self.config.position_embedding == "learned":
            if documents is not None and documents.positions is not None:  # restarting at each document
                # (whole sequences' positions; under sep / cp this rank's tokens of them, as input_ids)
                hidden = hidden + self.position_embeddings(pl.split_segment(self.config, documents.positions))
            else:
                positions = pl.token_positions(self.config, input_ids.shape[1])  # global under sep / cp
                hidden = hidden + self.position_embeddings(positions)[None]
        # Split before the (per-token) LayerNorm: under sequence parallelism its weights then
        # see only local tokens, like every other norm, and are all-reduced the same way.
        hidden = pl.split_sequence(self.config, hidden)
        if self.config.embedding_layernorm:
            hidden = self.word_embeddings_layernorm(hidden)
        return self.dropout(hidden)


class Attention(nn.Layer):
    """Multi-head attention with grouped key/value heads, causal mask, rotary or ALiBi positions."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        tp_rank, tp_degree = pl.tensor_parallel_rank_and_degree(config)
        head_dim = config.head_dim
        q_size = config.num_attention_heads * head_dim
        kv_size = config.num_key_value_heads * head_dim
        self.num_heads = config.num_attention_heads // tp_degree  # heads on this rank
        # Fewer kv heads than tensor-parallel ranks (as Megatron): k/v are not split but
        # replicated; each rank projects every kv head and keeps the one its q heads share.
        self.replicated_kv = config.num_key_value_heads < tp_degree
        if self.replicated_kv:
            self.num_kv_heads = 1
            self.kv_head = tp_rank // (tp_degree // config.num_key_value_heads)
        else:
            self.num_kv_heads = config.num_key_value_heads // tp_degree
        bias = config.qkv_bias or config.linear_bias
        if config.fuse_attention_qkv:  # (not with replicated kv: layout.check_model_fits_layout)
            self.qkv_proj = pl.column_linear(config, config.hidden_size, q_size + 2 * kv_size, bias,
                                             parts=(q_size, kv_size, kv_size))
        else:
            self.q_proj = pl.column_linear(config, config.hidden_size, q_size, bias)
            if self.replicated_kv:
                self.k_proj = pl.replicated_linear(config.hidden_size, kv_size, bias, partial_grads=True)
                self.v_proj = pl.replicated_linear(config.hidden_size, kv_size, bias, partial_grads=True)
            else:
                self.k_proj = pl.column_linear(config, config.hidden_size, kv_size, bias)
                self.v_proj = pl.column_linear(config, config.hidden_size, kv_size, bias)
        self.o_proj = pl.row_linear(config, q_size, config.hidden_size, config.linear_bias)
        if config.qk_norm:
            # Qwen3: RMSNorm over each q and k head before the rotation, one [head_dim] weight each shared by
            # every head (transformers' Qwen3Attention q_norm / k_norm). Every rank holds it whole; its
            # gradients are partial over the heads of the rank (pl.head_norm).
            self.q_norm = pl.head_norm(config, head_dim)
            self.k_norm = pl.head_norm(config, head_dim)
        # Heads the core attention sees: under segment parallelism 1/sep of this rank's heads, with
        # every token (llm_pretrain/parallel/layout.py: sep divides the q heads of a rank). With fewer kv heads
        # than sep, each kv head is repeated sep / kv times before the all-to-all, so that every rank
        # receives the one its q heads share (PaddleNLP requires kv heads divisible by sep instead).
        sep_rank, sep_degree = pl.sep_rank_and_degree(config)
        self.kv_repeat = max(sep_degree // self.num_kv_heads, 1)
        self.attention_heads = self.num_heads // sep_degree
        self.attention_kv_heads = self.num_kv_heads * self.kv_repeat // sep_degree
        if config.position_embedding == "alibi":
            slopes = alibi_slopes(config.num_attention_heads)
            first = tp_rank * self.num_heads + sep_rank * self.attention_heads  # slopes are per head
            local = slopes[first:first + self.attention_heads]
            self.register_buffer("alibi_slopes", paddle.to_tensor(local, dtype="float32"), persistable=False)
            # The same slopes as Python floats: the ring and the shared masks' keys take them without a
            # device read per layer (issue 33, finding 4).
            self.alibi_slope_list = tuple(local)

    def shared_masks(self, seq: int):
        """(ALiBi bias [heads, 1, seq] or None, causal mask [seq, seq]), float32: one each per process for this
        rank's heads and this length (models/constants.py), shared by every layer and forward."""
        causal = shared_constant("causal_mask", (seq,), lambda: causal_mask(seq))
        if self.config.position_embedding != "alibi":
            return None, causal
        slopes = self.alibi_slope_list
        return shared_constant("alibi_bias", (slopes, seq), lambda: alibi_bias(
            paddle.to_tensor(slopes, dtype="float32"), seq)), causal

    def project_qkv(self, hidden, positions=None):
        # Under sequence parallelism `hidden` is this rank's chunk of the flattened tokens;
        # the column-parallel projections gather every token, so the outputs are whole sequences.
        seq = self.config.tokens_per_rank if hidden.ndim == 2 else hidden.shape[1]
        d = self.config.head_dim
        if self.config.fuse_attention_qkv:
            qkv = self.qkv_proj(hidden)
            q, k, v = paddle.split(qkv, [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], axis=-1)
        elif self.replicated_kv:
            q = self.q_proj(hidden)
            # Every kv head from the replicated projections (input gathered, its gradient summed
            # over the ranks), then the columns of this rank's kv head.
            x = pl.replicated_input(self.config, hidden)
            cols = slice(self.kv_head * d, (self.kv_head + 1) * d)
            k, v = self.k_proj(x)[..., cols], self.v_proj(x)[..., cols]
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.reshape([-1, seq, self.num_heads, d])
        k = k.reshape([-1, seq, self.num_kv_heads, d])
        v = v.reshape([-1, seq, self.num_kv_heads, d])
        if self.config.qk_norm:  # per head, before the rotation (and before sep's all-to-all: this rank's tokens)
            q, k = self.q_norm(q), self.k_norm(k)
        # Segment parallelism: from this rank's tokens of every head to every token of 1/sep of the
        # heads; rotary positions are then global (as PaddleNLP's LLaMA, which ropes after the reshard).
        if self.kv_repeat > 1:
            k, v = (paddle.repeat_interleave(t, self.kv_repeat, axis=2) for t in (k, v))
        q, k, v = (pl.sequence_to_heads(self.config, t) for t in (q, k, v))
        seq = q.shape[1]
        if self.config.position_embedding == "rope":
            cos, sin = rotary_tables(self.config.seq_length if self.config.context_parallel_degree > 1 else seq, d,
                                     self.config.rope_theta, self.config.rope_scaling)
            if self.config.context_parallel_degree > 1 and positions is not None:
                # positions restarting per document, given for whole sequences: this rank's tokens of them
                positions = pl.split_segment(self.config, positions)
            elif self.config.context_parallel_degree > 1:  # the rows of this rank's (global) positions
                rank_positions = pl.token_positions(self.config, seq)
                cos, sin = (paddle.index_select(t, rank_positions, axis=1) for t in (cos, sin))
            if self.config.use_fused_rope:
                # GPU kernel, as paddlenlp/transformers/llama/modeling.py LlamaAttention.forward (Paddle > 2.6:
                # q and k with different head counts in one call). use_neox_rotary_style=False is the
                # rotate-half layout of `apply_rotary` (halves of head_dim, tables [freqs, freqs]), not
                # the interleaved pairs (paddle/incubate/nn/functional/fused_rotary_position_embedding.py).
                # Positions restarting at each document go in as position_ids [batch, seq], the kernel picking
                # each token's row of the tables, as PaddleNLP's LlamaAttention passes its position_ids.
                from paddle.incubate.nn.functional import fused_rotary_position_embedding

                q, k, _ = fused_rotary_position_embedding(q, k, None, sin=sin.astype(q.dtype), cos=cos.astype(q.dtype),
                                                          position_ids=positions, use_neox_rotary_style=False)
            else:
                if positions is not None:
                    # Positions restart at each document: each sample its own rows of the tables.
                    cos, sin = (paddle.gather(t[0], positions.flatten(), axis=0).reshape([-1, seq, 1, d])
                                for t in (cos, sin))
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def core_attention(self, q, k, v, document_mask=None):
        """softmax(q k^T / sqrt(d) + bias + causal mask (+ document mask)) v; [batch, seq, heads, head_dim]
        in and out."""
        if self.config.use_flash_attention:
            if document_mask is not None:  # never dropped silently: flash takes documents as row indices
                raise ValueError("with use_flash_attention the documents go to flashmask_attention as row indices")
            return self.flash_attention(q, k, v)
        batch, seq = q.shape[0], q.shape[1]
        groups = self.attention_kv_heads  # grouped-query attention: each kv head serves num_heads / groups q heads
        q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))  # [batch, heads (kv heads), seq, d]
        # Grouped-query attention without repeating k and v: the q heads of one kv head are stacked
        # along the sequence axis ([batch, kv heads, q heads per kv head x seq, d]), so one product
        # per kv head gives their scores; the same dot products as with k repeated (same values to
        # the bit) without the repeat and its gradient (benchmarks/cpu_speed.md).
        d = q.shape[-1]
        q = q.reshape([batch, groups, -1, d])
        # Scale q (batch x seq x heads x d values; as PaddleNLP) rather than the scores (batch x heads x
        # seq x seq), and mask by adding 0/-inf: on CPU a full-size `where` + `full_like` and their
        # gradients cost more than these products (benchmarks/cpu_speed.md).
        scores = paddle.matmul(q.astype("float32") / math.sqrt(d), k.astype("float32"), transpose_y=True)
        scores = scores.reshape([batch, self.attention_heads, seq, seq])
        alibi, causal = self.shared_masks(seq)
        if alibi is not None:
            scores = scores + alibi[None]
        scores = scores + causal
        if document_mask is not None:  # [batch, 1, seq, seq]: no attention across a document boundary
            scores = scores + document_mask
        probs = F.softmax(scores, axis=-1).astype(v.dtype)
        probs = F.dropout(probs, self.config.attention_probs_dropout_prob, training=self.training)
        out = paddle.matmul(probs.reshape([batch, groups, -1, seq]), v)
        out = out.reshape([batch, self.attention_heads, seq, d]).transpose([0, 2, 1, 3])
        return out.reshape([batch, seq, -1])

    def flash_attention(self, q, k, v):
        """The fused kernel (GPU), as paddlenlp/transformers/llama/modeling.py scaled_dot_product_attention.

        k/v keep their kv heads: Paddle's flash_attn kernel shares them among the query heads itself
        (grouped-query attention; paddle/nn/functional/sdpa.py scaled_dot_product_attention, enable_gqa,
        repeats k/v only on its non-flash fallbacks). ALiBi goes in as an additive mask (bias plus
        causal mask, [batch, heads, seq, seq] in q's dtype) instead of is_causal, as PaddleNLP does."""
        batch, seq = q.shape[0], q.shape[1]
        mask = None
        if self.config.position_embedding == "alibi":
            # One per process for these shapes (models/constants.py): the kernel keeps it for the backward,
            # so every layer keeps the same tensor rather than its own copy.
            def build():
                alibi, causal = self.shared_masks(seq)
                return (alibi + causal)[None].astype(q.dtype).expand([batch, self.attention_heads, seq, seq])

            mask = shared_constant("flash_alibi_mask", (self.alibi_slope_list, batch, seq, str(q.dtype)), build)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.config.attention_probs_dropout_prob,
                                             is_causal=mask is None, training=self.training)
        return out.reshape([batch, seq, -1])

    def flashmask_attention(self, q, k, v, row_indices):
        """Packed documents on the fused kernel (GPU): Paddle 3.3.1's flashmask_attention
        (paddle/nn/functional/flash_attention.py; kernel paddle/phi/kernels/gpu/flash_attn_kernel.cu
        FlashMaskKernel) with causal=True and one row bound per key (`document_row_indices`), as
        PaddleFormers' flashmask_attention_forward (paddleformers/nn/attention/flashmask_attention.py) calls it
        for use_attn_mask_startend_row_indices. k/v keep their kv heads (the kernel shares them, as flash_attn);
        [batch, 1, seq, 1] indices serve every head. No additive bias: ALiBi with documents is refused under
        flash (llm_pretrain/parallel/layout.py)."""
        batch, seq = q.shape[0], q.shape[1]
        out = F.flashmask_attention(q, k, v, startend_row_indices=row_indices, causal=True,
                                    dropout=self.config.attention_probs_dropout_prob, training=self.training)
        return out.reshape([batch, seq, -1])

    def ring_attention(self, q, k, v, document_ids=None):
        """Context parallelism: the attention of this rank's queries over every rank's keys
        (models/ring_attention.py; each block with the flash kernel under use_flash_attention on GPU;
        with packed documents each block masked by them (flash blocks: flashmask_attention), blocks they mask
        entirely skipped)."""
        from models.ring_attention import ring_attention

        slopes = list(self.alibi_slope_list) if self.config.position_embedding == "alibi" else None
        return ring_attention(q, k, v, self.config.seq_length, slopes, pl.sequence_group(),
                              self.config.use_flash_attention, document_ids)

    def forward(self, hidden, documents: Documents | None = None):
        q, k, v = self.project_qkv(hidden, documents.positions if documents is not None else None)
        ring = self.config.context_parallel_degree > 1
        flashmask = documents is not None and self.config.use_flash_attention and not ring
        attention = self.ring_attention if ring else self.flashmask_attention if flashmask else self.core_attention
        # Packed documents: the ring takes the ids and masks its blocks (flash ones by FlashMask's row indices);
        # the flash kernel takes each key's row bound; otherwise the whole sequence's mask (under sep both fit:
        # after the all-to-all this rank holds every token of its heads).
        extra = (() if documents is None else (documents.ids,) if ring else (documents.row_indices,) if flashmask
                 else (documents.mask,))
        if self.training and recomputes(self.config, "core_attn", self.layer_index):
            from paddle.distributed.fleet.utils import recompute

            out = recompute(attention, q, k, v, *extra, use_reentrant=False)
        else:
            out = attention(q, k, v, *extra)
        if self.config.sep_parallel_degree > 1:  # back to this rank's tokens of every head
            out = pl.heads_to_sequence(self.config, out.reshape([0, 0, self.attention_heads, -1]))
            out = out.reshape([0, 0, -1])
        if hidden.ndim == 2:  # sequence parallel: the row-parallel projection takes flattened tokens
            out = out.reshape([-1, out.shape[-1]])
        return self.o_proj(out)


class MLP(nn.Layer):
    """SwiGLU (down(silu(gate x) * up x)) or the 4h GELU MLP of GPT-3 and Bloom."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = config.linear_bias
        if config.uses_swiglu:
            if config.fuse_attention_ffn:
                self.gate_up_proj = pl.column_linear(config, hidden, 2 * inner, bias, parts=(inner, inner))
            else:
                self.gate_proj = pl.column_linear(config, hidden, inner, bias)
                self.up_proj = pl.column_linear(config, hidden, inner, bias)
        else:
            self.up_proj = pl.column_linear(config, hidden, inner, bias)
        self.down_proj = pl.row_linear(config, inner, hidden, bias)

    def forward(self, x):
        if self.config.uses_swiglu:
            if self.config.fuse_attention_ffn:
                gate, up = self.gate_up_proj(x).chunk(2, axis=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            if self.config.use_fused_swiglu:
                # One kernel for silu(gate) * up (paddle/nn/functional/activation.py swiglu), as
                # paddlenlp/transformers/llama/modeling.py LlamaMLP.forward.
                return self.down_proj(F.swiglu(gate, up))
            return self.down_proj(F.silu(gate) * up)
        approximate = self.config.hidden_act == "gelu_tanh"
        return self.down_proj(F.gelu(self.up_proj(x), approximate=approximate))


class DecoderLayer(nn.Layer):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.input_layernorm = pl.norm(config, config.hidden_size)
        self.self_attn = latent_attention(config) if config.uses_mla else Attention(config)
        self.self_attn.layer_index = layer_index  # for no_recompute_layers under "core_attn"
        self.post_attention_layernorm = pl.norm(config, config.hidden_size)
        self.mlp = moe_block(config) if config.is_moe_layer(layer_index) else MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def attention_block(self, hidden, documents: Documents | None = None):
        return self.dropout(self.self_attn(self.input_layernorm(hidden), documents))

    def forward(self, hidden, documents: Documents | None = None):
        if self._recompute("full_attn"):
            from paddle.distributed.fleet.utils import recompute

            hidden = hidden + recompute(self.attention_block, hidden, documents, use_reentrant=False)
        else:
            hidden = hidden + self.attention_block(hidden, documents)
        return hidden + self.dropout(self.mlp(self.post_attention_layernorm(hidden)))

    def _recompute(self, granularity: str) -> bool:
        return self.training and recomputes(self.config, granularity, self.layer_index)


def latent_attention(config: ModelConfig):
    from models.mla import LatentAttention  # DeepSeek-V3 (models/mla.py)

    return LatentAttention(config)


def moe_block(config: ModelConfig):
    if config.has_correction_bias:
        # DeepSeek-V3's router and bias, ERNIE 4.5's with softmax scores (models/deepseek_moe.py)
        from models.deepseek_moe import DeepSeekMoE

        return DeepSeekMoE(config, MLP)
    return MoE(config, MLP)


class MTPLayer(nn.Layer):
    """DeepSeek-V3's multi-token prediction module of depth 1 (report sec. 2.2): at position i it combines the
    main model's last hidden state h_i with the embedding of token i + 1 and predicts token i + 2:
        h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]),  h'' = DecoderLayer(h'),  logits = head(norm(h''))
    The embedding and the output head are the main model's; the block, its norms, eh_proj (no bias, as the
    published weights' model.layers.61.eh_proj) and its final norm (shared_head.norm) are its own. The order
    [embedding; hidden] is that of the inference engines reading the published weights (vLLM deepseek_mtp.py
    DeepSeekMultiTokenPredictorLayer); PaddleFormers 0.4.1's DeepseekV2MTPLayer.forward concatenates
    [hidden; embedding] and its model applies the main norm (its import swaps the halves of eh_proj,
    models/families/deepseek_v3.py)."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        rms = config.replace(norm_type="rmsnorm")
        self.enorm = pl.norm(rms, config.hidden_size)
        self.hnorm = pl.norm(rms, config.hidden_size)
        self.eh_proj = pl.token_chunk_linear(config, 2 * config.hidden_size, config.hidden_size, bias=False)
        self.block = DecoderLayer(config, layer_index)
        self.norm = pl.norm(config, config.hidden_size)

    def forward(self, hidden, next_embeddings, documents=None):
        combined = self.eh_proj(paddle.concat([self.enorm(next_embeddings), self.hnorm(hidden)], axis=-1))
        return self.norm(self.block(combined, documents))


def mtp_labels(labels):
    """The MTP targets: position i predicts label i + 1 (token i + 2); the last position has none (-100)."""
    return paddle.concat([labels[:, 1:], paddle.full_like(labels[:, :1], -100)], axis=1)


class LMHead(nn.Layer):
    """Hidden states to logits over the vocabulary (this rank's slice under tensor parallelism).

    Tied heads reuse the word embedding matrix; Baichuan2's NormHead L2-normalizes its rows.
    """

    def __init__(self, config: ModelConfig, tied_embedding_weight=None):
        super().__init__()
        self.config = config
        if tied_embedding_weight is None:
            self.weight = self.create_parameter([config.hidden_size, config.vocab_size // config.tensor_parallel_degree],
                                                default_initializer=nn.initializer.Constant(0.0))
            pl.tag_split(self.weight, 1)
            # As fleet's parallel layers do for their slices: otherwise fleet.distributed_model
            # broadcasts it from tensor-parallel rank 0 and the grad clip counts it as replicated.
            self.weight.is_distributed = config.tensor_parallel_degree > 1
        # A plain list, so that the tied weight stays registered only under the embedding.
        self._tied_weight = [tied_embedding_weight] if tied_embedding_weight is not None else []

    def forward(self, hidden):
        if self._tied_weight:
            return output_logits(self.config, hidden, self._tied_weight[0], tied=True)
        return output_logits(self.config, hidden, self.weight, tied=False)


def output_logits(config: ModelConfig, hidden, weight, tied: bool):
    """logits = hidden @ W (W: [hidden, vocab]) or hidden @ E^T for a head tied to the embedding E."""
    hidden = pl.tensor_parallel_input(config, pl.gather_sequence(config, hidden))
    if tied:
        return paddle.matmul(hidden, weight, transpose_y=True)
    if config.norm_head:
        weight = F.normalize(weight, axis=0)
    return paddle.matmul(hidden, weight)


def causal_lm_loss(config: ModelConfig, logits, labels):
    """Mean next-token cross entropy over the tokens whose label is not -100.

    Under segment parallelism the logits are this rank's chunk of each sequence and `labels` whole:
    the per-token losses of every chunk are gathered, so each rank takes the mean of the whole batch."""
    labels = pl.split_segment(config, labels)
    per_token = pl.gather_segments(config, pl.cross_entropy_per_token(config, logits, labels))
    mask = pl.gather_segments(config, (labels != -100).astype("float32"))
    return (per_token * mask).sum() / mask.sum().clip(min=1.0)


def add_router_losses(config: ModelConfig, loss, router_stats: list, metrics: RouterMetrics | None = None):
    """Mixture of experts: the language-model loss plus the routers' auxiliary losses over every layer's
    statistics (models/moe.py); `metrics` (a training forward's) keeps them for train_log.jsonl. The
    same for one process and for the pipeline's last stage (models/pipeline.py)."""
    balance, z_loss = router_losses(config, router_stats)
    if metrics is not None:
        metrics.add(router_stats, balance)
    loss = loss + config.router_aux_loss_coef * balance + config.router_z_loss_coef * z_loss
    if config.seq_aux_loss_coef:  # DeepSeek-V3: every MoE layer's sequence-wise balance loss (models/deepseek_moe.py)
        loss = loss + config.seq_aux_loss_coef * paddle.add_n([s.seq_balance for s in router_stats])
    return loss


# ----------------------------------------------------------------------------- model
class CausalLM(nn.Layer):
    """The whole model in one process (tensor parallelism applies inside the blocks)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.LayerList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = pl.norm(config, config.hidden_size)
        tied = self.embeddings.word_embeddings.weight if config.tie_word_embeddings else None
        self.lm_head = LMHead(config, tied)
        if config.num_nextn_predict_layers:  # after the head, so that the main model's names come first
            self.mtp = MTPLayer(config, config.num_hidden_layers)
        self.router_metrics = RouterMetrics(config) if config.is_moe else None

    def forward(self, input_ids, labels=None, document_ids=None):
        """document_ids [batch, seq] (optional): each input token's document in its packed sample; attention
        then stays within documents (see `Documents`)."""
        documents = Documents(self.config, document_ids) if document_ids is not None else None
        hidden = self.embeddings(input_ids, documents)
        router_stats = []
        for layer in self.layers:
            if layer._recompute("full"):
                from paddle.distributed.fleet.utils import recompute

                hidden = recompute(layer, hidden, documents, use_reentrant=False)
            else:
                hidden = layer(hidden, documents)
            if isinstance(layer.mlp, MoE):
                router_stats.append(layer.mlp.last_stats)
        logits = self.lm_head(self.norm(hidden))
        if labels is None:
            return logits
        loss = causal_lm_loss(self.config, logits, labels)
        if self.config.num_nextn_predict_layers:
            mtp_loss = causal_lm_loss(self.config, self.mtp_logits(hidden, labels, documents), mtp_labels(labels))
            if isinstance(self.mtp.block.mlp, MoE):
                router_stats.append(self.mtp.block.mlp.last_stats)
            if self.training and self.router_metrics is not None:
                self.router_metrics.add_mtp(mtp_loss)
            loss = loss + self.config.mtp_loss_weight * mtp_loss
        if router_stats:
            loss = add_router_losses(self.config, loss, router_stats, self.router_metrics if self.training else None)
        return loss

    def mtp_logits(self, hidden, labels, documents=None):
        """The MTP module's logits [batch, seq, vocab] from the main model's last hidden states and the labels
        (token i + 1 at position i; -100 read as token 0: its position's target is masked or the last)."""
        # (under sep / cp this rank's part of every sequence, under sequence parallelism its chunk of the tokens, as
        # the main model's hidden states; the targets, mtp_labels, are shifted in whole sequences before the loss
        # splits them, so a chunk's last position predicts the next chunk's second token)
        next_tokens = pl.split_segment(self.config, labels.clip(min=0))
        next_embeddings = pl.split_sequence(self.config, self.embeddings.word_embeddings(next_tokens))
        return self.lm_head(self.mtp(hidden, next_embeddings, documents))

    def update_router_biases(self) -> None:
        """After an optimizer step: DeepSeek-V3's auxiliary-loss-free bias update in every MoE layer (rate 0: off)."""
        if not self.config.moe_bias_update_rate:
            return
        blocks = [layer.mlp for layer in self.layers] + ([self.mtp.block.mlp] if self.config.num_nextn_predict_layers else [])
        for block in blocks:
            if hasattr(block, "update_correction_bias"):
                block.update_correction_bias(self.config.moe_bias_update_rate)

    def canonical_named_parameters(self):
        """(name in the single-process model, parameter) for every parameter this rank holds."""
        return list(self.named_parameters())
