"""Ring attention's blocks (models/ring_attention.py), checked in this process on CPU.

The ring computes each block with one interface: PlainBlocks (float32 matmul/softmax, the CPU path)
or FlashBlocks (Paddle's flash_attn / flash_attn_grad kernels, GPU only). Without a GPU this file
checks every part of the flash wiring that needs no kernel:
  - the plain block keeps the kernel's contract (out [b, s, h, d], log-sum-exp [b, h, s] float32,
    exp(scores - lse) are the probabilities) and two blocks merged through their lse are the
    attention over both;
  - the dispatch: flash on a GPU place in half precision when the run asks for it, plain otherwise;
  - FlashBlocks' calls are accepted by Paddle's bindings of the two kernels (argument count and
    types), which then find no CPU kernel;
  - the whole ring (cp2, cp4; GQA; ALiBi) against one attention over the whole sequence, forward and
    q/k/v gradients, with PlainBlocks and with FlashBlocks whose kernels are `PlainMathFlashKernels`:
    the two kernels' arguments, layouts, checks and causal rule (bottom-right aligned, as flash
    attention 2 for a non-square block) in plain math written apart from PlainBlocks. So the
    flash-layout conversions, the lse slicing and the causal flag of every block are proven; the
    kernel's own numbers are the GPU self-check's (scripts/gpu_selfcheck.py, bf16-o2:cp2).
The ranks of a ring run as threads here: the ring's passes (gloo's blocking ring_pass, NCCL's
batch_isend_irecv) go through queues.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from models import ring_attention
from llm_pretrain.selfcheck.ring_threads import ring_in_threads, whole_attention
from models.ring_attention import FlashBlocks, PlainBlocks, attention_blocks, merge_blocks

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 16, 4, 2, 8
SLOPES = [0.5, 0.25, 0.125, 0.0625]


def _random(*shape, seed):
    return paddle.to_tensor(np.random.RandomState(seed).randn(*shape).astype("float32"))


# ----------------------------------------------------------------------------- the flash kernels, in plain math
class PlainMathFlashKernels:
    """`_C_ops.flash_attn` and `_C_ops.flash_attn_grad` of Paddle 3.3.1 (argument order of
    paddle/phi/kernels/flash_attn_kernel.h and flash_attn_grad_kernel.h) computed in float64 numpy,
    with the checks the kernels make on what FlashBlocks hands them."""

    @staticmethod
    def _probabilities(q, k, attn_mask, causal, lse=None):
        b, sq, h, d = q.shape
        _, sk, hk, dk = k.shape
        assert q.ndim == 4 and k.ndim == 4 and dk == d and h % hk == 0 and k.shape[0] == b
        q64 = q.numpy().astype("float64").transpose(0, 2, 1, 3)
        k64 = np.repeat(k.numpy().astype("float64"), h // hk, axis=2).transpose(0, 2, 1, 3)
        scores = q64 @ k64.transpose(0, 1, 3, 2) / math.sqrt(d)
        if attn_mask is not None:  # flash_attn_utils.h: "attn_mask is expected to have the same data type with q"
            assert attn_mask.dtype == q.dtype and attn_mask.shape in ([b, h, sq, sk], [b, 1, sq, sk]), attn_mask.shape
            scores = scores + attn_mask.numpy().astype("float64")
        if causal:  # flash attention 2: bottom-right aligned, query i sees keys j <= i + sk - sq
            hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
            scores = np.where(hidden, -np.inf, scores)
        if lse is None:
            top = scores.max(-1, keepdims=True)
            lse = (top + np.log(np.exp(scores - top).sum(-1, keepdims=True)))[..., 0]
        return np.exp(scores - lse[..., None]), lse, k64, q64

    @staticmethod
    def flash_attn(q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name):
        assert fixed_seed_offset is None and dropout == 0.0 and not return_softmax and isinstance(rng_name, str)
        assert q.dtype == k.dtype == v.dtype and k.shape == v.shape
        probs, lse, _, _ = PlainMathFlashKernels._probabilities(q, k, attn_mask, causal)
        hk = k.shape[2]
        v64 = np.repeat(v.numpy().astype("float64"), q.shape[2] // hk, axis=2).transpose(0, 2, 1, 3)
        out = (probs @ v64).transpose(0, 2, 1, 3)
        seed_offset = paddle.to_tensor([0, 0], dtype="int64")
        # softmax_lse as the kernel allocates it: seqlen_q rounded up to 128 (flash_attn_utils.h softmax_lse_dims)
        rows = -(-q.shape[1] // 128) * 128
        padded = np.concatenate([lse, np.zeros(lse.shape[:2] + (rows - q.shape[1],))], axis=-1)
        return (paddle.to_tensor(out.astype("float32")).astype(q.dtype), None,
                paddle.to_tensor(padded.astype("float32")), seed_offset)

    @staticmethod
    def flash_attn_grad(q, k, v, out, softmax_lse, seed_offset, attn_mask, dout, dropout, causal):
        b, sq, h, d = q.shape
        hk = k.shape[2]
        assert out.shape == q.shape and dout.shape == q.shape and out.dtype == q.dtype == dout.dtype
        assert softmax_lse.shape == [b, h, sq] and softmax_lse.dtype == paddle.float32, softmax_lse.shape
        assert seed_offset.shape == [2] and seed_offset.dtype == paddle.int64 and dropout == 0.0
        lse = softmax_lse.numpy().astype("float64")
        probs, _, k64, q64 = PlainMathFlashKernels._probabilities(q, k, attn_mask, causal, lse)
        v64 = np.repeat(v.numpy().astype("float64"), h // hk, axis=2).transpose(0, 2, 1, 3)
        do = dout.numpy().astype("float64").transpose(0, 2, 1, 3)
        delta = (do * out.numpy().astype("float64").transpose(0, 2, 1, 3)).sum(-1, keepdims=True)
        grad_scores = probs * (do @ v64.transpose(0, 1, 3, 2) - delta) / math.sqrt(d)
        dq = (grad_scores @ k64).transpose(0, 2, 1, 3)
        dk = (grad_scores.transpose(0, 1, 3, 2) @ q64).reshape(b, hk, h // hk, -1, d).sum(2).transpose(0, 2, 1, 3)
        dv = (probs.transpose(0, 1, 3, 2) @ do).reshape(b, hk, h // hk, -1, d).sum(2).transpose(0, 2, 1, 3)
        return tuple(paddle.to_tensor(g.astype("float32")).astype(q.dtype) for g in (dq, dk, dv))


@pytest.fixture
def flash_in_plain_math(monkeypatch):
    monkeypatch.setattr(ring_attention, "_C_ops", PlainMathFlashKernels)


# ----------------------------------------------------------------------------- one block
def _block_inputs(queries=8, keys=8, seed=0):
    q = _random(BATCH, queries, HEADS, HEAD_DIM, seed=seed)
    k = _random(BATCH, keys, KV_HEADS, HEAD_DIM, seed=seed + 1)
    v = _random(BATCH, keys, KV_HEADS, HEAD_DIM, seed=seed + 2)
    bias = _random(1, HEADS, queries, keys, seed=seed + 3)
    return q, k, v, bias


@pytest.mark.parametrize("causal, with_bias", [(True, False), (False, True), (True, True)])
def test_plain_block_keeps_the_flash_kernels_contract(causal, with_bias, flash_in_plain_math):
    q, k, v, bias = _block_inputs()
    bias = bias if with_bias else None
    out, lse = PlainBlocks.forward(q, k, v, causal, bias)
    assert out.shape == [BATCH, 8, HEADS, HEAD_DIM] and lse.shape == [BATCH, HEADS, 8] and lse.dtype == paddle.float32
    flash_out, flash_lse = FlashBlocks.forward(q, k, v, causal, bias)
    assert flash_out.shape == out.shape and flash_lse.shape == lse.shape
    np.testing.assert_allclose(out.numpy(), flash_out.numpy(), atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), flash_lse.numpy(), atol=1e-5)
    grad_out = _random(*out.shape, seed=9)
    plain_grads = PlainBlocks.backward(q, k, v, out, lse, grad_out, causal, bias)
    flash_grads = FlashBlocks.backward(q, k, v, out, lse, grad_out, causal, bias)
    for plain, flash, like in zip(plain_grads, flash_grads, (q, k, v)):
        assert plain.shape == flash.shape == like.shape
        np.testing.assert_allclose(plain.numpy(), flash.numpy(), atol=1e-5)


def test_the_causal_flag_of_a_block_that_is_not_square_changes_it(flash_in_plain_math):
    """The oracle sees a causal flag on an off-diagonal block (the ring sets it on the diagonal only)."""
    q, k, v, _ = _block_inputs(queries=4, keys=8)
    plain, _ = FlashBlocks.forward(q, k, v, False, None)
    masked, _ = FlashBlocks.forward(q, k, v, True, None)
    assert np.abs(plain.numpy() - masked.numpy()).max() > 1e-2


def test_blocks_merged_through_their_lse_are_attention_over_both():
    q, k, v, bias = _block_inputs(keys=12)
    whole_out, whole_lse = PlainBlocks.forward(q, k, v, False, bias)
    first = PlainBlocks.forward(q, k[:, :5], v[:, :5], False, bias[..., :5])
    second = PlainBlocks.forward(q, k[:, 5:], v[:, 5:], False, bias[..., 5:])
    out, lse = merge_blocks(first[0], first[1], *second)
    np.testing.assert_allclose(out.numpy(), whole_out.numpy(), atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), whole_lse.numpy(), atol=1e-5)


def test_flash_runs_on_a_gpu_in_half_precision_when_asked():
    gpu, cpu = SimpleNamespace(is_gpu_place=lambda: True), paddle.ones([1]).place  # no CUDAPlace in a CPU build
    assert attention_blocks(True, gpu, paddle.bfloat16, 128) is FlashBlocks
    assert attention_blocks(True, gpu, paddle.float16, 64) is FlashBlocks
    assert attention_blocks(True, cpu, paddle.bfloat16, 128) is PlainBlocks
    assert attention_blocks(False, gpu, paddle.bfloat16, 128) is PlainBlocks  # the run's flag, as the dense path
    assert attention_blocks(True, gpu, paddle.float32, 128) is PlainBlocks  # the kernel takes fp16/bf16 only
    assert attention_blocks(True, gpu, paddle.bfloat16, 260) is PlainBlocks  # nor head_dim above 256


def test_flash_blocks_calls_are_accepted_by_the_kernels_bindings():
    """Paddle's bindings check the number and types of the arguments before looking up the kernel: on a
    CPU tensor the calls get as far as "kernel not registered" (a wrong argument list is a TypeError)."""
    q, k, v, bias = _block_inputs()
    for call in (lambda: FlashBlocks.forward(q, k, v, True, None), lambda: FlashBlocks.forward(q, k, v, True, bias)):
        with pytest.raises(RuntimeError, match="flash_attn"):
            call()
    out, lse = PlainBlocks.forward(q, k, v, True, None)
    with pytest.raises(RuntimeError, match="flash_attn_grad"):
        FlashBlocks.backward(q, k, v, out, lse, out, True, bias)


# ----------------------------------------------------------------------------- the ring
# The ranks as threads (llm_pretrain/selfcheck/ring_threads.py, shared with the GPU self-check's ring rows).


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "flash"])
@pytest.mark.parametrize("slopes", [None, SLOPES], ids=["rope", "alibi"])
@pytest.mark.parametrize("backend", ["GLOO", "NCCL"])
def test_ring_of_blocks_is_attention_over_the_whole_sequence(degree, kind, slopes, backend, monkeypatch):
    if kind == "flash":
        monkeypatch.setattr(ring_attention, "_C_ops", PlainMathFlashKernels)
    q = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=1)
    k, v = (_random(BATCH, SEQ, KV_HEADS, HEAD_DIM, seed=seed) for seed in (2, 3))
    grad_out = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=4)
    blocks = FlashBlocks if kind == "flash" else PlainBlocks
    got = ring_in_threads(degree, q, k, v, grad_out, slopes, blocks, backend)
    expected = whole_attention(q, k, v, grad_out, slopes)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("degree", [2, 4])
def test_ring_transfers_are_in_flight_while_each_block_is_computed(degree, monkeypatch):
    """Issue 33, finding 6. On NCCL each pass is one batch_isend_irecv issued before the block it overlaps
    and waited on after it (as Paddle's own ring and PaddleFormers'): in forward the next (k, v) travels
    during every block but the last; in backward every block is computed while a pass is in flight, the
    next (k, v) or the previous block's (dk, dv)."""
    q = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=1)
    k, v = (_random(BATCH, SEQ, KV_HEADS, HEAD_DIM, seed=seed) for seed in (2, 3))
    events = {rank: [] for rank in range(degree)}
    ring_in_threads(degree, q, k, v, _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=4), None,
                     PlainBlocks, "NCCL", events)
    for rank, seen in events.items():
        split = seen.index("backward")
        for phase, phase_events in (("forward", seen[:split]), ("backward", seen[split + 1:])):
            in_flight, at_compute = 0, []
            for event in phase_events:
                in_flight += {"issue": 1, "wait": -1}.get(event, 0)
                if event == "compute":
                    at_compute.append(in_flight)
            assert in_flight == 0, (rank, phase, phase_events)  # every pass was waited on
            # backward: the first block has the next (k, v) in flight, the middle ones also the previous
            # block's gradient, the last only that gradient
            expected = [1] * (degree - 1) + [0] if phase == "forward" else [1] + [2] * (degree - 2) + [1]
            assert at_compute == expected, (rank, phase, phase_events)


# ----------------------------------------------------------------------------- packed documents on the ring
# Two samples of 16 tokens, a document boundary at token 4 in both: under cp2 (chunks of 4; rank 0 holds
# tokens 0-3 and 12-15, rank 1 tokens 4-11) rank 1's block over rank 0's first chunk (its queries 4-11
# over keys 0-3) lies across that boundary in every sample, so no query sees any key there.
DOCUMENTS = [[4, 12], [4, 6, 6]]


class CountedBlocks(PlainBlocks):
    calls: list = []

    @staticmethod
    def forward(q, k, v, causal, bias):
        CountedBlocks.calls.append(("forward", q.shape[1], k.shape[1]))
        return PlainBlocks.forward(q, k, v, causal, bias)

    @staticmethod
    def backward(q, k, v, out, lse, grad_out, causal, bias):
        CountedBlocks.calls.append(("backward", q.shape[1], k.shape[1]))
        return PlainBlocks.backward(q, k, v, out, lse, grad_out, causal, bias)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("slopes", [None, SLOPES], ids=["rope", "alibi"])
def test_ring_with_document_masks_is_masked_attention_and_skips_masked_blocks(degree, slopes, monkeypatch):
    """reset_attention_mask under cp: every block masked by the documents (forward and gradients equal one
    masked attention over the whole sequence), and a block the documents mask entirely is not computed."""
    from models.ring_attention import DocumentBlocks

    q = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=1)
    k, v = (_random(BATCH, SEQ, KV_HEADS, HEAD_DIM, seed=seed) for seed in (2, 3))
    grad_out = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=4)
    ids = paddle.to_tensor(np.stack([np.repeat(np.arange(len(n)), n) for n in DOCUMENTS]).astype("int64"))
    CountedBlocks.calls = []
    got = ring_in_threads(degree, q, k, v, grad_out, slopes, CountedBlocks, documents=DocumentBlocks(ids))
    expected = whole_attention(q, k, v, grad_out, slopes, ids)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    unmasked = whole_attention(q, k, v, grad_out, slopes)
    assert np.abs(got[0] - unmasked[0]).max() > 1e-3  # the mask changed the attention
    computed = [c for c in CountedBlocks.calls if c[0] == "forward"]
    assert len(computed) < degree * degree  # without documents every rank computes `degree` blocks
    assert sorted(c for c in CountedBlocks.calls if c[0] == "backward") == sorted(
        ("backward", *c[1:]) for c in computed)  # backward skips the same blocks
    if degree == 2:
        assert len(computed) == 3, computed  # rank 1's queries 4-11 over keys 0-3: skipped


def test_each_blocks_document_mask_is_built_once_per_forward_for_every_layer(monkeypatch):
    """A block's document bias and its host read (skip or not) are the same in every layer and in backward:
    built once per forward (models/ring_attention.py DocumentBlocks, `document_blocks`), not per layer."""
    from models.ring_attention import DocumentBlocks, document_blocks

    q = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=1)
    k, v = (_random(BATCH, SEQ, KV_HEADS, HEAD_DIM, seed=seed) for seed in (2, 3))
    grad_out = _random(BATCH, SEQ, HEADS, HEAD_DIM, seed=4)
    ids = paddle.to_tensor(np.stack([np.repeat(np.arange(len(n)), n) for n in DOCUMENTS]).astype("int64"))
    documents = document_blocks(ids)
    assert document_blocks(ids) is documents  # every layer of the forward gets the same blocks
    builds = []
    original = paddle.index_select
    monkeypatch.setattr(paddle, "index_select", lambda *a, **kw: builds.append(1) or original(*a, **kw))
    first = ring_in_threads(2, q, k, v, grad_out, None, PlainBlocks, documents=documents)
    built = len(builds)
    assert built == 2 * 2 * 2 and len(documents.built) == 2 * 2  # 2 ranks x 2 blocks, queries' and keys' ids
    second = ring_in_threads(2, q, k, v, grad_out, None, PlainBlocks, documents=documents)  # the next layer
    assert len(builds) == built
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert document_blocks(ids.clone()) is not documents  # the next forward's ids: built anew
    assert isinstance(documents, DocumentBlocks)
