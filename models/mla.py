"""Multi-head latent attention (MLA; DeepSeek-V2/V3), the decoder's attention when config.kv_lora_rank > 0.

    q        = q_b(RMSNorm(q_a(x)))                        [heads, nope + rope] per token
    c, k_pe  = kv_a_proj_with_mqa(x)                        c: [kv_lora_rank], k_pe: [rope] (one for every head)
    k_nope,v = kv_b(RMSNorm(c))                             [heads, nope], [heads, v]
    k        = [k_nope, rotate(k_pe)], q = [q_nope, rotate(q_pe)]
    out      = o_proj(softmax(q k^T x scale + causal mask) v),  scale = (nope + rope)^-0.5 x mscale^2

mscale = 0.1 x mscale_all_dim x ln(factor) + 1 with YaRN's rope scaling (1 without). The rotated parts come
in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...: pair j turns by position x inv_freq[j]. PaddleFormers
reorders them to halves [x0, x2, ..; x1, x3, ..] before its rotate-half rotation, q and k alike, so q.k is the
same. The tables are YaRN's frequencies (models/rope.py) times its cos/sin factor, built here (not with the
decoder's, which rotate halves) so that this module needs nothing of models/decoder.py.
Source of every line: PaddleFormers 0.4.1 paddleformers/transformers/deepseek_v2/modeling.py
(DeepseekV2Attention, apply_rotary_pos_emb, yarn_get_mscale), which DeepseekV3ForCausalLM uses.

Tensor parallelism (+ SP) splits the heads as PaddleFormers 0.4.1 does (deepseek_v2/modeling.py
DeepseekV2Attention.__init__: "q_a_proj and kv_a_proj_with_mqa are the small weight", plain linears; q_b_proj and
kv_b_proj tp_plan="colwise", o_proj "rowwise"): every rank computes the whole latents, then its heads' q, k_nope
and v from them. Without SP the column-parallel projections sum their input's gradient over the ranks, so the
latent projections and their norms get whole, equal gradients; under SP they see this rank's chunk of the tokens
and their weights are marked as sequence-parallel parameters (their gradients summed over the ranks, as
PaddleFormers marks them). The rope key k_pe feeds every head but passes no column-parallel projection: each rank's
gradient of it covers only its own heads, so it goes through `pl.replicated_input` (gathered under SP, as
PaddleFormers' GatherOp, and its gradient summed over the ranks either way).

Segment parallelism (sep): this rank's tokens of every head are projected, then the all-to-all gives every token of
1/sep of the heads (k_pe expanded to the heads first), the rotation takes the whole sequence's positions, and the
output returns to this rank's tokens before o_proj (docs/parallel-layouts.md, DeepSeek-V3's sep). Context parallelism:
this rank's two chunks rotated by their global positions, k (k_pe expanded) and v around models/ring_attention.py's
ring, q scaled so that the ring's 1/sqrt(q head dim) gives `softmax_scale` (its plain blocks: the flash blocks take one
head dim for k and v, so flash under cp is refused, llm_pretrain/parallel/layout.py check_deepseek_v3).

Flash attention (use_flash_attention, GPU; the CPU stand-ins in tests): the decoder's kernels (sdpa's flash_attn, and
flashmask_attention with packed documents) with q pre-scaled and v padded to q's head dim, as PaddleFormers calls them
(`flash_attention`). recompute_granularity core_attn recomputes `attention` (either path) in backward.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from models import parallel_layers as pl
from models.config import ModelConfig, recomputes
from models.rope import scaled_inv_freq, yarn_cos_sin_factor, yarn_mscale


def softmax_scale(config: ModelConfig) -> float:
    """(nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (PaddleFormers' DeepseekV2Attention)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


_TABLES: dict = {}


def pair_tables(config: ModelConfig, seq: int):
    """cos, sin [seq, rope / 2] float32 of the interleaved pairs' angles (built once per size and scaling)."""
    scaling = config.rope_scaling
    key = (seq, config.qk_rope_head_dim, config.rope_theta, tuple(sorted(scaling.items())) if scaling else None)
    if key not in _TABLES:
        dim = config.qk_rope_head_dim
        inv_freq = (1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)).astype(np.float32)
        inv_freq = scaled_inv_freq(inv_freq, scaling, config.rope_theta)
        angles = np.outer(np.arange(seq, dtype=np.float32), inv_freq)
        factor = yarn_cos_sin_factor(scaling)
        _TABLES[key] = tuple(paddle.to_tensor((f(angles) * factor).astype(np.float32)) for f in (np.cos, np.sin))
    return _TABLES[key]


def rotate_pairs(x, cos, sin):
    """x [batch, seq, heads, d] in interleaved pairs, each turned by its angle; cos/sin [batch or 1, seq, d / 2]."""
    pairs = x.astype("float32").reshape(x.shape[:-1] + [x.shape[-1] // 2, 2])
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # over the heads
    return paddle.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape).astype(x.dtype)


class LatentAttention(nn.Layer):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config
        heads = c.num_attention_heads
        self.num_heads = heads // pl.tensor_parallel_rank_and_degree(c)[1]  # this rank's
        self.q_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        rms = c.replace(norm_type="rmsnorm")
        self.q_a_proj = pl.token_chunk_linear(c, c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = pl.norm(rms, c.q_lora_rank)
        self.q_b_proj = pl.column_linear(c, c.q_lora_rank, heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = pl.token_chunk_linear(c, c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                                        bias=False)
        self.kv_a_layernorm = pl.norm(rms, c.kv_lora_rank)
        self.kv_b_proj = pl.column_linear(c, c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = pl.row_linear(c, heads * c.v_head_dim, c.hidden_size, bias=False)
        self.softmax_scale = softmax_scale(config)
        # Heads inside the attention under segment parallelism: 1/sep of this rank's (layout.py: sep divides them)
        self.sep_degree = pl.sep_rank_and_degree(c)[1]
        self.attention_heads = self.num_heads // self.sep_degree

    def forward(self, hidden, documents=None):
        c = self.config
        # Under sequence parallelism `hidden` is this rank's chunk of the flattened tokens; the column-parallel
        # projections gather every token, so q, k and v are whole sequences of this rank's heads.
        seq = c.tokens_per_rank if hidden.ndim == 2 else hidden.shape[1]
        nope, rope, heads = c.qk_nope_head_dim, c.qk_rope_head_dim, self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))).reshape([-1, seq, heads, self.q_head_dim])
        batch = q.shape[0]
        q_nope, q_pe = paddle.split(q, [nope, rope], axis=-1)
        compressed, k_pe = paddle.split(self.kv_a_proj_with_mqa(hidden), [c.kv_lora_rank, rope], axis=-1)
        k_pe = pl.replicated_input(c, k_pe)  # every token; its gradient summed over the ranks' heads
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).reshape([batch, seq, heads, nope + c.v_head_dim])
        k_nope, v = paddle.split(kv, [nope, c.v_head_dim], axis=-1)
        k_pe = k_pe.reshape([batch, seq, 1, rope])
        if self.sep_degree > 1:
            # Segment parallelism (Ulysses): from this rank's tokens of every head to every token of 1/sep of the
            # heads, rotary positions then those of the whole sequence, as PaddleFormers' LlamaAttention reshards
            # q/k/v before its rope (transformers/llama/modeling.py, ReshardLayer of segment_parallel_utils.py;
            # its DeepseekV2Attention has no sep path). The rope key, one for every head, goes with each head.
            k = paddle.concat([k_nope, k_pe.expand([batch, seq, heads, rope])], axis=-1)
            q, k, v = (pl.sequence_to_heads(c, t) for t in (q, k, v))
            seq, heads = q.shape[1], self.attention_heads
            q_nope, q_pe = paddle.split(q, [nope, rope], axis=-1)
            k_nope, k_pe = paddle.split(k, [nope, rope], axis=-1)
        # Context parallelism (the ring): this rank's two chunks of every sequence, rotated by their global positions
        ring = c.context_parallel_degree > 1
        positions = documents.positions if documents is not None else None  # (whole sequences', restarting)
        if ring:
            positions = pl.split_segment(c, positions) if positions is not None else \
                pl.token_positions(c, seq).unsqueeze(0)
        cos, sin = pair_tables(c, c.seq_length if ring else seq)
        if positions is not None:  # each token's row of the tables
            cos, sin = (paddle.gather(t, positions.flatten(), axis=0).reshape([-1, seq, rope // 2])
                        for t in (cos, sin))
        else:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        q_pe = rotate_pairs(q_pe, cos, sin)
        k_pe = rotate_pairs(k_pe, cos, sin)
        q = paddle.concat([q_nope, q_pe], axis=-1)  # [batch, seq, heads, nope + rope]
        k = paddle.concat([k_nope, k_pe.expand([batch, seq, heads, rope])], axis=-1)
        if ring:
            from models.ring_attention import ring_attention

            # The ring scales the scores by 1/sqrt(q head dim); q scaled first by softmax_scale x sqrt(q head dim)
            # gives MLA's YaRN-corrected scale, as PaddleFormers 0.4.1 feeds its kernel, which divides by sqrt(d)
            # (deepseek_v2/modeling.py scaled_dot_product_attention: query_states * softmax_scale * q_head_dim**0.5).
            # The ring's blocks take v's own head dim.
            q = q * (self.softmax_scale * math.sqrt(self.q_head_dim))
            out = ring_attention(q, k, v, c.seq_length, None, pl.sequence_group(), False,
                                 documents.ids if documents is not None else None)  # [batch, seq, heads x v]
        else:
            core = self.flash_attention if c.use_flash_attention else self.plain_attention
            if self.training and self.recomputes_core_attention():
                from paddle.distributed.fleet.utils import recompute

                # as the decoder's Attention: q, k, v (and the documents) kept, the core rebuilt in backward;
                # sep's all-to-all stays outside
                out = recompute(core, q, k, v, documents, use_reentrant=False)
            else:
                out = core(q, k, v, documents)  # [batch, seq, heads, v]
            if self.sep_degree > 1:  # back to this rank's tokens of every head
                out = pl.heads_to_sequence(c, out)
            out = out.reshape([batch, out.shape[1], -1])
        if hidden.ndim == 2:  # sequence parallel: the row-parallel projection takes flattened tokens
            out = out.reshape([-1, out.shape[-1]])
        return self.o_proj(out)

    def recomputes_core_attention(self) -> bool:
        return recomputes(self.config, "core_attn", getattr(self, "layer_index", 0))

    def plain_attention(self, q, k, v, documents=None):
        """softmax(q k^T x scale + causal mask (+ document mask)) v: [batch, seq, heads, d] in (under sep every token
        of 1/sep of this rank's heads), [batch, seq, heads, v] out."""
        seq = q.shape[1]
        q, k = q.transpose([0, 2, 1, 3]), k.transpose([0, 2, 1, 3])  # [batch, heads, seq, nope + rope]
        scores = paddle.matmul(q.astype("float32") * self.softmax_scale, k.astype("float32"), transpose_y=True)
        scores = scores + paddle.triu(paddle.full([seq, seq], float("-inf"), dtype="float32"), diagonal=1)
        if documents is not None:
            scores = scores + documents.mask
        probs = F.softmax(scores, axis=-1).astype(v.dtype)
        probs = F.dropout(probs, self.config.attention_probs_dropout_prob, training=self.training)
        out = paddle.matmul(probs, v.transpose([0, 2, 1, 3]))  # [batch, heads, seq, v]
        return out.transpose([0, 2, 1, 3])

    def flash_attention(self, q, k, v, documents=None):
        """The fused kernel (GPU) as PaddleFormers 0.4.1 calls it for MLA (paddleformers/transformers/deepseek_v2/
        modeling.py scaled_dot_product_attention): the kernel takes one head dim for q, k and v and scales by
        1/sqrt(that dim) with no scale argument (flash_attn's contract; sdpa leaves flash for an explicit `scale`),
        so q is multiplied by softmax_scale x sqrt(nope + rope) (YaRN's mscale kept), v padded with zeros to
        nope + rope and the output's padding sliced off. The same calls as the decoder's Attention: sdpa causal
        (models/decoder.py flash_attention), packed documents as FlashMask's row bounds (flashmask_attention)."""
        v_dim = v.shape[-1]
        q = q * (self.softmax_scale * math.sqrt(self.q_head_dim))
        v = paddle.concat([v, paddle.zeros(v.shape[:-1] + [self.q_head_dim - v_dim], dtype=v.dtype)], axis=-1)
        dropout = self.config.attention_probs_dropout_prob
        if documents is not None:
            out = F.flashmask_attention(q, k, v, startend_row_indices=documents.row_indices, causal=True,
                                        dropout=dropout, training=self.training)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, training=self.training)
        return out[..., :v_dim]  # the padded columns: zero weights times the probabilities
