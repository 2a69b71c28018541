"""The CPU stand-ins of the GPU-only kernels (llm_pretrain/cpu/kernel_standins.py), in this process.

    each stand-in against the plain path, forward and gradients (float32; float64 for flash attention),
        and the checks the kernel makes (a wrong shape or dtype raises as the kernel would);
    the switch: LLM_PRETRAIN_KERNEL_STANDINS=1 keeps the four kernel options on CPU (and the swiglu
        kernel), without it they are dropped with a warning; bf16 stays GPU-only;
    the mechanism: a training with the switch calls every stand-in once per decoder layer and
        micro-batch (counted per layer: a branch not taken in some layer fails), and trains like the
        plain path of one process within 1e-5 (LLaMA: flash, fused rope, fused RMSNorm, swiglu;
        GPT-3: flash, fast LayerNorm; Bloom: ALiBi as flash's additive mask, the embedding's fast LayerNorm).
The parallel layouts with the stand-ins: tests/test_parallel_parity.py, tests/test_long_context.py,
tests/test_expert_parallel.py (runs named *-kernels in the shared launches).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from llm_pretrain.cpu import kernel_standins as ks
from models.decoder import apply_rotary, rotary_cos_sin
from models.parallel_layers import RMSNorm
from parity_utils import DEVICE, argv, assert_same_training, base_arguments, run_record, train_records, write_json

# The stand-ins are CPU implementations, installed only on CPU; under LLM_PRETRAIN_TEST_DEVICE=gpu the real
# kernels run instead (their numbers: scripts/gpu_selfcheck.py).
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="kernel stand-ins are CPU-only")


@pytest.fixture
def standins():
    ks.install_kernel_standins()
    ks.CALLS.clear()
    yield ks
    ks.uninstall_kernel_standins()


def _random(*shape, seed, dtype="float32"):
    return paddle.to_tensor(np.random.RandomState(seed).randn(*shape).astype(dtype), stop_gradient=False)


def _grads(out, inputs, seed=99):
    weights = paddle.to_tensor(np.random.RandomState(seed).randn(*out.shape).astype(str(out.dtype).split(".")[-1]))
    return paddle.grad((out * weights).sum(), inputs)


def _close(a, b, atol):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- flash attention
def _reference_attention(q, k, v, mask=None, causal=False):
    """Plain attention with k/v repeated per query head; causal bottom-right aligned."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kr, vr = (paddle.repeat_interleave(t, h // hk, axis=2).transpose([0, 2, 1, 3]) for t in (k, v))
    scores = paddle.matmul(q.transpose([0, 2, 1, 3]), kr, transpose_y=True) / math.sqrt(d)
    if mask is not None:
        scores = scores + mask
    if causal:
        hidden = np.arange(sk)[None, :] > np.arange(sq)[:, None] + (sk - sq)
        scores = scores + paddle.to_tensor(np.where(hidden, -np.inf, 0.0).astype(str(q.dtype).split(".")[-1]))
    return paddle.matmul(F.softmax(scores, axis=-1), vr).transpose([0, 2, 1, 3]), paddle.logsumexp(scores, axis=-1)


@pytest.mark.parametrize("dtype, atol", [("float32", 2e-6), ("float64", 1e-12)])
@pytest.mark.parametrize("case", ["causal", "mask", "off-diagonal causal"])
def test_flash_attn_equals_plain_attention(standins, dtype, atol, case):
    sq, sk = (4, 8) if case == "off-diagonal causal" else (8, 8)
    q, k, v = _random(2, sq, 4, 8, seed=1, dtype=dtype), _random(2, sk, 2, 8, seed=2, dtype=dtype), \
        _random(2, sk, 2, 8, seed=3, dtype=dtype)  # grouped kv heads: 4 query heads share 2
    mask = paddle.to_tensor(np.random.RandomState(4).randn(2, 4, sq, sk).astype(dtype)) if case == "mask" else None
    causal = case != "mask"
    out, softmax, lse, seed_offset = paddle._C_ops.flash_attn(q, k, v, None, mask, 0.0, causal, False, False, "")
    expected, expected_lse = _reference_attention(q, k, v, mask, causal)
    _close(out, expected, atol)
    # the kernel's layout: out [b, sq, h, d] in q's dtype; softmax_lse float32 [b, h, sq rounded up to 128]
    assert out.dtype == q.dtype and lse.dtype == paddle.float32 and lse.shape == [2, 4, 128]
    _close(lse[:, :, :sq], expected_lse.astype("float32"), 1e-5)
    assert seed_offset.dtype == paddle.int64 and seed_offset.shape == [2]
    # the backward recomputes the probabilities from the float32 softmax_lse: float32's precision in float64
    for got, want in zip(_grads(out, [q, k, v]), _grads(expected, [q, k, v])):
        _close(got, want, 2e-5)
    assert standins.CALLS["flash_attn"] == 1 and standins.CALLS["flash_attn_grad"] == 1


def test_off_diagonal_causal_block_is_bottom_right_aligned(standins):
    """A 4-query block over 8 keys: query i sees keys 0..i+4 (top-left alignment would hide keys i+1..i+4)."""
    q, k, v = _random(1, 4, 2, 8, seed=1), _random(1, 8, 2, 8, seed=2), _random(1, 8, 2, 8, seed=3)
    out = paddle._C_ops.flash_attn(q, k, v, None, None, 0.0, True, False, False, "")[0]
    top_left = np.triu(np.full([4, 8], -np.inf, "float32"), k=1)[None, None]
    wrong, _ = _reference_attention(q, k, v, paddle.to_tensor(top_left))
    right, _ = _reference_attention(q, k, v, causal=True)
    _close(out, right, 2e-6)
    assert np.abs(out.numpy() - wrong.numpy()).max() > 1e-2


def test_flash_attn_grad_takes_the_rings_unpadded_lse(standins):
    q, k, v = _random(2, 8, 4, 8, seed=5), _random(2, 8, 2, 8, seed=6), _random(2, 8, 2, 8, seed=7)
    out, _, lse, seed_offset = paddle._C_ops.flash_attn(q, k, v, None, None, 0.0, True, False, False, "")
    dout = _random(2, 8, 4, 8, seed=8)
    padded = paddle._C_ops.flash_attn_grad(q, k, v, out, lse, seed_offset, None, dout, 0.0, True)
    unpadded = paddle._C_ops.flash_attn_grad(q, k, v, out, lse[:, :, :8], seed_offset, None, dout, 0.0, True)
    expected, _ = _reference_attention(q, k, v, causal=True)
    for a, b, want in zip(padded, unpadded, paddle.grad((expected * dout).sum(), [q, k, v])):
        _close(a, want, 2e-5)
        _close(b, a, 0)


def test_sdpa_reaches_the_flash_stand_in_as_on_a_gpu(standins):
    """F.scaled_dot_product_attention (models/decoder.py Attention.flash_attention) picks flash and its
    backward is flash_attn_grad; a head size the GPU kernel refuses (12) falls back to sdpa's math path."""
    q, k, v = _random(2, 8, 4, 16, seed=1), _random(2, 8, 2, 16, seed=2), _random(2, 8, 2, 16, seed=3)
    out = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, True)
    expected, _ = _reference_attention(q, k, v, causal=True)
    _close(out, expected, 2e-6)
    for got, want in zip(_grads(out, [q, k, v]), _grads(expected, [q, k, v])):
        _close(got, want, 2e-5)
    assert dict(standins.CALLS) == {"flash_attn": 1, "flash_attn_grad": 1}
    q12 = _random(2, 8, 4, 12, seed=1)
    F.scaled_dot_product_attention(q12, q12, q12, None, 0.0, True, True)
    assert standins.CALLS["flash_attn"] == 1


@pytest.mark.parametrize("bad, message", [
    ("mask dtype", "same data type with q"), ("mask and causal", "causal can not be true"),
    ("kv heads", "multiple of kv heads"), ("head_dim", "multiple of 8 up to 256"), ("dtype", "dtypes differ"),
    ("half", "half precision is GPU-only"), ("lse", "softmax_lse must be float32"),
])
def test_flash_attn_argument_checks(standins, bad, message):
    q, k, v = _random(2, 8, 4, 8, seed=1), _random(2, 8, 2, 8, seed=2), _random(2, 8, 2, 8, seed=3)
    mask, causal = None, True
    if bad == "mask dtype":
        mask, causal = paddle.zeros([2, 4, 8, 8], "float64"), False
    elif bad == "mask and causal":
        mask = paddle.zeros([2, 4, 8, 8], "float32")
    elif bad == "kv heads":
        k = v = _random(2, 8, 3, 8, seed=2)
    elif bad == "head_dim":
        q, k, v = _random(2, 8, 4, 12, seed=1), _random(2, 8, 2, 12, seed=2), _random(2, 8, 2, 12, seed=3)
    elif bad == "dtype":
        v = _random(2, 8, 2, 8, seed=3, dtype="float64")
    elif bad == "half":
        q, k, v = (t.astype("float16") for t in (q, k, v))
    with pytest.raises(ks.KernelArgumentError, match=message):
        if bad == "lse":
            out, _, lse, seed_offset = paddle._C_ops.flash_attn(q, k, v, None, None, 0.0, True, False, False, "")
            paddle._C_ops.flash_attn_grad(q, k, v, out, lse.transpose([0, 2, 1]), seed_offset, None, out, 0.0, True)
        else:
            paddle._C_ops.flash_attn(q, k, v, None, mask, 0.0, causal, False, False, "")


# ----------------------------------------------------------------------------- flashmask attention
def _document_ids():
    """Two samples of 24 tokens: documents of 7, 10, 7 and of 5, 19 tokens."""
    return paddle.to_tensor(np.stack([np.repeat([0, 1, 2], [7, 10, 7]), np.repeat([0, 1], [5, 19])]))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_flashmask_attention_equals_the_dense_document_mask(standins, kv_heads):
    """F.flashmask_attention (Paddle's wrapper, unchanged) with causal=True and the documents' row indices
    (models/decoder.py document_row_indices) gives the plain path's attention with the dense document mask
    and the causal mask, forward and gradients, grouped kv heads included."""
    from models.decoder import document_mask, document_row_indices

    q, k, v = _random(2, 24, 4, 8, seed=1), _random(2, 24, kv_heads, 8, seed=2), _random(2, 24, kv_heads, 8, seed=3)
    ids = _document_ids()
    indices = document_row_indices(ids)
    assert indices.dtype == paddle.int32 and indices.shape == [2, 1, 24, 1]
    np.testing.assert_array_equal(indices.numpy()[:, 0, :, 0], np.stack([np.repeat([7, 17, 24], [7, 10, 7]),
                                                                          np.repeat([5, 24], [5, 19])]))
    out = F.flashmask_attention(q, k, v, startend_row_indices=indices, causal=True)
    expected, _ = _reference_attention(q, k, v, document_mask(ids), causal=True)
    _close(out, expected, 2e-6)
    for got, want in zip(_grads(out, [q, k, v]), _grads(expected, [q, k, v])):
        _close(got, want, 2e-5)
    assert dict(standins.CALLS) == {"flashmask_attention": 1, "flashmask_attention_grad": 1}
    unmasked, _ = _reference_attention(q, k, v, causal=True)
    assert np.abs(out.numpy() - unmasked.numpy()).max() > 1e-2  # the indices do mask


@pytest.mark.parametrize("documents", [False, True])
def test_flash_stand_ins_under_core_attn_recompute(standins, documents):
    """recompute_granularity core_attn wraps the attention in fleet's non-reentrant recompute (models/decoder.py,
    models/mla.py), which matches the saved tensors of the recomputed forward to the first's by their order: the
    stand-ins' PyLayers save their inputs only (kernel_standins._SAVES_INPUTS_ONLY; saving out, the gradients came
    back off by 1e-3), so q, k and v's gradients equal those without recompute, and the kernel ran again in
    backward."""
    from paddle.distributed.fleet.utils import recompute

    from models.decoder import document_row_indices

    indices = document_row_indices(_document_ids())
    weights = _random(8, 8, seed=4)

    def attention(h):  # q, k, v made inside, so that recompute keeps only h
        q, k, v = h, paddle.matmul(h, weights), h * 3
        if documents:
            return F.flashmask_attention(q, k, v, startend_row_indices=indices, causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, training=True)

    grads = []
    for recomputed in (False, True):
        x = _random(2, 24, 2, 8, seed=5)
        h = paddle.matmul(x, weights)
        out = recompute(attention, h, use_reentrant=False) if recomputed else attention(h)
        (out * _random(2, 24, 2, 8, seed=6)).sum().backward()
        grads.append(x.grad)
    _close(grads[1], grads[0], 1e-6)
    kernel = "flashmask_attention" if documents else "flash_attn"
    assert dict(standins.CALLS) == {kernel: 3, kernel + "_grad": 2}  # forward twice, again in recompute


@pytest.mark.parametrize("causal, bounds", [(True, 2), (False, 2), (False, 4)])
def test_flashmask_row_bounds_mean_what_paddles_docstring_says(standins, causal, bounds):
    """The other layouts of startend_row_indices (Paddle 3.3.1 flashmask_attention's docstring), per key j and
    row i: causal [.., 2] hides start <= i < end; non-causal [.., 2] hides i >= start and i < end; [.., 4]
    hides b0 <= i < b1 and b2 <= i < b3. Checked against a mask written out element by element."""
    rng = np.random.RandomState(7)
    seq = 8
    low = rng.randint(1, seq + 1, size=(1, 1, seq, 1))
    if bounds == 2 and causal:
        values = np.concatenate([low, np.minimum(low + rng.randint(0, 4, low.shape), seq)], -1)
    elif bounds == 2:
        values = np.concatenate([np.maximum(low, np.arange(seq).reshape(1, 1, seq, 1) + 1),
                                 np.minimum(rng.randint(0, 3, low.shape), np.arange(seq).reshape(1, 1, seq, 1))], -1)
    else:
        up_end = np.minimum(rng.randint(0, 3, low.shape), np.arange(seq).reshape(1, 1, seq, 1))
        values = np.concatenate([np.maximum(low, np.arange(seq).reshape(1, 1, seq, 1) + 1), np.full(low.shape, seq),
                                 np.zeros(low.shape, int), up_end], -1)
    dense = np.zeros([1, 1, seq, seq], "float32")
    for j in range(seq):
        for i in range(seq):
            b = values[0, 0, j]
            hidden = (b[0] <= i < b[1]) if (causal and bounds == 2) else \
                (i >= b[0] or i < b[1]) if bounds == 2 else (b[0] <= i < b[1] or b[2] <= i < b[3])
            dense[0, 0, i, j] = -np.inf if hidden else 0.0
    q, k, v = _random(1, seq, 2, 8, seed=1), _random(1, seq, 2, 8, seed=2), _random(1, seq, 2, 8, seed=3)
    out = F.flashmask_attention(q, k, v, startend_row_indices=paddle.to_tensor(values.astype("int32")), causal=causal)
    expected, _ = _reference_attention(q, k, v, paddle.to_tensor(dense), causal=causal)
    _close(out, expected, 2e-6)


@pytest.mark.parametrize("bad, message", [
    ("int64", "must be paddle.int32"), ("bounds", "last dimension should be either 1 or 2"),
    ("seq", "must be equal to seqlen_k"), ("heads", "head_num must be equal to 1"), ("rank", "mask_bounds"),
])
def test_flashmask_attention_argument_checks(standins, bad, message):
    """The binding's checks (called without the wrapper, whose asserts are the same)."""
    q, k, v = _random(2, 8, 4, 8, seed=1), _random(2, 8, 2, 8, seed=2), _random(2, 8, 2, 8, seed=3)
    shape = {"bounds": [2, 1, 8, 4], "seq": [2, 1, 6, 1], "heads": [2, 3, 8, 1], "rank": [2, 8, 1]}.get(bad, [2, 1, 8, 1])
    indices = paddle.full(shape, 8, "int64" if bad == "int64" else "int32")
    with pytest.raises(ks.KernelArgumentError, match=message):
        paddle._C_ops.flashmask_attention(q, k, v, indices, None, 0.0, True, False, False, "")


def test_flashmask_wrapper_reads_gpu_only_flags_through_the_stand_in(standins):
    """Paddle's wrapper asks paddle.get_flags for FLAGS_cudnn_deterministic and FLAGS_flash_attn_version, which
    the CPU build does not have; the installed stand-in answers the GPU build's defaults, other flags unchanged."""
    flags = paddle.get_flags(["FLAGS_cudnn_deterministic", "FLAGS_flash_attn_version", "FLAGS_check_nan_inf"])
    assert flags["FLAGS_cudnn_deterministic"] is False and flags["FLAGS_flash_attn_version"] == 2
    assert "FLAGS_check_nan_inf" in flags


def test_ring_flash_blocks_run_on_the_stand_in(standins, monkeypatch):
    """The ring (cp2, GQA) with FlashBlocks, as ring_attention.attention_blocks picks them on a GPU when
    the stand-ins are installed, against one attention over the whole sequence; the ring's threads
    are llm_pretrain/selfcheck/ring_threads.py's."""
    from models import ring_attention
    from llm_pretrain.selfcheck.ring_threads import ring_in_threads, whole_attention

    assert ring_attention.attention_blocks(True, paddle.CPUPlace(), paddle.float32, 8) is ring_attention.FlashBlocks
    assert ring_attention.attention_blocks(False, paddle.CPUPlace(), paddle.float32, 8) is ring_attention.PlainBlocks
    q = _random(2, 16, 4, 8, seed=1)
    k, v = _random(2, 16, 2, 8, seed=2), _random(2, 16, 2, 8, seed=3)
    grad_out = _random(2, 16, 4, 8, seed=4)
    got = ring_in_threads(2, q, k, v, grad_out, None, ring_attention.FlashBlocks)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, whole_attention(q, k, v, grad_out, None)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    assert standins.CALLS["flash_attn"] == 2 * 2 and standins.CALLS["flash_attn_grad"] == 2 * 2  # per rank, per step


# A boundary at token 4 in every sample: under cp2 (chunks of 4; rank 0 holds tokens 0-3 and 12-15, rank 1
# 4-11) rank 1's block over keys 0-3 is masked entirely (skipped); rank 0's queries 12-15 over keys 4-11 partly,
# and in the second sample not at all (queries 12-15 see none of those keys: the kernel's lse +inf rows).
RING_DOCUMENTS = [[4, 12], [4, 6, 2, 4], [4, 1, 11]]


@pytest.mark.parametrize("degree", [2, 4])
def test_ring_flashmask_blocks_are_masked_attention_on_the_stand_in(standins, degree):
    """reset_attention_mask with use_flash_attention under cp: the ring's flash blocks (FlashMaskBlocks, picked
    where FlashBlocks would be) take FlashMask's row indices local to each block's query rows, and the ring
    (cp2, cp4; GQA) equals one document-masked attention over the whole sequence, forward and gradients. One
    flashmask call per computed block, forward and backward; the blocks the documents mask entirely skipped."""
    from models import ring_attention
    from llm_pretrain.selfcheck.ring_threads import ring_in_threads, whole_attention

    ids = paddle.to_tensor(np.stack([np.repeat(np.arange(len(n)), n) for n in RING_DOCUMENTS]).astype("int64"))
    q = _random(3, 16, 4, 8, seed=1)
    k, v = _random(3, 16, 2, 8, seed=2), _random(3, 16, 2, 8, seed=3)
    grad_out = _random(3, 16, 4, 8, seed=4)
    documents = ring_attention.document_blocks(ids, row_indices=True)
    got = ring_in_threads(degree, q, k, v, grad_out, None, ring_attention.FlashMaskBlocks, documents=documents)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, whole_attention(q, k, v, grad_out, None, ids)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
    assert np.abs(got[0] - whole_attention(q, k, v, grad_out, None)[0]).max() > 1e-3  # the documents mattered
    computed = standins.CALLS["flashmask_attention"]
    skipped = sum(rows is ring_attention.SKIP for rows in documents.built.values())
    assert computed == standins.CALLS["flashmask_attention_grad"] == degree * degree - skipped
    assert skipped > 0 and standins.CALLS["flash_attn"] == 0
    if degree == 2:
        assert computed == 3 and documents.built[(1, 0)] is ring_attention.SKIP, documents.built


# ----------------------------------------------------------------------------- rotary, norms, swiglu
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fused_rope_equals_apply_rotary(standins, kv_heads):
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    q, k = _random(2, 8, 4, 16, seed=1), _random(2, 8, kv_heads, 16, seed=2)
    cos, sin = rotary_cos_sin(8, 16, 10000.0)
    fq, fk, fv = fused_rotary_position_embedding(q, k, None, sin=sin, cos=cos, use_neox_rotary_style=False)
    pq, pk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert fv is None and fk.shape == k.shape
    _close(fq, pq, 1e-6)
    _close(fk, pk, 1e-6)
    for got, want in zip(_grads(fq + 0 * fk.sum(), [q]) + _grads(fk, [k]), _grads(pq, [q]) + _grads(pk, [k])):
        _close(got, want, 1e-6)


def test_fused_rope_position_ids_pick_each_tokens_row(standins):
    """position_ids [batch, seq] (positions restarting per document, as models/decoder.py passes them): each
    token rotated by its own row of the tables, the tables may be longer than the sequence."""
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    from models.decoder import document_positions

    q, k = _random(2, 24, 4, 16, seed=1), _random(2, 24, 2, 16, seed=2)
    positions = document_positions(_document_ids())
    cos, sin = rotary_cos_sin(32, 16, 10000.0)  # longer than the 24 tokens
    fq, fk, _ = fused_rotary_position_embedding(q, k, None, sin=sin, cos=cos, position_ids=positions,
                                                use_neox_rotary_style=False)
    rows = [paddle.gather(t[0], positions.flatten(), axis=0).reshape([2, 24, 1, 16]) for t in (cos, sin)]
    _close(fq, apply_rotary(q, *rows), 1e-6)
    _close(fk, apply_rotary(k, *rows), 1e-6)
    with pytest.raises(ks.KernelArgumentError, match="position_ids must be the same as those of q"):
        fused_rotary_position_embedding(q, k, None, sin=sin, cos=cos, position_ids=positions[:, :12],
                                        use_neox_rotary_style=False)


def test_fused_rope_neox_style_rotates_adjacent_pairs(standins):
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    q = _random(1, 2, 1, 4, seed=1)
    angle = np.random.RandomState(2).randn(1, 2, 1, 4).astype("float32")
    sin, cos = paddle.to_tensor(np.sin(angle)), paddle.to_tensor(np.cos(angle))
    out = fused_rotary_position_embedding(q, None, None, sin=sin, cos=cos, use_neox_rotary_style=True)[0].numpy()
    x = q.numpy()
    rotated = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(out, x * np.cos(angle) + rotated * np.sin(angle), atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    ("sin dtype", "must have q's dtype"), ("sin shape", "seq_len and head_dim of sin and cos"),
    ("sin batch", "batch_size and num_heads of sin and cos must be 1"), ("odd head_dim", "multiple of 2"),
    ("kv heads", "num_heads of q to be divisible"), ("sin cos", "dims of sin and cos must be the same"),
])
def test_fused_rope_argument_checks(standins, bad, message):
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    q, k = _random(2, 8, 4, 16, seed=1), _random(2, 8, 2, 16, seed=2)
    cos, sin = rotary_cos_sin(8, 16, 10000.0)
    if bad == "sin dtype":
        sin, cos = sin.astype("float64"), cos.astype("float64")
    elif bad == "sin shape":
        cos, sin = rotary_cos_sin(6, 16, 10000.0)
    elif bad == "sin batch":
        sin, cos = sin.expand([2, 8, 1, 16]), cos.expand([2, 8, 1, 16])
    elif bad == "odd head_dim":
        q, k = _random(2, 8, 4, 7, seed=1), None
    elif bad == "kv heads":
        k = _random(2, 8, 3, 16, seed=2)
    elif bad == "sin cos":
        cos = cos[:, :, :, :8]
    with pytest.raises(ks.KernelArgumentError, match=message):
        fused_rotary_position_embedding(q, k, None, sin=sin, cos=cos, use_neox_rotary_style=False)


def test_fused_rms_norm_equals_rms_norm(standins):
    from paddle.incubate.nn.functional import fused_rms_norm

    plain, fused = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6, fused=True)
    weight = np.random.RandomState(3).randn(16).astype("float32")
    for layer in (plain, fused):
        layer.weight.set_value(weight)
    x = _random(2, 5, 16, seed=1)
    out, expected = fused(x), plain(x)
    _close(out, expected, 1e-6)
    for got, want in zip(_grads(out, [x, fused.weight]), _grads(expected, [x, plain.weight])):
        _close(got, want, 1e-5)
    # the kernel's outputs: out (x's shape and dtype), residual_out (none without residual), inv_var float32 [rows]
    out, residual_out, inv_var = fused_rms_norm(x, fused.weight, None, 1e-6, begin_norm_axis=2)
    assert residual_out is None and inv_var.dtype == paddle.float32 and inv_var.shape == [10]
    with pytest.raises(ks.KernelArgumentError, match="norm_weight has 8 elements"):
        fused_rms_norm(x, paddle.ones([8]), None, 1e-6, begin_norm_axis=2)


def test_fast_ln_equals_layer_norm(standins):
    import fast_ln

    plain = paddle.nn.LayerNorm(16, epsilon=1e-5)
    plain.weight.set_value(np.random.RandomState(3).randn(16).astype("float32"))
    plain.bias.set_value(np.random.RandomState(4).randn(16).astype("float32"))
    x = _random(2, 5, 16, seed=1)
    y, mean, invvar = fast_ln.fast_ln(x, plain.weight, plain.bias, 1e-5)
    expected = plain(x)
    _close(y, expected, 2e-6)
    assert mean.shape == invvar.shape == [10] and mean.dtype == invvar.dtype == paddle.float32
    for got, want in zip(_grads(y, [x, plain.weight, plain.bias]), _grads(expected, [x, plain.weight, plain.bias])):
        _close(got, want, 1e-5)
    with pytest.raises(ks.KernelArgumentError, match="bias dtype"):
        fast_ln.fast_ln(x, plain.weight, plain.bias.astype("float64"), 1e-5)
    with pytest.raises(ks.KernelArgumentError, match="x's last axis"):
        fast_ln.fast_ln(x, paddle.ones([8]), paddle.zeros([8]), 1e-5)


def test_swiglu_kernel_of_the_cpu_build_equals_silu_times_up():
    """swiglu has a CPU kernel in Paddle 3.3.1 (no stand-in): the one a stand-in run's MLP calls."""
    gate, up = _random(3, 16, seed=1), _random(3, 16, seed=2)
    out, expected = F.swiglu(gate, up), F.silu(gate) * up
    _close(out, expected, 1e-6)
    for got, want in zip(_grads(out, [gate, up]), _grads(expected, [gate, up])):
        _close(got, want, 1e-6)


def test_uninstalled_bindings_are_paddles_own():
    ks.install_kernel_standins()
    assert paddle._C_ops.flash_attn is ks.flash_attn
    ks.uninstall_kernel_standins()
    assert paddle._C_ops.flash_attn is not ks.flash_attn and ks.installed_kernel_standins() == []
    q = _random(1, 8, 2, 8, seed=1)
    with pytest.raises(RuntimeError, match="flash_attn"):  # no CPU kernel: the stand-in is really gone
        paddle._C_ops.flash_attn(q, q, q, None, None, 0.0, True, False, False, "")


# ----------------------------------------------------------------------------- the switch
def _model_config(tmp_path, model, device="cpu", **keys):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import plan_layout
    from llm_pretrain.parallel.layout import build_model_config
    from llm_pretrain.run.preflight import gpu_only_warnings

    command = ["--model_name_or_path", model, "--input_dir", str(tmp_path), "--max_steps", "1"]
    for key, value in keys.items():
        command += [f"--{key}", str(value).lower()]
    args, _ = parse_arguments(command)
    config, _, _ = build_model_config(args, plan_layout(args, 1), device)
    return config, gpu_only_warnings(args, device)


KERNEL_KEYS = dict(use_flash_attention=True, use_fused_rope=True, use_fused_rms_norm=True, use_fast_layer_norm=True)


def test_the_switch_keeps_the_kernel_options_on_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("LLM_PRETRAIN_KERNEL_STANDINS", raising=False)
    config, warnings = _model_config(tmp_path, "llama-tiny", **KERNEL_KEYS, bf16=True)
    assert not (config.use_flash_attention or config.use_fused_rope or config.use_fused_rms_norm
                or config.use_fused_swiglu)
    assert len(warnings) == 5  # bf16 and the four kernel options
    monkeypatch.setenv("LLM_PRETRAIN_KERNEL_STANDINS", "1")
    config, warnings = _model_config(tmp_path, "llama-tiny", **KERNEL_KEYS, bf16=True)
    assert config.use_flash_attention and config.use_fused_rope and config.use_fused_rms_norm and config.use_fused_swiglu
    assert [w.split()[0] for w in warnings] == ["bf16"]  # half precision stays GPU-only
    gpt, _ = _model_config(tmp_path, "gpt3-tiny", **KERNEL_KEYS)
    assert gpt.use_fast_layer_norm  # the fast_ln package is the stand-in's (not installed here)


# ----------------------------------------------------------------------------- a training through the stand-ins
LAYERS, STEPS, MICRO_BATCHES = 2, 2, 4


def _count_per_layer(monkeypatch):
    """{kernel: {layer index or "outside": calls}} for every stand-in and F.swiglu, during training."""
    from models.decoder import DecoderLayer

    counts, current = defaultdict(lambda: defaultdict(int)), [None]
    forward = DecoderLayer.forward

    def layer_forward(self, hidden, *documents):
        current[0] = self.layer_index if self.training else None
        try:
            return forward(self, hidden, *documents)
        finally:
            current[0] = None

    def counted(name, function):
        def call(*args, **kwargs):
            counts[name]["outside" if current[0] is None else current[0]] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(DecoderLayer, "forward", layer_forward)
    for name in ks.STANDIN_BINDINGS:
        monkeypatch.setattr(paddle._C_ops, name, counted(name, getattr(paddle._C_ops, name)))
    import fast_ln

    monkeypatch.setattr(fast_ln, "fast_ln", counted("fast_ln", fast_ln.fast_ln))
    monkeypatch.setattr(F, "swiglu", counted("swiglu", F.swiglu))
    return counts


@pytest.fixture(scope="module")
def trainings(tmp_path_factory, embedded_corpus):
    """Plain and stand-in trainings of three families in this process; returns (work dir, counts per run)."""
    from llm_pretrain.run_pretrain import main

    work = tmp_path_factory.mktemp("standins")
    monkeypatch = pytest.MonkeyPatch()
    counts = {}
    try:
        for model in EXPECTED:
            args_file = write_json(work / f"{model}.json", base_arguments(
                embedded_corpus, work, model_name_or_path=f"{model}-tiny", num_hidden_layers=LAYERS,
                max_steps=STEPS, save_steps=STEPS))
            monkeypatch.delenv("LLM_PRETRAIN_KERNEL_STANDINS", raising=False)
            assert main(argv(args_file, work / f"{model}-plain")) == 0
            ks.install_kernel_standins()  # (the run's preflight would install them: the same, once)
            with monkeypatch.context() as patched:
                patched.setenv("LLM_PRETRAIN_KERNEL_STANDINS", "1")
                counts[model] = _count_per_layer(patched)
                ks.CALLS.clear()
                assert main(argv(args_file, work / f"{model}-kernels", **KERNEL_KEYS)) == 0
                # flash_attn_grad runs in autograd's backward (the stand-in's PyLayer), outside any layer
                counts[model]["flash_attn_grad"] = {"outside": ks.CALLS["flash_attn_grad"]}
            ks.uninstall_kernel_standins()
    finally:
        ks.uninstall_kernel_standins()
        monkeypatch.undo()
    return work, counts


# Calls per decoder layer and micro-batch in training forward (the backward's flash_attn_grad is counted
# outside the layers: one per flash_attn), and outside the layers per micro-batch (the final norm,
# Bloom's embedding LayerNorm).
EXPECTED = {
    "llama": ({"flash_attn": 1, "fused_rotary_position_embedding": 1, "fused_rms_norm_quant": 2, "swiglu": 1},
              {"fused_rms_norm_quant": 1}),
    "gpt3": ({"flash_attn": 1, "fast_ln": 2}, {"fast_ln": 1}),
    "bloom": ({"flash_attn": 1, "fast_ln": 2}, {"fast_ln": 2}),
}


@pytest.mark.parametrize("model", EXPECTED)
def test_every_layer_takes_every_kernel_branch(trainings, model):
    _, counts = trainings
    per_layer, outside = EXPECTED[model]
    forwards = STEPS * MICRO_BATCHES
    seen = {name: dict(by_layer) for name, by_layer in counts[model].items()}
    for name, calls in per_layer.items():
        assert {layer: seen.get(name, {}).get(layer, 0) for layer in range(LAYERS)} == \
            {layer: calls * forwards for layer in range(LAYERS)}, (name, seen.get(name))
    for name, calls in outside.items():
        assert seen[name].get("outside", 0) == calls * forwards, (name, seen[name])
    assert seen["flash_attn_grad"] == {"outside": LAYERS * forwards}
    used = set(per_layer) | {"flash_attn_grad"}
    assert set(seen) == used, set(seen) ^ used  # and no other stand-in ran
    kernels = run_record(trainings[0] / f"{model}-kernels")["built"]["kernels"]
    assert kernels["stand_ins"] == sorted(used - {"swiglu"})
    assert kernels["paddle_kernels"] == (["swiglu"] if "swiglu" in used else [])
    assert run_record(trainings[0] / f"{model}-plain")["built"]["kernels"] == \
        {"fused_branches": [], "stand_ins": [], "paddle_kernels": []}


@pytest.mark.parametrize("model", EXPECTED)
def test_stand_in_training_equals_the_plain_path(trainings, model):
    work, _ = trainings
    diffs = assert_same_training(work / f"{model}-plain", work / f"{model}-kernels", step=STEPS)
    print(model, diffs)
    assert len(train_records(work / f"{model}-kernels")) == STEPS
