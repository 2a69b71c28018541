"""CPU stand-ins of the GPU-only kernels the models call, so that their GPU branches run in CPU tests.

Installed only on CPU and only when asked (LLM_PRETRAIN_KERNEL_STANDINS=1, llm_pretrain/cpu/standin_switch.py;
run/preflight.py prepare_run calls `install_kernel_standins` right after Paddle is imported). Each stand-in
takes the arguments of Paddle 3.3.1's kernel binding in the same order, makes the checks the kernel (its
InferMeta or its launcher) makes on them, and returns the kernel's outputs in the kernel's layout; the
numbers are plain float32 (float64) math written here, apart from the models' plain paths they are
compared with. Every Paddle wrapper above a kernel runs unchanged (sdpa's backend choice and its flash_attn
call, fused_rms_norm's and fused_rotary_position_embedding's wrappers): the stand-ins replace the bindings
in `paddle._C_ops`, the module those wrappers and models/ring_attention.py call through.

    kernel (binding)                    called from                                    stand-in
    flash_attn, flash_attn_grad         F.scaled_dot_product_attention (models/decoder.py   PyLayer: forward and
                                        Attention.flash_attention), models/ring_attention.py  the grad kernel, written out
                                        FlashBlocks
    flashmask_attention, _grad          F.flashmask_attention (models/decoder.py            PyLayer: the row indices
                                        Attention.flashmask_attention: packed documents)   as a dense mask, then
                                        models/ring_attention.py FlashMaskBlocks            flash_attn's math
    fused_rotary_position_embedding     paddle.incubate.nn.functional.fused_rotary_position_embedding
                                        (models/decoder.py Attention.project_qkv)          Paddle ops (autograd)
    fused_rms_norm_quant                paddle.incubate.nn.functional.fused_rms_norm
                                        (models/parallel_layers.py RMSNorm)                Paddle ops (autograd)
    fast_ln.fast_ln                     PaddleNLP's external op package `fast_ln`
                                        (models/parallel_layers.py FastLayerNorm)           a `fast_ln` module
    swiglu                              F.swiglu (models/decoder.py MLP)                   none: Paddle's CPU
                                                                                           build has the kernel
    paddle.distributed.batch_isend_irecv   models/ring_attention.py start_ring_pass        the ops in ring
                                        (NCCL: transfers overlapping the blocks)           order on gloo

Three choices that only a GPU makes are opened to CPU while the stand-ins are installed: sdpa's backend
choice (`select_sdp_for_sdpa`, which needs a CUDA place, fp16/bf16 and SM 8.0+ for flash) and the ring's
(`ring_attention.attention_blocks`, the same conditions), each still applying its other rules (head size,
causal with equal lengths, no explicit scale) as on a GPU; and the ring's overlapped transfers
(`ring_attention.transfers_overlap`, which a gloo group does not have).

`CALLS` counts each stand-in's calls (tests/test_kernel_standins.py reads it per layer).
"""

from __future__ import annotations

import math
import sys
import types
from collections import Counter

import paddle
from paddle import _C_ops
from paddle.autograd import PyLayer

# Dtypes a stand-in computes in: the CPU build's (no half-precision kernels on CPU).
CPU_DTYPES = (paddle.float32, paddle.float64)
LSE_ROW_BLOCK = 128  # flash_attn allocates softmax_lse with seqlen_q rounded up to this (see _flash_attn)

CALLS: Counter = Counter()
_ORIGINALS: dict = {}  # binding name -> Paddle's own, kept so that GPU tensors (never here) and uninstall reach it


class KernelArgumentError(ValueError):
    """What the kernel's own checks raise (PADDLE_ENFORCE -> ValueError in Python) for a bad argument."""


def _enforce(condition: bool, message: str) -> None:
    if not condition:
        raise KernelArgumentError(message)


def _on_cpu(*tensors) -> bool:
    return all(t is None or t.place.is_cpu_place() for t in tensors)


def _check_cpu_dtype(name: str, tensor) -> None:
    _enforce(tensor.dtype in CPU_DTYPES,
             f"{name}: the CPU stand-in computes in float32/float64, got {tensor.dtype} (half precision is GPU-only)")


# ----------------------------------------------------------------------------- flash attention
# Paddle 3.3.1 binding (paddle/phi/ops/yaml/ops.yaml `flash_attn`, argument order of
# paddle/phi/kernels/flash_attn_kernel.h FlashAttnKernel; Python callers: paddle/nn/functional/sdpa.py
# scaled_dot_product_attention, paddle/distributed/auto_parallel/ring_attention.py):
#   out, softmax, softmax_lse, seed_offset = flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout,
#                                                       causal, return_softmax, is_test, rng_name)
#   q [b, sq, h, d], k/v [b, sk, hk, d] with h % hk == 0 (grouped kv heads are shared, not repeated);
#   out [b, sq, h, d] in q's dtype; softmax_lse float32 [b, h, round_up(sq, 128)] (gpu/flash_attn_utils.h
#   FlashAttnParamsBase: softmax_lse_dims = {batch_size, num_heads, seqlen_q_rounded}); the first sq
#   entries of each row are the rows' log-sum-exp (Paddle's ring slices them: ring_attention.py:273);
#   seed_offset int64 [2] on the host. Scale 1/sqrt(d). `causal`: flash attention 2's bottom-right
#   alignment, query i sees keys j <= i + sk - sq. attn_mask: additive, q's dtype, 4-D [b or 1, h or 1, sq, sk]
#   (flash_attn_utils.h GetAttnMaskDims, "attn_mask is expected to have the same data type with q").
#   flash_attn_grad(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal) -> dq, dk, dv
#   (flash_attn_grad_kernel.h FlashAttnGradKernel); Paddle's ring hands it the lse of its merged blocks,
#   [b, h, sq] (ring_attention.py:334), so both row lengths are taken.

def _check_flash_inputs(q, k, v, attn_mask, causal):
    _enforce(q.ndim == 4 and k.ndim == 4 and v.ndim == 4,
             f"flash_attn: q, k, v must be 4-D [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
    b, sq, h, d = q.shape
    _enforce(k.shape[0] == b and v.shape[0] == b, f"flash_attn: batch of q {b} and of k/v {k.shape[0]}/{v.shape[0]} differ")
    _enforce(k.shape == v.shape, f"flash_attn: k {k.shape} and v {v.shape} must have the same shape")
    _enforce(k.shape[3] == d, f"flash_attn: head_dim of q ({d}) and k ({k.shape[3]}) differ")
    _enforce(h % k.shape[2] == 0, f"flash_attn: query heads {h} must be a multiple of kv heads {k.shape[2]}")
    # paddle/nn/functional/sdpa.py check_head_dim_size_flash: the flash kernels take head_dim <= 256, a multiple of 8
    _enforce(d <= 256 and d % 8 == 0, f"flash_attn: head_dim must be a multiple of 8 up to 256, got {d}")
    _enforce(q.dtype == k.dtype == v.dtype, f"flash_attn: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check_cpu_dtype("flash_attn q", q)
    if attn_mask is not None:
        _enforce(attn_mask.dtype == q.dtype, "flash_attn: attn_mask is expected to have the same data type with q")
        _enforce(attn_mask.ndim == 4 and attn_mask.shape[0] in (1, b) and attn_mask.shape[1] in (1, h)
                 and list(attn_mask.shape[2:]) == [sq, k.shape[1]],
                 f"flash_attn: attn_mask must be [batch or 1, heads or 1, {sq}, {k.shape[1]}], got {attn_mask.shape}")
        _enforce(not causal, "flash_attn: When attn_mask is set, causal can not be true.")


def _flash_scores(q, k, attn_mask, causal):
    """[b, hk, groups, sq, sk] float32 scores of every query head against its kv head (no repeat of k)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    compute = paddle.float64 if q.dtype == paddle.float64 else paddle.float32
    qg = q.astype(compute).transpose([0, 2, 1, 3]).reshape([b, hk, h // hk, sq, d])  # head j -> kv head j // groups
    kg = k.astype(compute).transpose([0, 2, 1, 3]).unsqueeze(2)  # [b, hk, 1, sk, d]
    scores = paddle.matmul(qg, kg, transpose_y=True) * (1.0 / math.sqrt(d))
    if attn_mask is not None:
        mask = attn_mask.astype(compute).expand([b, h, sq, sk]).reshape([b, hk, h // hk, sq, sk])
        scores = scores + mask
    if causal:  # bottom-right: query i sees keys j <= i + sk - sq
        hidden = paddle.arange(sk)[None, :] > paddle.arange(sq)[:, None] + (sk - sq)
        scores = paddle.where(hidden, paddle.full([], float("-inf"), compute), scores)
    return scores


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _flash_forward(q, k, v, attn_mask, causal):
    b, sq, h, d = q.shape
    scores = _flash_scores(q, k, attn_mask, causal)
    top = scores.max(-1, keepdim=True)  # (paddle.logsumexp takes at most 4 axes)
    # A row whose every key is masked (the ring's FlashMask blocks: a query of a later document than all the
    # block's keys) gets what flash attention 2 gives it: out 0 and lse +inf (csrc/flash_attn/src/softmax.h
    # normalize_softmax_lse, `(sum == 0.f || sum != sum) ? INFINITY`), not exp(-inf - -inf) = NaN.
    empty = paddle.isinf(top)
    top = paddle.where(empty, paddle.zeros_like(top), top)
    lse = (top + paddle.log(paddle.exp(scores - top).sum(-1, keepdim=True))).squeeze(-1)  # [b, hk, groups, sq]
    empty = empty.squeeze(-1)
    probs = paddle.exp(scores - paddle.where(empty, paddle.zeros_like(lse), lse).unsqueeze(-1))
    vg = v.astype(scores.dtype).transpose([0, 2, 1, 3]).unsqueeze(2)
    out = paddle.matmul(probs, vg).reshape([b, h, sq, d]).transpose([0, 2, 1, 3]).astype(q.dtype)
    lse = paddle.where(empty, paddle.full_like(lse, float("inf")), lse).reshape([b, h, sq]).astype("float32")
    padded = paddle.zeros([b, h, _round_up(sq, LSE_ROW_BLOCK) - sq], "float32")
    return out, paddle.concat([lse, padded], axis=-1)


def _flash_backward(q, k, v, out, lse, out_grad, attn_mask, causal):
    b, sq, h, d = q.shape
    hk = k.shape[2]
    scores = _flash_scores(q, k, attn_mask, causal)
    compute = scores.dtype
    probs = paddle.exp(scores - lse[:, :, :sq].astype(compute).reshape([b, hk, h // hk, sq, 1]))
    grouped = lambda t: t.astype(compute).transpose([0, 2, 1, 3]).reshape([b, hk, h // hk, sq, d])  # noqa: E731
    dout, o = grouped(out_grad), grouped(out)
    vg = v.astype(compute).transpose([0, 2, 1, 3]).unsqueeze(2)
    kg = k.astype(compute).transpose([0, 2, 1, 3]).unsqueeze(2)
    dv = paddle.matmul(probs, dout, transpose_x=True).sum(2)  # [b, hk, sk, d]: summed over the shared heads
    dscores = probs * (paddle.matmul(dout, vg, transpose_y=True) - (dout * o).sum(-1, keepdim=True))
    dscores = dscores * (1.0 / math.sqrt(d))
    dq = paddle.matmul(dscores, kg).reshape([b, h, sq, d]).transpose([0, 2, 1, 3])
    dk = paddle.matmul(dscores, grouped(q), transpose_x=True).sum(2)
    return (dq.astype(q.dtype), dk.transpose([0, 2, 1, 3]).astype(k.dtype),
            dv.transpose([0, 2, 1, 3]).astype(v.dtype))


# _SAVES_INPUTS_ONLY: the PyLayers below save their inputs and rebuild out and lse in backward (the same
# float32 math, so the same numbers) rather than saving their own outputs: under fleet's non-reentrant recompute
# (paddle/distributed/fleet/recompute/recompute.py _recompute_without_reentrant: saved tensors matched to the
# recomputed forward's by their order) a PyLayer's saved outputs came back as another tensor of out's shape
# (recompute_granularity core_attn with use_flash_attention: gradients off; tests/test_kernel_standins.py
# test_flash_stand_ins_under_core_attn_recompute). The real kernels are ops and save through the hooks as any.
def _seed_offset():
    return paddle.to_tensor([0, 0], dtype="int64", place=paddle.CPUPlace())


class _FlashAttention(PyLayer):
    """flash_attn's forward with flash_attn_grad as its backward, as the kernel pair is registered
    (ops.yaml flash_attn: backward flash_attn_grad): sdpa's autograd then reaches the grad stand-in."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, causal):
        out, lse = _flash_forward(q, k, v, attn_mask, causal)
        ctx.save_for_backward(q, k, v, attn_mask)  # inputs only (_SAVES_INPUTS_ONLY)
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, out_grad, _lse_grad=None):
        q, k, v, attn_mask = ctx.saved_tensor()
        with paddle.no_grad():
            out, lse = _flash_forward(q, k, v, attn_mask, ctx.causal)
        dq, dk, dv = flash_attn_grad(q, k, v, out, lse, _seed_offset(), attn_mask, out_grad, 0.0, ctx.causal)
        return (dq, dk, dv) + ((None,) if attn_mask is not None else ())


def flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name):
    if not _on_cpu(q, k, v, attn_mask):
        return _ORIGINALS["flash_attn"](q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax,
                                        is_test, rng_name)
    CALLS["flash_attn"] += 1
    _check_flash_inputs(q, k, v, attn_mask, causal)
    _enforce(isinstance(rng_name, str), "flash_attn: rng_name must be a str")
    # flash_attn_utils.h FlashAttnFwdParamsV2: "return_softmax is only supported when dropout > 0.0"
    _enforce(not return_softmax or (dropout > 0.0 and not is_test), "return_softmax is only supported when dropout > 0.0")
    if dropout > 0.0 and not is_test:  # the kernel's Philox dropout is not reproduced here
        raise NotImplementedError("flash_attn stand-in: attention dropout in training is not implemented (dropout "
                                  f"{dropout}); the CPU parity runs use attention_probs_dropout_prob 0")
    out, lse = _FlashAttention.apply(q, k, v, attn_mask, bool(causal))
    return out, paddle.empty([0], q.dtype), lse, _seed_offset()


def flash_attn_grad(q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal):
    if not _on_cpu(q, k, v, out_grad):
        return _ORIGINALS["flash_attn_grad"](q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout,
                                             causal)
    CALLS["flash_attn_grad"] += 1
    _check_flash_inputs(q, k, v, attn_mask, causal)
    b, sq, h, _ = q.shape
    _enforce(out.shape == q.shape and out_grad.shape == q.shape,
             f"flash_attn_grad: out {out.shape} and out_grad {out_grad.shape} must have q's shape {q.shape}")
    _enforce(out.dtype == q.dtype == out_grad.dtype, "flash_attn_grad: out and out_grad must have q's dtype")
    _enforce(softmax_lse.dtype == paddle.float32 and list(softmax_lse.shape[:2]) == [b, h]
             and softmax_lse.shape[2] in (sq, _round_up(sq, LSE_ROW_BLOCK)),
             f"flash_attn_grad: softmax_lse must be float32 [{b}, {h}, {sq} or {_round_up(sq, LSE_ROW_BLOCK)}], "
             f"got {softmax_lse.dtype} {softmax_lse.shape}")
    _enforce(seed_offset.dtype == paddle.int64 and list(seed_offset.shape) == [2],
             "flash_attn_grad: seed_offset must be int64 [2]")
    if dropout > 0.0:
        raise NotImplementedError(f"flash_attn_grad stand-in: dropout {dropout} is not implemented")
    with paddle.no_grad():
        return _flash_backward(q, k, v, out, softmax_lse, out_grad, attn_mask, causal)


# ----------------------------------------------------------------------------- flashmask attention
# Paddle 3.3.1 binding (paddle/phi/ops/yaml/ops.yaml `flashmask_attention`, FlashMaskKernel in
# paddle/phi/kernels/flash_attn_kernel.h; Python caller paddle/nn/functional/flash_attention.py
# flashmask_attention, its fa_version 2 branch):
#   out, softmax, softmax_lse, seed_offset = flashmask_attention(q, k, v, startend_row_indices,
#                                                               fixed_seed_offset, dropout, causal,
#                                                               return_softmax, is_test, rng_name)
#   flashmask_attention_grad(q, k, v, startend_row_indices, out, softmax_lse, seed_offset, out_grad, dropout,
#                            causal) -> dq, dk, dv
# The kernel is flash_attn's (gpu/flash_attn_kernel.cu FlashAttnBaseKernel with the row indices instead of a
# dense mask): the same q/k/v layouts, scale, outputs and lse as `flash_attn` above; its own checks: the
# indices 4-D [batch, heads, seq_k, bounds] with bounds in {1, 2, 4} ("flashmask_attention receive
# startend_row_indices with dim [batch_size, num_heads,seq_len, mask_bounds]"), int32; the wrapper's asserts
# (batch, seq_k, heads 1 / q heads / kv heads, bounds 1-2 if causal else 2 or 4) are checked here again
# because the binding can be called without the wrapper. Meaning (the wrapper's docstring), for key j and
# query row i: causal [.., 1] masks i >= start[j]; causal [.., 2] masks start[j] <= i < end[j]; non-causal
# [.., 2] masks i >= start[j] (below the diagonal) and i < end[j] (above); non-causal [.., 4] masks
# b0[j] <= i < b1[j] and b2[j] <= i < b3[j]. The stand-in turns the indices into the equivalent additive
# mask and runs flash_attn's math (`_flash_forward` / `_flash_backward`).

def _check_flashmask_indices(q, k, startend_row_indices, causal):
    _enforce(startend_row_indices.ndim == 4, "flashmask_attention receive startend_row_indices with dim "
                                             "[batch_size, num_heads,seq_len, mask_bounds]")
    _enforce(startend_row_indices.dtype == paddle.int32,
             f"startend_row_indices.dtype must be paddle.int32, but got {startend_row_indices.dtype}")
    b, heads, seq_k, bounds = startend_row_indices.shape
    _enforce(b == k.shape[0], f"startend_row_indices.shape[0] must be equal to batch_size, but got {b} and "
                              f"{k.shape[0]}")
    _enforce(seq_k == k.shape[1], f"startend_row_indices.shape[2] must be equal to seqlen_k, but got {seq_k} and "
                                  f"{k.shape[1]}")
    _enforce(heads in (1, q.shape[2], k.shape[2]), "startend_row_indices head_num must be equal to 1(broadcast) or "
                                                  "head_num_q or head_num_k.")
    _enforce(bounds in ((1, 2) if causal else (2, 4)),
             f"Invalid shape of startend_row_indices, when causal is {causal}, the last dimension should be "
             f"{'either 1 or 2' if causal else 'either 2 or 4'} but got {bounds}")


def flashmask_dense_mask(startend_row_indices, seq_q: int, num_heads: int, causal: bool):
    """The additive float32 mask [batch, num_heads, seq_q, seq_k] (0 / -inf) the row indices stand for (causal
    part excluded: flash_attn's `causal` adds it). Indices per kv head are repeated for their q heads."""
    b, heads, seq_k, bounds = startend_row_indices.shape
    rows = paddle.arange(seq_q, dtype="int32").reshape([1, 1, seq_q, 1])
    bound = [startend_row_indices[..., i].unsqueeze(2) for i in range(bounds)]  # each [b, heads, 1, seq_k]
    if causal:
        masked = rows >= bound[0] if bounds == 1 else (rows >= bound[0]) & (rows < bound[1])
    elif bounds == 2:
        masked = (rows >= bound[0]) | (rows < bound[1])
    else:
        masked = ((rows >= bound[0]) & (rows < bound[1])) | ((rows >= bound[2]) & (rows < bound[3]))
    mask = paddle.where(masked, paddle.full([], float("-inf"), "float32"), paddle.zeros([], "float32"))
    if heads not in (1, num_heads):  # one row of indices per kv head: its q heads share it
        mask = paddle.repeat_interleave(mask, num_heads // heads, axis=1)
    return mask


class _FlashMaskAttention(PyLayer):
    """flashmask_attention's forward with flashmask_attention_grad as its backward (ops.yaml
    flashmask_attention: backward flashmask_attention_grad)."""

    @staticmethod
    def forward(ctx, q, k, v, startend_row_indices, causal):
        mask = flashmask_dense_mask(startend_row_indices, q.shape[1], q.shape[2], causal)
        out, lse = _flash_forward(q, k, v, mask, causal)
        ctx.save_for_backward(q, k, v, startend_row_indices)  # inputs only (_SAVES_INPUTS_ONLY)
        ctx.causal = causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, out_grad, _lse_grad=None):
        q, k, v, startend_row_indices = ctx.saved_tensor()
        with paddle.no_grad():
            mask = flashmask_dense_mask(startend_row_indices, q.shape[1], q.shape[2], ctx.causal)
            out, lse = _flash_forward(q, k, v, mask, ctx.causal)
        dq, dk, dv = flashmask_attention_grad(q, k, v, startend_row_indices, out, lse, _seed_offset(), out_grad, 0.0,
                                              ctx.causal)
        return dq, dk, dv, None


def flashmask_attention(q, k, v, startend_row_indices, fixed_seed_offset, dropout, causal, return_softmax, is_test,
                        rng_name):
    if not _on_cpu(q, k, v, startend_row_indices):
        return _ORIGINALS["flashmask_attention"](q, k, v, startend_row_indices, fixed_seed_offset, dropout, causal,
                                                 return_softmax, is_test, rng_name)
    CALLS["flashmask_attention"] += 1
    _check_flash_inputs(q, k, v, None, causal)
    _check_flashmask_indices(q, k, startend_row_indices, causal)
    _enforce(isinstance(rng_name, str), "flashmask_attention: rng_name must be a str")
    _enforce(not return_softmax or (dropout > 0.0 and not is_test), "return_softmax is only supported when dropout > 0.0")
    if dropout > 0.0 and not is_test:
        raise NotImplementedError(f"flashmask_attention stand-in: attention dropout in training is not implemented "
                                  f"(dropout {dropout})")
    out, lse = _FlashMaskAttention.apply(q, k, v, startend_row_indices, bool(causal))
    return out, paddle.empty([0], q.dtype), lse, _seed_offset()


def flashmask_attention_grad(q, k, v, startend_row_indices, out, softmax_lse, seed_offset, out_grad, dropout, causal):
    if not _on_cpu(q, k, v, out_grad):
        return _ORIGINALS["flashmask_attention_grad"](q, k, v, startend_row_indices, out, softmax_lse, seed_offset,
                                                      out_grad, dropout, causal)
    CALLS["flashmask_attention_grad"] += 1
    _check_flash_inputs(q, k, v, None, causal)
    _check_flashmask_indices(q, k, startend_row_indices, causal)
    _enforce(out.shape == q.shape and out_grad.shape == q.shape,
             f"flashmask_attention_grad: out {out.shape} and out_grad {out_grad.shape} must have q's shape {q.shape}")
    if dropout > 0.0:
        raise NotImplementedError(f"flashmask_attention_grad stand-in: dropout {dropout} is not implemented")
    with paddle.no_grad():
        mask = flashmask_dense_mask(startend_row_indices, q.shape[1], q.shape[2], causal)
        return _flash_backward(q, k, v, out, softmax_lse, out_grad, mask, causal)


# The flags flashmask_attention's wrapper reads before the binding (paddle.get_flags(["FLAGS_cudnn_deterministic"])
# and FLAGS_flash_attn_version) exist only in GPU builds; the CPU build raises ValueError for them. While the
# stand-ins are installed they answer with the GPU build's defaults (paddle/common/flags.cc: cudnn_deterministic
# false, flash_attn_version 2), so the wrapper runs unchanged and takes its fa_version 2 branch (the binding above).
GPU_ONLY_FLAGS = {"FLAGS_cudnn_deterministic": False, "FLAGS_flash_attn_version": 2}


def _get_flags_on_cpu(original):
    def get_flags(flags):
        names = [flags] if isinstance(flags, str) else list(flags)
        values = {}
        for name in names:
            try:
                values.update(original([name]))
            except ValueError:  # not in this (CPU) build
                if name not in GPU_ONLY_FLAGS:
                    raise
                values[name] = GPU_ONLY_FLAGS[name]
        return values

    get_flags.standin_of = original
    return get_flags


# ----------------------------------------------------------------------------- rotary embedding
# fused_rotary_position_embedding(q, k, v, sin, cos, position_ids, use_neox_rotary_style, time_major,
# rotary_emb_base) -> out_q, out_k, out_v (paddle/incubate/nn/functional/fused_rotary_position_embedding.py;
# checks of paddle/phi/kernels/fusion/gpu/fused_rope_kernel.cu FusedRopeKernel; arithmetic of
# fused_rope_utils.h: in float32, out = x * cos + rotate(x) * sin with rotate(x) = [-x2, x1] over the
# halves of head_dim (use_neox_rotary_style False) or over adjacent pairs (True); sin/cos read as q's
# dtype, [seq, head_dim] or [1, seq, 1, head_dim]; k/v may have fewer heads (GQA) that divide q's;
# position_ids [batch, seq] pick each token's row of the tables, which then may be longer than q's seq).

def _rotate(x, neox: bool):
    if neox:  # pairs (x0, x1) -> (-x1, x0)
        pairs = x.reshape(x.shape[:-1] + [x.shape[-1] // 2, 2])
        return paddle.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


def fused_rotary_position_embedding(q, k, v, sin, cos, position_ids, use_neox_rotary_style, time_major,
                                    rotary_emb_base):
    if not _on_cpu(q, k, v, sin, cos):
        return _ORIGINALS["fused_rotary_position_embedding"](q, k, v, sin, cos, position_ids, use_neox_rotary_style,
                                                             time_major, rotary_emb_base)
    CALLS["fused_rotary_position_embedding"] += 1
    _enforce(q.ndim == 4, f"fused_rotary_position_embedding: q must be 4-D, got {q.shape}")
    _check_cpu_dtype("fused_rotary_position_embedding q", q)
    head_dim = q.shape[3]
    _enforce(head_dim % 2 == 0, "The head_dim of input must be a multiple of 2.")
    if time_major or sin is None or cos is None:
        raise NotImplementedError("fused_rotary_position_embedding stand-in: only batch-major inputs with sin/cos "
                                  "tables (what models/decoder.py passes)")
    seq = q.shape[1]
    _enforce(sin.shape == cos.shape, f"The dims of sin and cos must be the same. But received sin's dims is "
                                     f"{sin.shape}, cos's dims is {cos.shape}.")
    _enforce(sin.ndim in (2, 4), f"The dims of sin and cos is expected to be 2 or 4, but received {sin.ndim}.")
    if sin.ndim == 4:
        _enforce(sin.shape[0] == 1 and sin.shape[2] == 1, "The batch_size and num_heads of sin and cos must be 1.")
    seq_axis = 1 if sin.ndim == 4 else 0
    if position_ids is not None:  # each token's row of the tables (positions restarting per document)
        _enforce(sin.shape[-1] == head_dim and sin.shape[seq_axis] >= seq,
                 "The seq_len of sin and cos must be greater than or equal to this of q. The head_dim of sin and cos "
                 f"must be the same as this of q. But received sin's shape is {sin.shape}, q's shape is {q.shape}.")
        _enforce(position_ids.ndim == 2, f"The dims of position_ids is expected to be 2, but received {position_ids.ndim}.")
        _enforce(list(position_ids.shape) == [q.shape[0], seq],
                 "The batch_size and seq_len of position_ids must be the same as those of q. But received "
                 f"position_ids's shape is {position_ids.shape}, q's shape is {q.shape}.")
    else:
        _enforce(sin.shape[-1] == head_dim and sin.shape[seq_axis] == seq,
                 f"The seq_len and head_dim of sin and cos must be the same as those of q. But received sin's shape "
                 f"is {sin.shape}, q's shape is {q.shape}.")
    # the kernel reads sin/cos through data<T>() with T q's type: another dtype is an error there
    _enforce(sin.dtype == q.dtype and cos.dtype == q.dtype,
             f"fused_rotary_position_embedding: sin/cos must have q's dtype {q.dtype}, got {sin.dtype}/{cos.dtype}")
    heads = [t.shape[2] for t in (k, v) if t is not None]
    for t in (k, v):
        if t is not None:
            _enforce(t.ndim == 4 and t.shape[0] == q.shape[0] and t.shape[1] == seq and t.shape[3] == head_dim,
                     f"fused_rotary_position_embedding: k/v {t.shape} must match q {q.shape} but for the heads")
            _check_cpu_dtype("fused_rotary_position_embedding k/v", t)
    if any(n != q.shape[2] for n in heads):
        _enforce(q.shape[2] % heads[-1] == 0 and q.shape[2] != heads[-1],
                 "The MQA or GQA mode is entered, when the number of heads of qkv is not exactly the same two by two. "
                 f"This mode requires num_heads of q to be divisible by k,v. But received num_heads of q is "
                 f"{q.shape[2]}, num_heads of k,v is {heads[-1]}")
        _enforce(len(heads) < 2 or heads[0] == heads[1],
                 "The num_heads of k must be equal to the num_heads of v when v is not none.")
    compute = paddle.float64 if q.dtype == paddle.float64 else paddle.float32
    rows = sin.shape[seq_axis]

    def table(t):
        t = t.astype(compute).reshape([rows, head_dim])
        if position_ids is None:
            return t.reshape([1, seq, 1, head_dim])
        return paddle.gather(t, position_ids.astype("int64").flatten(), axis=0).reshape([-1, seq, 1, head_dim])

    sin32, cos32 = table(sin), table(cos)

    def rotate(x):
        if x is None:
            return None
        x32 = x.astype(compute)
        return (x32 * cos32 + _rotate(x32, use_neox_rotary_style) * sin32).astype(x.dtype)

    return rotate(q), rotate(k), rotate(v)


# ----------------------------------------------------------------------------- RMSNorm
# fused_rms_norm_quant(x, bias, residual, norm_weight, norm_bias, epsilon, begin_norm_axis, quant_scale,
# quant_round_type, quant_max_bound, quant_min_bound) -> out, residual_out, inv_var
# (paddle/incubate/nn/functional/fused_rms_norm.py; ops.yaml fused_rms_norm_quant, InferMeta
# paddle/phi/infermeta/multiary.cc RmsNormInferMeta: norm_weight's size is the product of x's axes from
# begin_norm_axis, out has x's shape (int8 when quantized), inv_var float32 [rows]). Arithmetic in
# float32: x * rsqrt(mean(x^2) + epsilon) * norm_weight (+ norm_bias). (Paddle's CPU build registers
# this op with an AVX-512 kernel, RmsNormAvxKernel, which stops with SIGILL on CPUs without AVX-512.)

def fused_rms_norm_quant(x, bias, residual, norm_weight, norm_bias, epsilon, begin_norm_axis, quant_scale,
                         quant_round_type, quant_max_bound, quant_min_bound):
    CALLS["fused_rms_norm_quant"] += 1
    _check_cpu_dtype("fused_rms_norm x", x)
    axis = begin_norm_axis if begin_norm_axis >= 0 else begin_norm_axis + x.ndim
    _enforce(0 < axis < x.ndim, f"fused_rms_norm: begin_norm_axis {begin_norm_axis} out of range for {x.ndim}-D x")
    normalized = math.prod(x.shape[axis:])
    _enforce(math.prod(norm_weight.shape) == normalized,
             f"fused_rms_norm: norm_weight has {math.prod(norm_weight.shape)} elements, the normalized axes "
             f"{x.shape[axis:]} {normalized}")
    _enforce(norm_bias is None or norm_bias.shape == norm_weight.shape,
             f"fused_rms_norm: norm_bias {None if norm_bias is None else norm_bias.shape} must have norm_weight's shape")
    if bias is not None or residual is not None or quant_scale > 0:
        raise NotImplementedError("fused_rms_norm stand-in: bias, residual and quantization are not implemented "
                                  "(models/parallel_layers.py RMSNorm passes none)")
    compute = paddle.float64 if x.dtype == paddle.float64 else paddle.float32
    rows = [math.prod(x.shape[:axis]), normalized]
    x32 = x.astype(compute).reshape(rows)
    inv_var = paddle.rsqrt(paddle.square(x32).mean(-1, keepdim=True) + epsilon)
    out = x32 * inv_var * norm_weight.astype(compute).reshape([1, normalized])
    if norm_bias is not None:
        out = out + norm_bias.astype(compute).reshape([1, normalized])
    return out.reshape(x.shape).astype(x.dtype), None, inv_var.reshape([rows[0]]).astype("float32")


# ----------------------------------------------------------------------------- fast LayerNorm
# PaddleNLP's `fast_ln` custom op (model_zoo/gpt-3/external_ops/fast_ln/ln_api.cpp, built separately for
# CUDA; paddlenlp/transformers/gpt/modeling.py calls fast_ln.fast_ln(x, weight, bias, eps)[0]):
# fast_ln(x, scale, bias, epsilon) -> y (scale's dtype, x's shape), mean, invvar (float32 [rows]);
# LnFwd checks: bias's type is scale's, x has >= 2 axes, scale and bias have one shape whose size is x's
# last axis, epsilon >= 0. Arithmetic in float32: (x - mean) * invvar * scale + bias, invvar =
# rsqrt(biased variance + epsilon).

def fast_ln(x, scale, bias, epsilon):
    CALLS["fast_ln"] += 1
    _check_cpu_dtype("fast_ln x", x)
    _enforce(bias.dtype == scale.dtype, f"fast_ln: bias dtype {bias.dtype} must be scale's {scale.dtype}")
    _enforce(x.ndim >= 2, f"fast_ln: x must have at least 2 axes, got {x.shape}")
    _enforce(scale.shape == bias.shape, f"fast_ln: scale {scale.shape} and bias {bias.shape} must have one shape")
    _enforce(math.prod(scale.shape) == x.shape[-1], f"fast_ln: scale has {math.prod(scale.shape)} elements, "
                                                    f"x's last axis {x.shape[-1]}")
    _enforce(epsilon >= 0.0, f"fast_ln: epsilon must be >= 0, got {epsilon}")
    compute = paddle.float64 if x.dtype == paddle.float64 else paddle.float32
    cols = x.shape[-1]
    x32 = x.astype(compute).reshape([-1, cols])
    mean = x32.mean(-1, keepdim=True)
    centered = x32 - mean
    invvar = paddle.rsqrt(paddle.square(centered).mean(-1, keepdim=True) + epsilon)
    y = centered * invvar * scale.astype(compute).reshape([1, cols]) + bias.astype(compute).reshape([1, cols])
    return y.reshape(x.shape).astype(scale.dtype), mean.reshape([-1]).astype("float32"), \
        invvar.reshape([-1]).astype("float32")


# ----------------------------------------------------------------------------- the ring's overlapped transfers
# paddle.distributed.batch_isend_irecv(p2p_op_list) -> tasks (python/paddle/distributed/communication/
# batch_isend_irecv.py): its checks (_check_p2p_op_list: a list of P2POps, one backend), then every isend and
# irecv issued inside one coalescing group; on NCCL they run while the ranks compute. Gloo's send blocks until
# the peer receives, so on a gloo group the ops run here in an order that pairs each send with a receive in a
# ring (even ranks send first, odd ranks receive first: models/ring_attention.py ring_pass's rule), and return
# no tasks (nothing is left in flight, as after Paddle's coalesced call whose tasks the ring never waits on).

def batch_isend_irecv(p2p_op_list):
    from paddle import distributed as dist
    from paddle.distributed.communication.batch_isend_irecv import _check_p2p_op_list

    group = p2p_op_list[0].group if p2p_op_list else None
    if group is None or str(group.backend).upper() != "GLOO":
        return _ORIGINALS["batch_isend_irecv"](p2p_op_list)
    CALLS["batch_isend_irecv"] += 1
    _check_p2p_op_list(p2p_op_list)
    sends = [op for op in p2p_op_list if op.op is dist.isend]
    receives = [op for op in p2p_op_list if op.op is dist.irecv]
    for phase in ((sends, receives) if group.rank % 2 == 0 else (receives, sends)):
        for op in phase:
            (dist.send if op.op is dist.isend else dist.recv)(op.tensor, op.peer, group=op.group)
    return []


def _ring_transfers_on_cpu(original):
    """The ring's choice of overlapped transfers (models/ring_attention.py transfers_overlap), as on a GPU
    for a gloo group: its batch_isend_irecv reaches the stand-in above."""
    def overlap(group):
        return True if str(getattr(group, "backend", "GLOO")).upper() == "GLOO" else original(group)

    overlap.standin_of = original
    return overlap


# ----------------------------------------------------------------------------- install
STANDIN_BINDINGS = {"flash_attn": flash_attn, "flash_attn_grad": flash_attn_grad,
                    "flashmask_attention": flashmask_attention, "flashmask_attention_grad": flashmask_attention_grad,
                    "fused_rotary_position_embedding": fused_rotary_position_embedding,
                    "fused_rms_norm_quant": fused_rms_norm_quant}


def _select_sdp_on_cpu(original):
    """sdpa's backend choice with the GPU-only conditions of flash (CUDA place, fp16/bf16, SM) replaced by
    "CPU float32/float64": the head size, causal-with-equal-lengths and no-scale rules are sdpa's own
    (paddle/nn/functional/sdpa.py can_use_flash_attention)."""
    from paddle.nn.functional import sdpa

    def select(params):
        on_cpu = all(place.is_cpu_place() for place in params.place)
        same_cpu_dtype = len(set(params.dtype)) == 1 and params.dtype[0] in CPU_DTYPES
        if on_cpu and same_cpu_dtype and sdpa.check_head_dim_size_flash(params) \
                and sdpa.check_flash_causal_non_square_seqlens(params) and sdpa.check_scale_is_None(params):
            return "flash_attn"
        return original(params)

    select.standin_of = original
    return select


class _GpuLikePlace:
    def is_gpu_place(self):
        return True


def _ring_blocks_on_cpu(original):
    """The ring's choice of blocks (models/ring_attention.py attention_blocks) as on a GPU in bf16 for a
    CPU float32 run: its flag and head-size rules stay."""
    def choose(use_flash_attention, place, dtype, head_dim):
        if place.is_cpu_place() and str(dtype).replace("paddle.", "") in ("float32", "float64"):
            return original(use_flash_attention, _GpuLikePlace(), "bfloat16", head_dim)
        return original(use_flash_attention, place, dtype, head_dim)

    choose.standin_of = original
    return choose


def install_kernel_standins() -> list[str]:
    """Put the stand-ins behind Paddle's kernel bindings (once per process); returns what was replaced."""
    from paddle.nn.functional import sdpa

    from models import ring_attention

    if not _ORIGINALS:
        for name, standin in STANDIN_BINDINGS.items():
            _ORIGINALS[name] = getattr(_C_ops, name)
            setattr(_C_ops, name, standin)
        _ORIGINALS["select_sdp_for_sdpa"] = sdpa.select_sdp_for_sdpa
        sdpa.select_sdp_for_sdpa = _select_sdp_on_cpu(sdpa.select_sdp_for_sdpa)
        _ORIGINALS["attention_blocks"] = ring_attention.attention_blocks
        ring_attention.attention_blocks = _ring_blocks_on_cpu(ring_attention.attention_blocks)
        _ORIGINALS["transfers_overlap"] = ring_attention.transfers_overlap
        ring_attention.transfers_overlap = _ring_transfers_on_cpu(ring_attention.transfers_overlap)
        _ORIGINALS["batch_isend_irecv"] = paddle.distributed.batch_isend_irecv
        paddle.distributed.batch_isend_irecv = batch_isend_irecv
        _ORIGINALS["get_flags"] = paddle.base.framework.get_flags
        paddle.get_flags = paddle.base.framework.get_flags = _get_flags_on_cpu(paddle.base.framework.get_flags)
        _ORIGINALS["fast_ln"] = sys.modules.get("fast_ln")
        sys.modules["fast_ln"] = types.ModuleType("fast_ln", "llm_pretrain.cpu.kernel_standins: the CPU stand-in of "
                                                             "PaddleNLP's fast_ln op")
        sys.modules["fast_ln"].fast_ln = fast_ln
    return installed_kernel_standins()


def installed_kernel_standins() -> list[str]:
    """The kernels served by a stand-in in this process (empty: none installed). For the run record."""
    return sorted(list(STANDIN_BINDINGS) + ["fast_ln", "batch_isend_irecv"]) if _ORIGINALS else []


def uninstall_kernel_standins() -> None:
    """Paddle's own bindings back (tests that install in-process)."""
    from paddle.nn.functional import sdpa

    from models import ring_attention

    if not _ORIGINALS:
        return
    for name in STANDIN_BINDINGS:
        setattr(_C_ops, name, _ORIGINALS[name])
    sdpa.select_sdp_for_sdpa = _ORIGINALS["select_sdp_for_sdpa"]
    ring_attention.attention_blocks = _ORIGINALS["attention_blocks"]
    ring_attention.transfers_overlap = _ORIGINALS["transfers_overlap"]
    paddle.distributed.batch_isend_irecv = _ORIGINALS["batch_isend_irecv"]
    paddle.get_flags = paddle.base.framework.get_flags = _ORIGINALS["get_flags"]
    if _ORIGINALS["fast_ln"] is None:
        sys.modules.pop("fast_ln", None)
    else:
        sys.modules["fast_ln"] = _ORIGINALS["fast_ln"]
    _ORIGINALS.clear()
