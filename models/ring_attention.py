"""Ring attention: causal attention over a sequence split across the ranks of a context-parallel group.

Each rank holds 1/cp of the tokens of every sequence, balanced for the causal mask: the sequence is
cut into 2 x cp chunks and rank i holds chunks i and 2cp-1-i (an early and a late one, so every rank
has the same amount of visible keys). Key/value blocks travel around the ring; each rank combines
the attention of its queries over every block through the blocks' log-sum-exp (online softmax).
Backward is written out: each block's gradients come from the saved output and log-sum-exp, and
the key/value gradients travel around the ring with their blocks, so that after cp steps each
block's gradient arrives back at its owner.

The same algorithm as Paddle 3.3.1's paddle/distributed/auto_parallel/ring_attention.py
(RingFlashAttention: chunks `get_chunk_id(rank) = rank, 2cp-1-rank`; per step the own block causal,
an earlier rank's block as all queries over its first chunk, a later rank's as the second query
chunk over the whole block; `update_out_and_lse`; dk/dv passed along the ring in its backward),
Megatron-LM's and torchtitan's context parallelism. (PaddleNLP 2.8.1 has no ring attention.)

One block computation, two implementations with the same contract (`attention_blocks` chooses):
FlashBlocks, Paddle's flash attention kernel (GPU, bf16/fp16), and PlainBlocks, float32 matmul and
softmax (CPU, and any run without use_flash_attention). Attention-probability dropout is not
supported (refused by llm_pretrain/parallel/layout.py).
"""

from __future__ import annotations

import functools
import math

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle import _C_ops

from models.constants import shared_constant

MASKED = -1e30  # the causal mask: finite in float32 (and bf16), exp(-1e30 - lse) = 0


def chunk_ids(rank: int, degree: int) -> tuple[int, int]:
    """The two of 2 x degree chunks of every sequence that rank holds (causal load balance)."""
    return rank, 2 * degree - 1 - rank


def balanced_split(x, rank: int, degree: int, axis: int = 1):
    """This rank's two chunks of `x` along `axis`, concatenated."""
    chunks = paddle.split(x, 2 * degree, axis=axis)
    first, second = chunk_ids(rank, degree)
    return paddle.concat([chunks[first], chunks[second]], axis=axis)


def balanced_positions(seq_length: int, rank: int, degree: int):
    """Global positions (int64) of the tokens `balanced_split` gives rank (one tensor per process,
    models/constants.py: every layer's ring steps, forward and backward, take the same)."""
    def build():
        chunk = seq_length // (2 * degree)
        first, second = chunk_ids(rank, degree)
        return paddle.concat([paddle.arange(first * chunk, (first + 1) * chunk, dtype="int64"),
                              paddle.arange(second * chunk, (second + 1) * chunk, dtype="int64")])
    return shared_constant("ring_positions", (seq_length, rank, degree), build)


def ring_pass(tensors: list, group) -> list:
    """Send each tensor to the next rank of the ring and receive the previous rank's (same shapes), now.

    Even ranks send first, odd ranks receive first: point-to-point over gloo blocks (measured: with every
    rank sending first, gloo/transport/tcp/unbound_buffer.cc:133 times out), and this order pairs every
    send with a receive for any even ring size (the planner checks cp is even or 2)."""
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


def transfers_overlap(group) -> bool:
    """Whether the group's backend sends and receives while the ranks compute (NCCL and the other device
    backends); gloo's send blocks until the peer receives. (The CPU stand-ins open the overlapped path to
    gloo: llm_pretrain/cpu/kernel_standins.py.)"""
    return getattr(group, "backend", "GLOO").upper() != "GLOO"


class PendingPass:
    """A ring pass on its way: `wait()` returns the tensors received from the previous rank."""

    def __init__(self, received: list, in_flight: list | None = None):
        self.received, self.in_flight = received, in_flight  # in_flight: the P2POps, kept alive until wait

    def wait(self) -> list:
        if self.in_flight and not self.received[0].place.is_cpu_place():
            # As Paddle's own ring (paddle/distributed/auto_parallel/ring_attention.py:97 RingCommunicator.wait)
            # and PaddleFormers' (transformers/ring_flash_attention.py:40): the tasks of a coalesced
            # batch_isend_irecv cannot be waited on one by one, so the device is synchronised.
            paddle.device.synchronize()
        self.in_flight = None
        return self.received


def start_ring_pass(tensors: list, group) -> PendingPass:
    """Start sending each tensor to the next rank and receiving the previous rank's; the caller computes,
    then waits. Where the backend overlaps transfers, one `batch_isend_irecv` of every send and receive,
    as Paddle's own ring (auto_parallel/ring_attention.py:118-148 RingCommunicator.send_recv, sends before
    receives) and PaddleFormers'; on gloo the pass is done now (`ring_pass`)."""
    if not transfers_overlap(group):
        return PendingPass(ring_pass(tensors, group))
    rank, size = group.rank, group.nranks
    following, previous = group.ranks[(rank + 1) % size], group.ranks[(rank - 1) % size]
    received = [paddle.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), following, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, previous, group) for r in received]
    dist.batch_isend_irecv(ops)
    return PendingPass(received, ops)


# ----------------------------------------------------------------------------- blocks
# A block is the attention of some queries over some keys, [batch, tokens, heads, head_dim] in (k and
# v with their kv heads: grouped-query attention), scaled by 1/sqrt(head_dim):
#   forward(q, k, v, causal, bias) -> out [batch, queries, heads, d], lse [batch, heads, queries] float32
#   backward(q, k, v, out, lse, grad_out, causal, bias) -> grad q, grad k, grad v (shapes of q, k, v)
# `lse` is the log-sum-exp of each query's scores (the flash kernel's softmax_lse layout); backward
# takes the ring's final out and lse, so that softmax(scores) = exp(scores - lse) over the whole
# ring. `causal`: the block on the diagonal (square: query i sees keys 0..i). `bias`: None or float32
# [1, heads, queries, keys] added to the scores (ALiBi).

class PlainBlocks:
    """Float32 matmul and softmax: every device, the only path on CPU."""

    @staticmethod
    def forward(q, k, v, causal, bias):
        scores = _scores(q, k, causal, bias)
        lse = paddle.logsumexp(scores, axis=-1)
        probs = paddle.exp(scores - lse.unsqueeze(-1))
        out = paddle.matmul(probs, _repeat_heads(v, q.shape[2] // v.shape[2]))
        return out.transpose([0, 2, 1, 3]), lse

    @staticmethod
    def backward(q, k, v, out, lse, grad_out, causal, bias):
        kv_heads = k.shape[2]
        groups = q.shape[2] // kv_heads
        scale = 1.0 / math.sqrt(q.shape[-1])
        probs = paddle.exp(_scores(q, k, causal, bias) - lse.unsqueeze(-1))
        grad_out = grad_out.transpose([0, 2, 1, 3]).astype("float32")  # [batch, heads, queries, d]
        delta = (grad_out * out.transpose([0, 2, 1, 3]).astype("float32")).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_v = _sum_groups(paddle.matmul(probs, grad_out, transpose_x=True), kv_heads)
        grad_probs = paddle.matmul(grad_out, _repeat_heads(v, groups), transpose_y=True)
        del grad_out
        grad_scores = probs * (grad_probs - delta)
        del probs, grad_probs  # from here grad_scores is the only block-sized tensor
        grad_q = paddle.matmul(grad_scores, _repeat_heads(k, groups)) * scale
        qt = q.transpose([0, 2, 1, 3]).astype("float32") * scale
        grad_k = _sum_groups(paddle.matmul(grad_scores, qt, transpose_x=True), kv_heads)
        return grad_q.transpose([0, 2, 1, 3]), grad_k, grad_v


class FlashBlocks:
    """Paddle 3.3.1's flash attention kernel (GPU), called as its ring attention calls it
    (paddle/distributed/auto_parallel/ring_attention.py:218-235 and 347-364):

        out, softmax, softmax_lse, seed_offset = _C_ops.flash_attn(
            q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name)
        dq, dk, dv = _C_ops.flash_attn_grad(q, k, v, out, softmax_lse, seed_offset, attn_mask, dout,
                                            dropout, causal)

    (the argument order of paddle/phi/kernels/flash_attn_kernel.h FlashAttnKernel and
    flash_attn_grad_kernel.h FlashAttnGradKernel). q, k, v, out, dout are [batch, seq, heads, d] in
    one half-precision dtype; k and v keep their kv heads (the kernel shares each among its query
    heads, as sdpa.py calls it for grouped-query attention). softmax_lse is float32
    [batch, heads, seqlen_q rounded up to 128] (paddle/phi/kernels/gpu/flash_attn_utils.h
    FlashAttnParamsBase: softmax_lse_dims), of which the ring keeps the first seqlen_q entries and hands
    flash_attn_grad [batch, heads, seqlen_q], as Paddle's ring does (ring_attention.py:273, 334); the
    scale is 1/sqrt(head_dim). `causal` masks a square block's upper
    triangle. An additive mask goes in attn_mask, in q's dtype, with causal false (ALiBi, as
    PaddleNLP's llama/modeling.py and this repository's dense flash path pass it)."""

    @staticmethod
    def _mask(q, k, causal, bias):
        if bias is None:
            return None, causal
        if causal:
            bias = bias + _causal_mask(q.shape[1], k.shape[1])
        return bias.astype(q.dtype).expand([q.shape[0], q.shape[2], q.shape[1], k.shape[1]]), False

    @staticmethod
    def forward(q, k, v, causal, bias):
        mask, causal = FlashBlocks._mask(q, k, causal, bias)
        q, k, v = (t.contiguous() for t in (q, k, v))  # the ring hands in halves of its blocks
        out, _, lse, _ = _C_ops.flash_attn(q, k, v, None, mask, 0.0, causal, False, False, "")
        # The kernel allocates softmax_lse with seqlen_q rounded up to 128 (gpu/flash_attn_utils.h
        # FlashAttnParamsBase: softmax_lse_dims = {batch, heads, seqlen_q_rounded}); the first seqlen_q
        # entries of each row are the log-sum-exps, as Paddle's ring slices them (ring_attention.py:273).
        return out, lse[:, :, :q.shape[1]]

    @staticmethod
    def backward(q, k, v, out, lse, grad_out, causal, bias):
        mask, causal = FlashBlocks._mask(q, k, causal, bias)
        q, k, v, out, lse, grad_out = (t.contiguous() for t in (q, k, v, out, lse, grad_out))
        # No dropout, so no random state to replay: Paddle's ring passes this [0, 0] on the host
        # when it has no fixed seed (ring_attention.py:495-498).
        seed_offset = paddle.to_tensor([0, 0], dtype="int64", place=paddle.CPUPlace())
        return _C_ops.flash_attn_grad(q, k, v, out, lse, seed_offset, mask, grad_out, 0.0, causal)


class FlashMaskBlocks:
    """FlashBlocks with packed documents (reset_attention_mask): Paddle 3.3.1's flashmask_attention kernel,
    FlashAttnBaseKernel with the document mask as row indices instead of a dense mask
    (paddle/phi/kernels/gpu/flash_attn_kernel.cu FlashMaskKernel, flash_attn_grad_kernel.cu FlashMaskGradKernel),
    called through its binding as FlashBlocks calls flash_attn's, because the ring hands each block's backward
    the ring's merged out and lse (the wrapper F.flashmask_attention would differentiate one block alone):

        out, softmax, softmax_lse, seed_offset = _C_ops.flashmask_attention(
            q, k, v, startend_row_indices, fixed_seed_offset, dropout, causal, return_softmax, is_test, rng_name)
        dq, dk, dv = _C_ops.flashmask_attention_grad(q, k, v, startend_row_indices, out, softmax_lse,
                                                     seed_offset, out_grad, dropout, causal)

    (the binding paddle/nn/functional/flash_attention.py flashmask_attention calls in its fa_version 2 branch;
    the grad's order as the kernel stand-in takes it, llm_pretrain/cpu/kernel_standins.py). `rows` stands where the
    other blocks take `bias`: the block's startend_row_indices, local to the block's query rows
    (DocumentBlocks.row_indices): on the diagonal causal with one bound per key (as models/decoder.py
    document_row_indices, PaddleFormers' use_attn_mask_startend_row_indices), off it non-causal [LTS, UTE]
    (the wrapper's docstring "Document Mask"). Same lse layout and scale as flash_attn's (one base kernel)."""

    @staticmethod
    def forward(q, k, v, causal, rows):
        q, k, v = (t.contiguous() for t in (q, k, v))
        out, _, lse, _ = _C_ops.flashmask_attention(q, k, v, rows, None, 0.0, causal, False, False, "")
        lse = lse[:, :, :q.shape[1]]
        # A query row that sees no key of this block (a later document's) leaves flash attention 2 with out 0 and
        # lse +inf (csrc/flash_attn/src/softmax.h normalize_softmax_lse of PaddlePaddle/flash-attention, Paddle's
        # flash kernels: `(sum == 0.f || sum != sum) ? INFINITY`); for the merge the row's share must be 0, so
        # its lse becomes MASKED (merge_blocks: sigmoid(MASKED - lse) = 0).
        return out, paddle.where(paddle.isinf(lse), paddle.full([], MASKED, "float32"), lse)

    @staticmethod
    def backward(q, k, v, out, lse, grad_out, causal, rows):
        q, k, v, out, lse, grad_out = (t.contiguous() for t in (q, k, v, out, lse, grad_out))
        seed_offset = paddle.to_tensor([0, 0], dtype="int64", place=paddle.CPUPlace())  # no dropout (FlashBlocks)
        return _C_ops.flashmask_attention_grad(q, k, v, rows, out, lse, seed_offset, grad_out, 0.0, causal)


FLASH_DTYPES = ("float16", "bfloat16")


def attention_blocks(use_flash_attention: bool, place, dtype, head_dim: int):
    """FlashBlocks where the run asks for flash attention (config.use_flash_attention, as the dense
    path) and the kernel takes the inputs: a GPU place, a half-precision dtype, head_dim a multiple
    of 8 up to 256 (the checks of paddle/nn/functional/sdpa.py before it calls flash_attn:
    check_head_dim_size_flash, check_dtypes_low_precision_fa); PlainBlocks otherwise."""
    dtype = str(dtype).replace("paddle.", "")
    if use_flash_attention and place.is_gpu_place() and dtype in FLASH_DTYPES and head_dim % 8 == 0 \
            and head_dim <= 256:
        return FlashBlocks
    return PlainBlocks


def merge_blocks(out, lse, block_out, block_lse):
    """The attention over the keys of both: out [batch, queries, heads, d] float32, lse [batch, heads,
    queries]. Paddle's update_out_and_lse (ring_attention.py:151-171): new lse = log(e^lse + e^block_lse),
    and out moves toward block_out by the block's share sigmoid(block_lse - lse), in float32."""
    share = F.sigmoid(block_lse - lse).transpose([0, 2, 1]).unsqueeze(-1)
    out = out - (out - block_out.astype("float32")) * share
    return out, lse - F.log_sigmoid(lse - block_lse)


def _alibi(slopes, q_positions, k_positions):
    """[1, heads, queries, keys] float32: slope x (key position - query position), or None. Softmax is
    invariant to a per-query constant, so this gives the dense path's attention (slope x key
    position); the distances stay small near the diagonal when the flash kernel's mask is bf16."""
    if not slopes:
        return None
    distance = k_positions.astype("float32")[None, :] - q_positions.astype("float32")[:, None]
    # The block's distances differ per step; the slopes are one device tensor per process, not a copy
    # from the host in every block of every layer.
    slopes = shared_constant("ring_slopes", (tuple(slopes),), lambda: paddle.to_tensor(slopes, dtype="float32"))
    return slopes[None, :, None, None] * distance[None, None]


class DocumentBlocks:
    """Packed documents on the ring (reset_attention_mask): a query sees only keys of its own document.
    Every rank holds the document ids of the whole sequences [batch, seq] (they come in with the batch,
    before the split), so each block takes the rows of its queries' and its keys' global positions. A block
    in which no query shares a document with any key is skipped, forward and backward alike (its share of
    the softmax is 0); the others get the mask as an additive bias (0 / MASKED). Not a tensor, so that
    RingAttention (a PyLayer) takes no gradient for it. Each block's bias (and its host read: skip or not) is
    computed once per forward and kept, for every layer and for backward (`document_blocks`)."""

    def __init__(self, document_ids, row_indices: bool = False):
        self.ids = document_ids
        self.row_indices = row_indices  # FlashMaskBlocks: each block's startend_row_indices instead of a bias
        self.built = {}  # block key -> bias (or row indices) or SKIP

    def bias(self, q_positions, k_positions, key):
        """[batch, 1, queries, keys] float32, or SKIP when the block is masked entirely. key: the block
        (rank, owner, which part), the same in every layer. With row_indices, `block_rows` instead."""
        if self.row_indices:
            return self.block_rows(q_positions, k_positions, key)
        if key not in self.built:
            same = (paddle.index_select(self.ids, q_positions, axis=1).unsqueeze(2)
                    == paddle.index_select(self.ids, k_positions, axis=1).unsqueeze(1))
            self.built[key] = paddle.where(same, 0.0, MASKED).astype("float32").unsqueeze(1) if bool(same.any()) \
                else SKIP
        return self.built[key]

    def block_rows(self, q_positions, k_positions, key):
        """[batch, 1, keys, 1 or 2] int32 FlashMask row indices of the block, or SKIP. The block's query rows
        hold increasing global positions (one chunk, or chunk i then chunk 2cp-1-i) and the ids do not decrease,
        so the rows of a key's document are one run: from UTE, the first row whose id is >= the key's, to LTS,
        the first row whose id is greater; both counted among the block's own rows (searchsorted over the
        block's query ids), not the whole sequence's. On the diagonal (key (rank, rank), causal) one bound,
        LTS, as models/decoder.py document_row_indices gives one process; elsewhere every key precedes every
        query and the kernel is non-causal: [LTS, UTE]. A block in which every key's run is empty is skipped."""
        rows = self.built.get(key)
        if rows is None:  # once per forward, as the biases
            q_ids = paddle.index_select(self.ids, q_positions, axis=1)
            k_ids = paddle.index_select(self.ids, k_positions, axis=1)
            lts = paddle.searchsorted(q_ids, k_ids, right=True, out_int32=True)
            ute = paddle.searchsorted(q_ids, k_ids, right=False, out_int32=True)
            if not bool((lts > ute).any()):
                rows = SKIP
            else:
                rows = paddle.stack([lts] if key[0] == key[1] else [lts, ute], axis=-1).unsqueeze(1)
            self.built[key] = rows
        return rows


_FORWARD_DOCUMENTS: list = []  # [(document_ids, DocumentBlocks)] of the latest forward


def document_blocks(document_ids, row_indices: bool = False) -> DocumentBlocks:
    """The DocumentBlocks of these ids: one per forward (every layer gets the same ids tensor), so that the
    layers share each block's bias (or row indices) and its host read; the previous forward's are dropped."""
    if (not _FORWARD_DOCUMENTS or _FORWARD_DOCUMENTS[0][0] is not document_ids
            or _FORWARD_DOCUMENTS[0][1].row_indices != row_indices):
        _FORWARD_DOCUMENTS[:] = [(document_ids, DocumentBlocks(document_ids, row_indices))]
    return _FORWARD_DOCUMENTS[0][1]


SKIP = "skip"  # a block that document masks remove entirely


def _block_bias(slopes, documents, q_positions, k_positions, key):
    """The block's additive bias: ALiBi and the document mask (either may be None), or SKIP."""
    alibi = _alibi(slopes, q_positions, k_positions)
    if documents is None:
        return alibi
    masked = documents.bias(q_positions, k_positions, key)
    if masked is SKIP or alibi is None:
        return masked
    return alibi + masked


def _causal_mask(queries, keys):
    """Query i sees keys 0..i + keys - queries: flash attention 2's alignment (bottom right), which
    on the ring's only causal block, the square diagonal one, is the plain causal mask. One per process
    for these sizes (models/constants.py), shared by every layer's diagonal block, forward and backward."""
    return shared_constant("ring_causal_mask", (queries, keys), lambda: paddle.triu(
        paddle.full([queries, keys], MASKED, "float32"), diagonal=1 + keys - queries))


def _scores(q, k, causal, bias):
    """[batch, heads, queries, keys] float32: q k^T / sqrt(d) + bias (+ the causal mask)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qt = q.transpose([0, 2, 1, 3]).astype("float32") * scale
    scores = paddle.matmul(qt, _repeat_heads(k, q.shape[2] // k.shape[2]), transpose_y=True)
    if bias is not None:
        scores = scores + bias
    if causal:
        scores = scores + _causal_mask(q.shape[1], k.shape[1])
    return scores


def _repeat_heads(x, groups):
    return paddle.repeat_interleave(x, groups, axis=2).transpose([0, 2, 1, 3]).astype("float32")


def _sum_groups(grad, kv_heads):
    """[batch, heads, keys, d] gradient of repeated kv heads -> [batch, keys, kv heads, d]."""
    batch, heads, keys, d = grad.shape
    return grad.reshape([batch, kv_heads, heads // kv_heads, keys, d]).sum(2).transpose([0, 2, 1, 3])


# ----------------------------------------------------------------------------- the ring
# With the balanced chunks, what rank's queries (chunks i, 2cp-1-i) see of owner's keys (chunks j,
# 2cp-1-j) is one whole rectangle (ring_attention.py:243-296):
#   own block (step 0)   square, causal: the chunks in the same order on both sides
#   owner j < i          every query over the owner's first chunk (j precedes both of ours, 2cp-1-j
#                        follows both)
#   owner j > i          our second chunk over the whole block (both of the owner's chunks lie
#                        between ours)
# so no block ever needs more than the diagonal's causal mask.

def _without_autocast(method):
    """Run `method` with the run's autocast off: the merge, the plain blocks and the gradient sums are
    float32 by design, and under O2 autocast would round them to bf16 (Paddle's update_out_and_lse
    turns it off the same way, ring_attention.py:168; the flash kernel gets q, k, v as they come).
    The method keeps its own frame (tests/workers/mechanism_runs.py names start_ring_pass's caller)."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with paddle.amp.auto_cast(enable=False):
            return method(*args, **kwargs)
    return run


class RingAttention(paddle.autograd.PyLayer):
    """softmax(q k^T / sqrt(d) + ALiBi + causal mask (+ document mask)) v over the whole ring;
    [batch, local seq, heads, d]. documents: None or DocumentBlocks."""

    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, seq_length, slopes, group, blocks=PlainBlocks, documents=None):
        rank, size = group.rank, group.nranks
        half = q.shape[1] // 2
        q_positions = balanced_positions(seq_length, rank, size)
        block_k, block_v = k, v
        for step in range(size):
            if step < size - 1:  # the next block travels while this one is computed
                next_block = start_ring_pass([block_k, block_v], group)
            owner = (rank - step) % size
            k_positions = balanced_positions(seq_length, owner, size)
            if step == 0:  # (never skipped: every query sees itself)
                out, lse = blocks.forward(q, block_k, block_v, True,
                                          _block_bias(slopes, documents, q_positions, k_positions, (rank, owner)))
                out = out.astype("float32")
            elif owner < rank:
                bias = _block_bias(slopes, documents, q_positions, k_positions[:half], (rank, owner))
                if bias is not SKIP:
                    out, lse = merge_blocks(out, lse, *blocks.forward(
                        q, block_k[:, :half], block_v[:, :half], False, bias))
            else:
                bias = _block_bias(slopes, documents, q_positions[half:], k_positions, (rank, owner))
                if bias is not SKIP:
                    second_out, second_lse = merge_blocks(out[:, half:], lse[:, :, half:], *blocks.forward(
                        q[:, half:], block_k, block_v, False, bias))
                    out = paddle.concat([out[:, :half], second_out], axis=1)
                    lse = paddle.concat([lse[:, :, :half], second_lse], axis=2)
            if step < size - 1:
                block_k, block_v = next_block.wait()
        out = out.astype(q.dtype)  # the flash kernel's backward takes out in q's dtype
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq_length, ctx.slopes, ctx.group, ctx.blocks = seq_length, slopes, group, blocks
        ctx.documents = documents
        return out

    @staticmethod
    @_without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensor()
        group, seq_length, slopes, blocks = ctx.group, ctx.seq_length, ctx.slopes, ctx.blocks
        documents = getattr(ctx, "documents", None)
        rank, size = group.rank, group.nranks
        half = q.shape[1] // 2
        q_positions = balanced_positions(seq_length, rank, size)
        grad_out = grad_out.astype(q.dtype)
        grad_q = paddle.zeros(q.shape, "float32")
        block_k, block_v = k, v
        # The gradient of the block held travels with it, one step behind: sent after this step's
        # computation, it arrives while the next block is computed. After the last step each rank
        # sends its successor that rank's own block's gradient.
        grad_k, grad_v = paddle.zeros(k.shape, "float32"), paddle.zeros(v.shape, "float32")
        pending_grad = None
        for step in range(size):
            if step < size - 1:
                next_block = start_ring_pass([block_k, block_v], group)
            owner = (rank - step) % size
            k_positions = balanced_positions(seq_length, owner, size)
            if step == 0:
                dq, dk, dv = blocks.backward(q, block_k, block_v, out, lse, grad_out, True,
                                             _block_bias(slopes, documents, q_positions, k_positions, (rank, owner)))
                grad_q += dq.astype("float32")
            elif owner < rank:
                dq = dk = dv = None
                bias = _block_bias(slopes, documents, q_positions, k_positions[:half], (rank, owner))
                if bias is not SKIP:  # as in forward: a block masked entirely adds no gradient
                    dq, dk, dv = blocks.backward(q, block_k[:, :half], block_v[:, :half], out, lse, grad_out, False,
                                                 bias)
                    grad_q += dq.astype("float32")
            else:
                dq = dk = dv = None
                bias = _block_bias(slopes, documents, q_positions[half:], k_positions, (rank, owner))
                if bias is not SKIP:
                    dq, dk, dv = blocks.backward(q[:, half:], block_k, block_v, out[:, half:], lse[:, :, half:],
                                                 grad_out[:, half:], False, bias)
                    grad_q[:, half:] = grad_q[:, half:] + dq.astype("float32")
            if pending_grad is not None:
                grad_k, grad_v = pending_grad.wait()
            if dk is not None and step > 0 and owner < rank:  # only the owner's first chunk was seen
                grad_k[:, :half] = grad_k[:, :half] + dk.astype("float32")
                grad_v[:, :half] = grad_v[:, :half] + dv.astype("float32")
            elif dk is not None:
                grad_k += dk.astype("float32")
                grad_v += dv.astype("float32")
            del dq, dk, dv
            # every rank passes the gradient on, a skipped block's too (the ring's sends pair up)
            pending_grad = start_ring_pass([grad_k, grad_v], group)
            if step < size - 1:
                block_k, block_v = next_block.wait()
        grad_k, grad_v = pending_grad.wait()
        return grad_q.astype(q.dtype), grad_k.astype(k.dtype), grad_v.astype(v.dtype)


def ring_attention(q, k, v, seq_length: int, slopes, group, use_flash_attention: bool = False, document_ids=None):
    """[batch, local seq, heads, d] q and [batch, local seq, kv heads, d] k, v -> [batch, local seq, heads x d].

    slopes: the ALiBi slopes of q's heads (floats) or None. use_flash_attention: the run's flag
    (config.use_flash_attention); the flash kernel runs where `attention_blocks` finds it can.
    document_ids: None, or [batch, seq] of the whole sequences (packed documents: the plain blocks take each
    block's mask as a bias, the flash ones FlashMask's row indices; ALiBi with both is refused by
    llm_pretrain/parallel/layout.py, FlashMask takes no bias)."""
    blocks = attention_blocks(use_flash_attention, q.place, q.dtype, q.shape[-1])
    if document_ids is not None and blocks is FlashBlocks:
        blocks = FlashMaskBlocks
    documents = document_blocks(document_ids, blocks is FlashMaskBlocks) if document_ids is not None else None
    out = RingAttention.apply(q, k, v, seq_length, slopes, group, blocks, documents)
    return out.reshape([out.shape[0], out.shape[1], -1])
