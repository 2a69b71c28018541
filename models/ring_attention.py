"""Ring attention: causal attention over a sequence split across the ranks of a context-parallel group.

Each rank holds 1/cp of the tokens of every sequence, balanced for the causal mask: the sequence is
cut into 2 x cp chunks and rank i holds chunks i and 2cp-1-i (an early and a late one, so every rank
has the same amount of visible keys). Key/value blocks travel around the ring; each rank combines
the attention of its queries over every block with the online softmax (running max and sum,
merged through the log-sum-exp). Backward is written out: it recomputes each block's probabilities
from the saved log-sum-exp and sends the key/value gradients around the ring with their blocks, so
that after cp steps each block's gradient arrives back at its owner.

The same algorithm as Paddle 3.3.1's paddle/distributed/auto_parallel/ring_attention.py
(RingFlashAttention: chunks `get_chunk_id(rank) = rank, 2cp-1-rank`, `update_out_and_lse`, dk/dv
passed along the ring in its backward), Megatron-LM's and torchtitan's context parallelism. Here
each block is plain float32 math (the CPU path): masks come from the global positions of the
query and key tokens, so any chunk layout is exact. Attention-probability dropout is not
supported (refused by llm_pretrain/layout.py).
"""

from __future__ import annotations

import math

import paddle
import paddle.distributed as dist

MASKED = -1e30  # finite: a block that hides every key of a row adds exp(-1e30 - max) = 0, never NaN


def chunk_ids(rank: int, degree: int) -> tuple[int, int]:
    """The two of 2 x degree chunks of every sequence that rank holds (causal load balance)."""
    return rank, 2 * degree - 1 - rank


def balanced_split(x, rank: int, degree: int, axis: int = 1):
    """This rank's two chunks of `x` along `axis`, concatenated."""
    chunks = paddle.split(x, 2 * degree, axis=axis)
    first, second = chunk_ids(rank, degree)
    return paddle.concat([chunks[first], chunks[second]], axis=axis)


def balanced_positions(seq_length: int, rank: int, degree: int):
    """Global positions (int64) of the tokens `balanced_split` gives rank."""
    chunk = seq_length // (2 * degree)
    first, second = chunk_ids(rank, degree)
    return paddle.concat([paddle.arange(first * chunk, (first + 1) * chunk, dtype="int64"),
                          paddle.arange(second * chunk, (second + 1) * chunk, dtype="int64")])


def ring_pass(tensors: list, group) -> list:
    """Send each tensor to the next rank of the ring and receive the previous rank's (same shapes).

    Even ranks send first, odd ranks receive first: point-to-point over gloo blocks, and this order
    pairs every send with a receive for any even ring size (the planner checks cp is even or 2)."""
    rank, size = group.rank, group.nranks
    following, previous = group.ranks[(rank + 1) % size], group.ranks[(rank - 1) % size]
    received = [paddle.empty_like(t) for t in tensors]
    for sends in ((True, False) if rank % 2 == 0 else (False, True)):
        for t, r in zip(tensors, received):
            if sends:
                dist.send(t.contiguous(), dst=following, group=group)
            else:
                dist.recv(r, src=previous, group=group)
    return received


def _scores(q, k, q_positions, k_positions, slopes, scale):
    """[batch, heads, queries, keys] float32: q k^T * scale + ALiBi (slope x key position) + causal mask."""
    groups = q.shape[2] // k.shape[2]
    qt = q.transpose([0, 2, 1, 3]).astype("float32") * scale
    kt = paddle.repeat_interleave(k, groups, axis=2).transpose([0, 2, 1, 3]).astype("float32")
    scores = paddle.matmul(qt, kt, transpose_y=True)
    keys = k_positions.astype("float32")
    if slopes:  # ALiBi: one slope per head of q (a list of floats)
        slopes = paddle.to_tensor(slopes, dtype="float32")
        scores = scores + slopes[None, :, None, None] * keys[None, None, None, :]
    visible = q_positions[:, None] >= k_positions[None, :]
    return scores + paddle.where(visible, paddle.zeros([], "float32"), paddle.full([], MASKED, "float32"))


def _repeat_heads(x, groups):
    return paddle.repeat_interleave(x, groups, axis=2).transpose([0, 2, 1, 3]).astype("float32")


def _sum_groups(grad, kv_heads):
    """[batch, heads, keys, d] gradient of repeated kv heads -> [batch, keys, kv heads, d]."""
    batch, heads, keys, d = grad.shape
    return grad.reshape([batch, kv_heads, heads // kv_heads, keys, d]).sum(2).transpose([0, 2, 1, 3])


class RingAttention(paddle.autograd.PyLayer):
    """softmax(q k^T / sqrt(d) + ALiBi + causal mask) v over the whole ring; [batch, local seq, heads, d]."""

    @staticmethod
    def forward(ctx, q, k, v, seq_length, slopes, group):
        rank, size = group.rank, group.nranks
        q_positions = balanced_positions(seq_length, rank, size)
        scale = 1.0 / math.sqrt(q.shape[-1])
        groups = q.shape[2] // k.shape[2]
        block_k, block_v = k, v
        for step in range(size):
            if step < size - 1:  # the next block, while (on GPU, overlapping) this one is computed
                following = ring_pass([block_k, block_v], group)
            owner = (rank - step) % size
            scores = _scores(q, block_k, q_positions, balanced_positions(seq_length, owner, size), slopes, scale)
            block_max = scores.max(-1, keepdim=True)
            if step == 0:  # the own block holds every query's own position: finite maxima from here on
                running_max = block_max
                probs = paddle.exp(scores - running_max)
                total = probs.sum(-1, keepdim=True)
                out = paddle.matmul(probs, _repeat_heads(block_v, groups))
            else:
                new_max = paddle.maximum(running_max, block_max)
                correction = paddle.exp(running_max - new_max)
                probs = paddle.exp(scores - new_max)
                total = total * correction + probs.sum(-1, keepdim=True)
                out = out * correction + paddle.matmul(probs, _repeat_heads(block_v, groups))
                running_max = new_max
            if step < size - 1:
                block_k, block_v = following
        out = out / total
        lse = running_max + paddle.log(total)  # [batch, heads, queries, 1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq_length, ctx.slopes, ctx.group = seq_length, slopes, group
        return out.transpose([0, 2, 1, 3]).astype(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensor()
        group, seq_length, slopes = ctx.group, ctx.seq_length, ctx.slopes
        rank, size = group.rank, group.nranks
        q_positions = balanced_positions(seq_length, rank, size)
        scale = 1.0 / math.sqrt(q.shape[-1])
        kv_heads = k.shape[2]
        groups = q.shape[2] // kv_heads
        grad_out = grad_out.transpose([0, 2, 1, 3]).astype("float32")  # [batch, heads, queries, d]
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        qt = q.transpose([0, 2, 1, 3]).astype("float32") * scale
        grad_q = paddle.zeros(qt.shape, "float32")
        block_k, block_v = k, v
        grad_k, grad_v = paddle.zeros(k.shape, "float32"), paddle.zeros(v.shape, "float32")  # travel with the block
        for step in range(size):
            owner = (rank - step) % size
            scores = _scores(q, block_k, q_positions, balanced_positions(seq_length, owner, size), slopes, scale)
            probs = paddle.exp(scores - lse)
            grad_v += _sum_groups(paddle.matmul(probs, grad_out, transpose_x=True), kv_heads)
            grad_probs = paddle.matmul(grad_out, _repeat_heads(block_v, groups), transpose_y=True)
            grad_scores = probs * (grad_probs - delta)
            grad_q += paddle.matmul(grad_scores, _repeat_heads(block_k, groups))
            grad_k += _sum_groups(paddle.matmul(grad_scores, qt, transpose_x=True), kv_heads)
            del scores, probs, grad_probs, grad_scores  # before the next block's: 5, not 9, block-sized tensors alive
            if step < size - 1:  # the block and its gradient so far go on to the next rank
                block_k, block_v, grad_k, grad_v = ring_pass([block_k, block_v, grad_k, grad_v], group)
            else:  # the last holder is the owner's predecessor: one more hop home
                grad_k, grad_v = ring_pass([grad_k, grad_v], group)
        grad_q = (grad_q * scale).transpose([0, 2, 1, 3])
        return grad_q.astype(q.dtype), grad_k.astype(k.dtype), grad_v.astype(v.dtype)


def ring_attention(q, k, v, seq_length: int, slopes, group):
    """[batch, local seq, heads, d] q and [batch, local seq, kv heads, d] k, v -> [batch, local seq, heads x d].

    slopes: the ALiBi slopes of q's heads (floats) or None."""
    out = RingAttention.apply(q, k, v, seq_length, slopes, group)
    return out.reshape([out.shape[0], out.shape[1], -1])
