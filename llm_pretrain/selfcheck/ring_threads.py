"""The ring attention's ranks as threads of one process: a ring of cp blocks checked on one device.

models/ring_attention.py RingAttention runs each rank's share of a causal attention and passes (k, v)
and their gradients round the ring. Here every rank is a thread and the passes go through queues
(gloo's blocking ring_pass, NCCL's batch_isend_irecv), so the whole ring runs where there is one
device: on CPU with PlainBlocks (tests/test_ring_blocks.py) and on one GPU with FlashBlocks, the
flash kernels in every block (the GPU self-check's ring rows, llm_pretrain/selfcheck/rows.py).
The result is put back in sequence order and compared with one attention over the whole sequence.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from types import SimpleNamespace

import numpy as np
import paddle
import paddle.nn.functional as F

from models import ring_attention
from models.ring_attention import RingAttention, attention_blocks, balanced_positions, balanced_split


class _Context:
    def save_for_backward(self, *tensors):
        self.saved = tensors

    def saved_tensor(self):
        return self.saved


@contextlib.contextmanager
def _patched(*replacements):
    """(object, attribute, value) set for the block and restored after it."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _recorded_blocks(blocks, events):
    class Recorded:
        @staticmethod
        def forward(*args):
            events[threading.current_thread().rank].append("compute")
            return blocks.forward(*args)

        @staticmethod
        def backward(*args):
            events[threading.current_thread().rank].append("compute")
            return blocks.backward(*args)

    return Recorded


def ring_in_threads(degree, q, k, v, grad_out, slopes, blocks, backend="GLOO", events=None,
                    documents=None) -> list[np.ndarray]:
    """Each rank's RingAttention forward and backward in a thread; returns whole-sequence out, dq, dk, dv
    (float32 numpy, sequence order). q/grad_out [b, s, heads, d], k/v [b, s, kv_heads, d].

    backend "GLOO": the blocking ring_pass; "NCCL": the overlapped path, one batch_isend_irecv per pass.
    Both go through queues here. events: {rank: []} to record each rank's "issue" (a pass started),
    "compute" (a block's forward or backward) and "wait" (a pass's tensors taken) in order.
    documents: models/ring_attention.py DocumentBlocks of the whole batch (packed documents), or None."""
    seq = q.shape[1]
    inboxes = [queue.Queue() for _ in range(degree)]

    def ring_pass(tensors, group):
        inboxes[(group.rank + 1) % group.nranks].put([t.clone() for t in tensors])
        return inboxes[group.rank].get(timeout=120)

    def batch_isend_irecv(ops):  # every isend to the next rank, every irecv from the previous one
        sends = [op for op in ops if op.op is paddle.distributed.isend]
        receives = [op for op in ops if op.op is paddle.distributed.irecv]
        assert len(sends) == len(receives) and all(op.group is ops[0].group for op in ops)
        rank = ops[0].group.rank
        inboxes[sends[0].peer].put([op.tensor.clone() for op in sends])
        if events is not None:
            events[rank].append("issue")
        for op, got in zip(receives, inboxes[rank].get(timeout=120)):
            paddle.assign(got, output=op.tensor)
        return []

    replacements = [(ring_attention, "ring_pass", ring_pass), (paddle.distributed, "batch_isend_irecv", batch_isend_irecv)]
    if events is not None:
        blocks = _recorded_blocks(blocks, events)
        wait = ring_attention.PendingPass.wait

        def recorded_wait(self):
            events[threading.current_thread().rank].append("wait")
            return wait(self)

        replacements.append((ring_attention.PendingPass, "wait", recorded_wait))
    results, errors = {}, []

    def rank_main(rank):
        threading.current_thread().rank = rank
        try:
            group = SimpleNamespace(rank=rank, nranks=degree, ranks=list(range(degree)), backend=backend)
            local = [balanced_split(t, rank, degree) for t in (q, k, v, grad_out)]
            ctx = _Context()
            with paddle.no_grad():
                out = RingAttention.forward(ctx, *local[:3], seq, slopes, group, blocks, documents)
                if events is not None:
                    events[rank].append("backward")
                results[rank] = (out, *RingAttention.backward(ctx, local[3]))
        except Exception as error:  # noqa: BLE001 -- re-raised in the caller's thread
            errors.append(error)
            for inbox in inboxes:  # let the other ranks stop waiting
                inbox.put([paddle.zeros([1])] * 4)

    with _patched(*replacements):
        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(degree)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    whole = []
    for i, like in enumerate((q, q, k, v)):
        full = np.zeros(like.shape, "float32")
        for rank in range(degree):
            full[:, balanced_positions(seq, rank, degree).numpy()] = results[rank][i].astype("float32").numpy()
        whole.append(full)
    return whole


def whole_attention(q, k, v, grad_out, slopes, document_ids=None) -> list[np.ndarray]:
    """One causal attention over the whole sequence in float32 on CPU (paddle autograd), from the same
    values as the ring's (half-precision inputs are widened exactly): out, dq, dk, dv. With document ids
    [batch, seq], masked by models/decoder.py's document mask (the one-process path)."""
    place = paddle.CPUPlace()
    q, k, v, grad_out = (paddle.to_tensor(t.astype("float32").numpy(), place=place, stop_gradient=False)
                         for t in (q, k, v, grad_out))
    seq, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    groups = heads // k.shape[2]
    qt = q.transpose([0, 2, 1, 3]) / math.sqrt(head_dim)
    kt, vt = (paddle.repeat_interleave(t, groups, axis=2).transpose([0, 2, 1, 3]) for t in (k, v))
    scores = paddle.matmul(qt, kt, transpose_y=True)
    positions = paddle.arange(seq, dtype="float32").cpu()
    if slopes:
        scores = scores + paddle.to_tensor(slopes, place=place)[None, :, None, None] * positions[None, None, None, :]
    scores = scores + paddle.triu(paddle.full([seq, seq], float("-inf")).cpu(), diagonal=1)
    if document_ids is not None:
        from models.decoder import document_mask

        scores = scores + document_mask(document_ids)
    out = paddle.matmul(F.softmax(scores, axis=-1), vt).transpose([0, 2, 1, 3])
    (out * grad_out).sum().backward()
    return [t.numpy() for t in (out, q.grad, k.grad, v.grad)]


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's geometric slopes for a power-of-two head count (Press et al. 2022: 2**(-8 i / heads))."""
    return [2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]


# The self-check's shapes on a GPU: head_dim 64 (a flash kernel size), 8 query heads over 2 kv heads,
# 1024 tokens (cp4: blocks of 256, each rank's two chunks of 128).
GPU_SHAPE = {"batch": 1, "seq": 1024, "heads": 8, "kv_heads": 2, "head_dim": 64}
CPU_SHAPE = {"batch": 2, "seq": 16, "heads": 4, "kv_heads": 2, "head_dim": 8}
UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-10}


def ring_bound(dtype: str, degree: int) -> float:
    """Each output and gradient over the largest magnitude of the float32 whole attention's: in half
    precision four units for the block kernel (as the kernel table's, rows.KERNEL_RELATIVE_BOUND) plus one
    for each further block merged in (the ring rounds each block's out and each pass's dk, dv to the dtype:
    degree - 1 more roundings); float32: 1e-5 (the order of the sums alone)."""
    return 1e-5 if dtype == "float32" else (4 + degree - 1) * UNIT[dtype]


def ring_check(device: str, dtype: str, degree: int, seed: int = 0, shape: dict | None = None) -> dict:
    """The ring (cp `degree` as threads) against one whole attention, causal with grouped kv heads, with
    rotary-style positions (no bias) and with ALiBi: forward and q/k/v gradients, each relative to the largest
    value of the float32 reference. On a GPU in half precision the blocks are FlashBlocks (the kernels the
    production ring runs), elsewhere PlainBlocks."""
    shape = shape or (GPU_SHAPE if device == "gpu" else CPU_SHAPE)
    b, s, h, kv, d = (shape[key] for key in ("batch", "seq", "heads", "kv_heads", "head_dim"))
    rng = np.random.RandomState(seed)

    def tensor(*dims):
        return paddle.to_tensor(rng.randn(*dims).astype("float32")).astype(dtype)

    q, k, v, grad_out = tensor(b, s, h, d), tensor(b, s, kv, d), tensor(b, s, kv, d), tensor(b, s, h, d)
    blocks = attention_blocks(True, q.place, q.dtype, d)
    bound = ring_bound(dtype, degree)
    cases, passed = {}, True
    for label, slopes in (("causal+gqa", None), ("causal+gqa+alibi", alibi_slopes(h))):
        got = ring_in_threads(degree, q, k, v, grad_out, slopes, blocks, "NCCL" if device == "gpu" else "GLOO")
        expected = whole_attention(q, k, v, grad_out, slopes)
        diffs = {name: float(np.abs(a - e).max() / max(float(np.abs(e).max()), 1e-30))
                 for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected)}
        cases[label] = diffs
        passed = passed and max(diffs.values()) <= bound
    return {"cases": cases, "blocks": blocks.__name__, "degree": degree, "shape": shape, "passed": bool(passed),
            "bound": f"relative to the float32 whole attention's largest value <= {bound:.3g} ({dtype}, "
                     "ring_threads.ring_bound)"}
