"""mp2 worker: every patched model-parallel op and layer, forward and backward, vs plain paddle.

Each check builds the full tensors on every rank (same seeds), runs the fleet
op/layer on this rank's part, and compares the output and the gradients with
single-process paddle math on the full tensors.
"""

from types import SimpleNamespace

from worker_common import Checks, dist, fleet, init_fleet, leaf, max_err, np, paddle, randn

from paddle.distributed.fleet.layers.mpu import mp_ops
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

hcg, strategy, init_seconds = init_fleet(mp_degree=2)
fleet.meta_parallel.model_parallel_random_seed(1234)
group = hcg.get_model_parallel_group()
n, r = group.nranks, group.rank
F = paddle.nn.functional


def part(t, axis=-1):
    """This rank's chunk of `t` along `axis`."""
    return paddle.split(t, n, axis=axis)[r]


def linear_ref(x, w, b, g):
    """Plain paddle: y = x @ w + b, loss = sum(y * g); returns y and the gradients."""
    x, w, b = leaf(x), leaf(w), leaf(b)
    y = paddle.matmul(x, w) + b
    (y * g).sum().backward()
    return SimpleNamespace(y=y, dx=x.grad, dw=w.grad, db=b.grad)


def check_c_identity():
    x = randn([3, 4, 6], 1)
    g = [randn([3, 4, 6], 100 + i) for i in range(n)]  # a different upstream grad on each rank
    xr = leaf(x)
    y = mp_ops._c_identity(xr, group=group)
    (y * g[r]).sum().backward()
    return {"fwd": max_err(y, x), "grad": max_err(xr.grad, paddle.add_n(g))}


def check_c_split():
    x, g = randn([3, 4, 8], 2), randn([3, 4, 8], 3)
    xr = leaf(x)
    y = mp_ops._c_split(xr, group=group)
    (y * part(g)).sum().backward()
    return {"fwd": max_err(y, part(x)), "grad": max_err(xr.grad, g)}


def check_c_concat():
    x, g = randn([3, 4, 8], 4), randn([3, 4, 8], 5)
    xr = leaf(part(x))
    y = mp_ops._c_concat(xr, group=group)
    (y * g).sum().backward()
    return {"fwd": max_err(y, x), "grad": max_err(xr.grad, part(g))}


def check_mp_allreduce():
    xs = [randn([3, 5], 10 + i) for i in range(n)]
    g = randn([3, 5], 6)
    xr = leaf(xs[r])
    y = mp_ops._mp_allreduce(xr * 1.0, group=group, use_calc_stream=True, use_model_parallel=True)
    (y * g).sum().backward()
    return {"fwd": max_err(y, paddle.add_n(xs)), "grad": max_err(xr.grad, g)}


def check_column_parallel(gather_output):
    x, w, b, g = randn([2, 3, 6], 20), randn([6, 8], 21), randn([8], 22), randn([2, 3, 8], 23)
    ref = linear_ref(x, w, b, g)
    layer = fleet.meta_parallel.ColumnParallelLinear(6, 8, has_bias=True, gather_output=gather_output)
    layer.weight.set_value(part(w))
    layer.bias.set_value(part(b))
    xr = leaf(x)
    y = layer(xr)
    if gather_output:
        (y * g).sum().backward()
        fwd = max_err(y, ref.y)
    else:
        (y * part(g)).sum().backward()
        fwd = max_err(y, part(ref.y))
    return {"fwd": fwd, "dx": max_err(xr.grad, ref.dx), "dw": max_err(layer.weight.grad, part(ref.dw)),
            "db": max_err(layer.bias.grad, part(ref.db))}  # fmt: skip


def check_row_parallel(input_is_parallel):
    x, w, b, g = randn([2, 3, 8], 30), randn([8, 6], 31), randn([6], 32), randn([2, 3, 6], 33)
    ref = linear_ref(x, w, b, g)
    layer = fleet.meta_parallel.RowParallelLinear(8, 6, has_bias=True, input_is_parallel=input_is_parallel)
    layer.weight.set_value(part(w, axis=0))
    layer.bias.set_value(b)
    xr = leaf(part(x) if input_is_parallel else x)
    y = layer(xr)
    (y * g).sum().backward()
    dx_expected = part(ref.dx) if input_is_parallel else ref.dx
    return {"fwd": max_err(y, ref.y), "dx": max_err(xr.grad, dx_expected),
            "dw": max_err(layer.weight.grad, part(ref.dw, axis=0)), "db": max_err(layer.bias.grad, ref.db)}  # fmt: skip


def check_upstream_c_split_backward():
    """Documents the upstream bug the patch fixes: RowParallelLinear(input_is_parallel=False)
    with Paddle's own c_split_eager.backward (still reachable as __wrapped__)."""
    patched = mp_ops.c_split_eager.backward
    mp_ops.c_split_eager.backward = staticmethod(patched.__wrapped__)
    try:
        x, w, b, g = randn([4, 8], 30), randn([8, 6], 31), randn([6], 32), randn([4, 6], 33)
        ref = linear_ref(x, w, b, g)
        layer = fleet.meta_parallel.RowParallelLinear(8, 6, has_bias=True, input_is_parallel=False)
        layer.weight.set_value(part(w, axis=0))
        layer.bias.set_value(b)
        xr = leaf(x)
        (layer(xr) * g).sum().backward()
        dx = xr.grad.reshape(x.shape)  # the upstream gradient has shape [n*4, 8/n]
        return {"dx": max_err(dx, ref.dx), "shape_ok": float(list(xr.grad.shape) == list(x.shape))}
    finally:
        mp_ops.c_split_eager.backward = patched


def check_vocab_parallel_embedding():
    emb, g = randn([16, 5], 40), randn([3, 4, 5], 41)
    ids = paddle.to_tensor(np.random.RandomState(42).randint(0, 16, size=[3, 4]).astype("int64"))
    full = leaf(emb)
    ref = F.embedding(ids, full)
    (ref * g).sum().backward()
    layer = fleet.meta_parallel.VocabParallelEmbedding(16, 5)
    layer.weight.set_value(part(emb, axis=0))
    y = layer(ids)
    (y * g).sum().backward()
    return {"fwd": max_err(y, ref), "dw": max_err(layer.weight.grad, part(full.grad, axis=0))}


def check_parallel_cross_entropy():
    logits, g = randn([3, 4, 16], 50, scale=3.0), randn([3, 4, 1], 51)
    labels = np.random.RandomState(52).randint(0, 16, size=[3, 4]).astype("int64")
    labels[0, :2] = -100  # ignore_index
    labels = paddle.to_tensor(labels)
    full = leaf(logits)
    ref = F.cross_entropy(full, labels.unsqueeze(-1), reduction="none", ignore_index=-100)
    (ref * g).sum().backward()
    lr = leaf(part(logits))
    loss = fleet.meta_parallel.ParallelCrossEntropy()(lr, labels)
    (loss * g).sum().backward()
    return {"loss": max_err(loss, ref), "grad": max_err(lr.grad, part(full.grad))}


def check_sequence_parallel_ops():
    x, g = randn([4, 2, 3], 60), randn([4, 2, 3], 61)
    xs = [randn([4, 2, 3], 62 + i) for i in range(n)]
    gs = [randn([4, 2, 3], 70 + i) for i in range(n)]
    seq = lambda t: part(t, axis=0)  # noqa: E731
    out = {}

    xr = leaf(x)  # ScatterOp: own sequence chunk; backward all-gathers
    y = spu.ScatterOp.apply(xr)
    (y * seq(g)).sum().backward()
    out.update(scatter_fwd=max_err(y, seq(x)), scatter_grad=max_err(xr.grad, g))

    xr = leaf(seq(x))  # GatherOp: all-gather; backward keeps own chunk
    y = spu.GatherOp.apply(xr)
    (y * g).sum().backward()
    out.update(gather_fwd=max_err(y, x), gather_grad=max_err(xr.grad, seq(g)))

    xr = leaf(seq(x))  # AllGatherOp: all-gather; backward reduce-scatters
    y = spu.AllGatherOp.apply(xr)
    (y * gs[r]).sum().backward()
    out.update(allgather_fwd=max_err(y, x), allgather_grad=max_err(xr.grad, seq(paddle.add_n(gs))))

    xr = leaf(xs[r])  # ReduceScatterOp: reduce-scatter; backward all-gathers
    y = spu.ReduceScatterOp.apply(xr)
    (y * seq(g)).sum().backward()
    out.update(reducescatter_fwd=max_err(y, seq(paddle.add_n(xs))), reducescatter_grad=max_err(xr.grad, g))
    return out


def check_column_sequence_parallel():
    x, w, b, g = randn([4, 2, 6], 80), randn([6, 8], 81), randn([8], 82), randn([4, 2, 8], 83)
    ref = linear_ref(x, w, b, g)
    layer = spu.ColumnSequenceParallelLinear(6, 8, has_bias=True, gather_output=False)
    layer.weight.set_value(part(w))
    layer.bias.set_value(part(b))
    xr = leaf(part(x, axis=0))
    y = layer(xr)
    (y * part(g)).sum().backward()
    return {"fwd": max_err(y, part(ref.y)), "dx": max_err(xr.grad, part(ref.dx, axis=0)),
            "dw": max_err(layer.weight.grad, part(ref.dw)), "db": max_err(layer.bias.grad, part(ref.db))}  # fmt: skip


def check_row_sequence_parallel():
    x, w, b, g = randn([4, 2, 8], 90), randn([8, 6], 91), randn([6], 92), randn([4, 2, 6], 93)
    ref = linear_ref(x, w, b, g)
    layer = spu.RowSequenceParallelLinear(8, 6, has_bias=True, input_is_parallel=True)
    layer.weight.set_value(part(w, axis=0))
    layer.bias.set_value(b)
    xr = leaf(part(x))
    y = layer(xr)
    (y * part(g, axis=0)).sum().backward()
    db = layer.bias.grad.clone()  # partial (own sequence chunk): what the SP allreduce hooks sum
    dist.all_reduce(db, group=group)
    return {"fwd": max_err(y, part(ref.y, axis=0)), "dx": max_err(xr.grad, part(ref.dx)),
            "dw": max_err(layer.weight.grad, part(ref.dw, axis=0)), "db": max_err(db, ref.db)}  # fmt: skip


def check_reduce_scatter():
    xs = [randn([4, 3], 100 + i) for i in range(n)]
    expected = part(paddle.add_n(xs), axis=0)
    out = {}
    y = paddle.empty([2, 3])
    dist.reduce_scatter(y, paddle.split(xs[r], n, axis=0), group=group)  # tensor-list form
    out["list"] = max_err(y, expected)
    y = paddle.empty([2, 3])
    dist.stream.reduce_scatter(y, xs[r], group=group, sync_op=True)  # single-tensor form
    out["tensor"] = max_err(y, expected)
    y = paddle.empty([2, 3])
    dist.stream.reduce_scatter(y, xs[r], group=group, sync_op=True, use_calc_stream=True)
    out["tensor_calc_stream"] = max_err(y, expected)
    out["input_untouched"] = max_err(xs[r], randn([4, 3], 100 + r))
    return out


def check_alltoall():
    """Patch 12: chunk j of rank i's inputs arrives as chunk i on rank j (list, single-tensor and
    calc-stream forms); int64 too (token ids)."""
    chunks = [[randn([2, 3], 300 + 10 * i + j) for j in range(n)] for i in range(n)]  # [sender][receiver]
    expected = paddle.concat([chunks[i][r] for i in range(n)], axis=0)
    out = {}
    received = []
    dist.alltoall(received, chunks[r], group=group)
    out["list"] = max_err(paddle.concat(received, axis=0), expected)
    received = [paddle.empty([2, 3]) for _ in range(n)]
    dist.stream.alltoall(received, chunks[r], group=group, sync_op=True, use_calc_stream=True)
    out["list_calc_stream"] = max_err(paddle.concat(received, axis=0), expected)
    y = paddle.empty([2 * n, 3])
    dist.alltoall_single(y, paddle.concat(chunks[r], axis=0), group=group)
    out["single"] = max_err(y, expected)
    ids = [paddle.full([4], 100 * r + j, dtype="int64") for j in range(n)]
    received = []
    dist.alltoall(received, ids, group=group)
    out["int64"] = max_err(paddle.concat(received), paddle.concat([paddle.full([4], 100 * i + r, dtype="int64")
                                                                    for i in range(n)]))
    # Uneven split sizes (a MoE dispatch) where the last rank's happen to be equal: every rank still
    # takes the uneven path (it hung in gloo when that rank skipped the sizes' exchange).
    sends = [[1 + i + j for j in range(n)] for i in range(n - 1)] + [[2] * n]  # [sender][receiver] rows
    x = paddle.concat([randn([sends[r][j], 3], 400 + 10 * r + j) for j in range(n)])
    y = paddle.empty([sum(sends[i][r] for i in range(n)), 3])
    dist.alltoall_single(y, x, in_split_sizes=sends[r], out_split_sizes=[sends[i][r] for i in range(n)], group=group)
    out["single_uneven"] = max_err(y, paddle.concat([randn([sends[i][r], 3], 400 + 10 * i + r) for i in range(n)]))
    return out


def check_process_group_calc_stream():
    pg = group.process_group
    out = {}
    t = randn([3], 110 + r)
    pg.broadcast_on_calc_stream(t, 0).wait()
    out["broadcast"] = max_err(t, randn([3], 110))
    t = randn([3], 110 + r)
    pg.reduce_on_calc_stream(t, 0, paddle.base.core.ReduceOp.SUM).wait()
    if r == 0:
        out["reduce"] = max_err(t, paddle.add_n([randn([3], 110 + i) for i in range(n)]))
    t = paddle.empty([n * 3])
    pg.all_gather_into_tensor_on_calc_stream(t, randn([3], 110 + r)).wait()
    out["all_gather_into_tensor"] = max_err(t, paddle.concat([randn([3], 110 + i) for i in range(n)]))
    t = randn([4], 120) if r == 0 else paddle.zeros([4])
    if r == 0:
        pg.send_on_calc_stream(t, 1).wait()
    else:
        pg.recv_on_calc_stream(t, 0).wait()
    out["send_recv"] = max_err(t, randn([4], 120))
    t = paddle.empty([n * 3])
    pg.all_gather_on_calc_stream(t, randn([3], 110 + r)).wait()
    out["all_gather"] = max_err(t, paddle.concat([randn([3], 110 + i) for i in range(n)]))
    t = paddle.empty([3])
    pg.scatter_on_calc_stream(t, randn([n * 3], 125), 0).wait()  # rank 0's tensor, chunk per rank
    out["scatter"] = max_err(t, part(randn([n * 3], 125), axis=0))
    t = paddle.empty([3])
    pg.scatter_tensor_on_calc_stream(t, randn([n * 3], 126), 1).wait()  # from rank 1
    out["scatter_tensor"] = max_err(t, part(randn([n * 3], 126), axis=0))
    # partial p2p / all-gather (pipeline p2p with mp > 1): part `r` of n of a tensor
    full = randn([n * 4], 130)
    t = full.clone() if r == 0 else paddle.zeros([n * 4])
    if r == 0:
        pg.send_partial_on_calc_stream(t, 1, n, 1).wait()
    else:
        pg.recv_partial_on_calc_stream(t, 0, n, 1).wait()
        out["send_recv_partial"] = max_err(t[4:8], full[4:8])
    t = paddle.zeros([n * 4])
    t[r * 4 : (r + 1) * 4] = full[r * 4 : (r + 1) * 4]
    pg.all_gather_partial_on_calc_stream(t, t, n, r).wait()
    out["all_gather_partial"] = max_err(t, full)
    t = paddle.zeros([n * 4])
    t[r * 4 : (r + 1) * 4] = full[r * 4 : (r + 1) * 4]
    pg.all_gather_partial(t, t, n, r).wait()
    out["all_gather_partial_no_calc_stream"] = max_err(t, full)
    return out


class _TinyMP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.col = fleet.meta_parallel.ColumnParallelLinear(6, 8, has_bias=True, gather_output=False)
        self.row = fleet.meta_parallel.RowParallelLinear(8, 6, has_bias=True, input_is_parallel=True)

    def forward(self, x):
        return self.row(paddle.nn.functional.relu(self.col(x)))


def check_broadcast_input_data():
    w1, b1, w2, b2 = randn([6, 8], 130), randn([8], 131), randn([8, 6], 132), randn([6], 133)
    model = _TinyMP()
    model.col.weight.set_value(part(w1))
    model.col.bias.set_value(part(b1))
    model.row.weight.set_value(part(w2, axis=0))
    model.row.bias.set_value(b2)
    wrapped = fleet.distributed_model(model)  # TensorParallel: broadcasts inputs from mp rank 0
    x = randn([3, 6], 140 + r)  # a different input on each rank
    y = wrapped(x)
    x0 = randn([3, 6], 140)
    ref = paddle.matmul(F.relu(paddle.matmul(x0, w1) + b1), w2) + b2
    return {"input": max_err(x, x0), "fwd": max_err(y, ref)}


checks = Checks()
checks.run("c_identity", check_c_identity)
checks.run("c_split", check_c_split)
checks.run("c_concat", check_c_concat)
checks.run("mp_allreduce", check_mp_allreduce)
checks.run("column_parallel_gather", check_column_parallel, True)
checks.run("column_parallel_no_gather", check_column_parallel, False)
checks.run("row_parallel_input_parallel", check_row_parallel, True)
checks.run("row_parallel_split_input", check_row_parallel, False)
checks.run("vocab_parallel_embedding", check_vocab_parallel_embedding)
checks.run("parallel_cross_entropy", check_parallel_cross_entropy)
checks.run("sequence_parallel_ops", check_sequence_parallel_ops)
checks.run("column_sequence_parallel", check_column_sequence_parallel)
checks.run("row_sequence_parallel", check_row_sequence_parallel)
checks.run("reduce_scatter", check_reduce_scatter)
checks.run("process_group_calc_stream", check_process_group_calc_stream)
checks.run("alltoall", check_alltoall)
checks.run("broadcast_input_data", check_broadcast_input_data)
upstream = Checks()
upstream.run("upstream_c_split_backward", check_upstream_c_split_backward)
checks.write(init_seconds=round(init_seconds, 3), upstream=upstream.errors, upstream_failures=upstream.failures)
