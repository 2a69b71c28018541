"""Run Paddle's own fleet hybrid-parallel code on CPU processes (gloo).

Paddle 3.3.1's fleet stack (tensor/sequence/pipeline parallel layers, the
hybrid wrappers, group-sharded stages 1-3) is written for GPUs; on CPU a
handful of points fail. `apply_cpu_compat()` patches exactly those points and
nothing else, so the *official* fleet code runs unchanged over gloo. Call it
once per process, before `fleet.init`, and only when the device is CPU; it is
idempotent, and every patch is guarded (gloo process groups / CPU tensors /
device "cpu") so that an accelerator path that reaches it runs upstream code.

Patches (line numbers: Paddle 3.3.1 sources under paddle/distributed/):

1. ProcessGroupGloo `*_on_calc_stream` methods -> the synchronous gloo method
   (every gloo op is synchronous); `reduce_scatter[_tensor]` (unimplemented in
   gloo) -> all_reduce of a copy, keep this rank's chunk; partial send/recv
   (unimplemented) and all_gather_partial (wrong input size) -> the plain op on
   a view of the part. Used by mp_ops.py:54,71,246,
   sequence_parallel_utils.py:82,333, p2p_communication.py:278-299,336-338.
2. `mp_ops._C_ops` -> a view of `_C_ops` with CPU versions of `c_identity`,
   `c_split`, `c_concat`, `c_softmax_with_cross_entropy` (no CPU kernels;
   mp_ops.py:49,63,147,260,429). Only mp_ops sees them; global `_C_ops` is
   untouched.
3. `mp_ops.c_split_eager.backward` (mp_ops.py:65-75): upstream all-gathers the
   gradient into axis 0 while the forward split the LAST axis, so
   RowParallelLinear(input_is_parallel=False) gets a wrong dX without any
   error. On CPU the backward all-gathers along the last axis.
4. `ParallelEnv._device_id` defaults to 0: a CPU-only build never sets it
   (parallel.py:756-764), and PipelineLayer reads it (pp_layers.py:453).
5. `broadcast_input_data` (hybrid_parallel_util.py:205-213, used by
   fleet.distributed_model with mp>1) asserts a gpu/xpu/custom device; on CPU
   it broadcasts with the CPU place.
6. `new_group` with gloo: a fresh TCPStore per group (collective.py:261 hands
   every group the default store, and gloo's second connect uses unprefixed
   keys, so 4-process `fleet.init` often read a stale peer address and hung).
7. Pipeline p2p over gloo (pp > 2): each neighbour pair gets its own 2-rank
   group (topology.py:564, p2p_communication.py:62-207,272-299,540): gloo tags
   ops with a per-group counter, so a relay 0->1->2 on one group never matches.
8. Batched p2p over gloo: ops are run in a deadlock-free order (by neighbour
   pair; in a pair the lower rank sends first) (p2p_communication.py:357-386):
   gloo runs a batch one blocking op at a time.
9. Group-sharded stages 2/3 on CPU: accept device "cpu" in the accelerator
   assertions (sharding/group_sharded.py:125-128,
   group_sharded_optimizer_stage2.py:86-90, group_sharded_stage3.py:123-127),
   device id 0 for "cpu" (group_sharded_optimizer_stage2.py:238,
   group_sharded_utils.py:163), no accelerator copy of the clip norm when the
   run itself is on CPU (group_sharded_utils.py:165-173), and no
   CPU->accelerator copy in ParamStorage (group_sharded_storage.py:161,194-196:
   on CPU `param.cpu()` *is* `param`, which is then cleared).
10. Fused communication buffers (stage-1 sharding tensor_fusion, split_param,
   comm_overlap): device type "cpu" with GPU's alignment
   (fleet/utils/tensor_fusion_helper.py:64-78 asserts gpu/npu/xpu).
11. Recompute inside PipelineLayer (`recompute_hybrid`, recompute_hybrid.py:135-141)
   asserts a gpu/xpu/custom device although the RNG states it saves are the CPU
   generator's on CPU (plain `recompute` accepts "cpu", recompute.py:412-417).
12. `all_to_all` over gloo (segment parallelism's head/sequence switch, MoE dispatch): ProcessGroupGloo
   leaves it unimplemented ("ProcessGroupGLOO does not support all_to_all with sync_op flag",
   phi/core/distributed/collective/process_group.h:175, reached from
   communication/stream/all_to_all.py:43-47,70-74,275-279); filled in with one all_gather of every rank's
   inputs, each rank keeping the chunks addressed to it (world-size times the traffic). Uneven splits
   (alltoall_single's in/out_split_sizes: the MoE dispatch) are padded to the largest chunk first.

Not covered (not used by the toolkit): fp16 collectives over gloo (fp16
all_reduce returns inf), mp_async_allreduce /
InnerOverlapLinear, ParallelMultiLabelCrossEntropy, offload in group sharding.
Stage-1 `split_param` (DygraphShardingOptimizerV2) runs after patch 10 but
diverges from a single process from the second step on, for a reason that is
not CPU-specific: `clear_grad()` calls `clear_gradient(set_to_zero=True)`,
which marks the gradient "fake empty", so the next backward replaces
`param.grad` instead of accumulating into its view of the fused buffer
(eager_method.cc tensor_clear_gradient, accumulation_node.cc CopyOrAddTensor).
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import socket
import textwrap
import warnings

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer
from paddle.base import core

PADDLE_VERSION = "3.3.1"


def apply_cpu_compat() -> None:
    """Apply all patches (once per process). Safe in a plain single process."""
    from paddle.distributed.fleet.layers.mpu import mp_ops

    if isinstance(mp_ops._C_ops, _MpOpsCpuKernels):  # already applied (even by a reloaded copy of this module)
        return
    if paddle.__version__ != PADDLE_VERSION:
        warnings.warn(
            f"llm_pretrain.cpu.compat patches Paddle {PADDLE_VERSION} internals; this is Paddle {paddle.__version__}"
        )
    _patch_gloo_process_group()
    _patch_mp_ops()
    _patch_parallel_env()
    _patch_broadcast_input_data()
    _patch_gloo_group_store()
    _patch_pipeline_pair_groups()
    _patch_batched_p2p_order()
    _patch_group_sharded()
    _patch_tensor_fusion_device()
    _patch_recompute_hybrid_device()


# --------------------------------------------------------------------------- helpers


def _is_cpu(tensor) -> bool:
    return isinstance(tensor, paddle.Tensor) and tensor.place.is_cpu_place()


def _is_gloo(group) -> bool:
    return group is not None and isinstance(group.process_group, core.ProcessGroupGloo)


def _group_of(ring_id):
    from paddle.distributed import collective

    return collective._get_group_map()[ring_id]


def _all_gather_last_axis(x, group):
    parts = []
    dist.all_gather(parts, x, group=group)
    return paddle.concat(parts, axis=-1)


def _edit_source(func, *replacements: tuple[str, str]) -> None:
    """Recompile `func` in place with each (old, new) text replacement applied to its source.

    Used only where the failing statement sits in the middle of a long upstream
    function (an assertion or a device-string parse), so the rest of the
    function stays Paddle's own code. Swapping `__code__` also patches
    references imported before apply_cpu_compat(), keeps decorators, defaults
    and the `super()` cell, and tracebacks keep Paddle's file and line numbers.
    Fails loudly if an `old` text is not found exactly once (another Paddle).
    """
    target = inspect.unwrap(func)
    lines, first_line = inspect.getsourcelines(target)
    source = textwrap.dedent("".join(lines))
    for old, new in replacements:
        if source.count(old) != 1:
            raise RuntimeError(
                f"cpu_compat: unexpected source of {target.__qualname__} (Paddle {paddle.__version__}): {old!r}"
            )
        source = source.replace(old, new)
    offset = first_line - 1
    if "." in target.__qualname__:  # a method: compile inside a class of the same name, so that
        # `__private` names mangle as upstream and zero-argument super() gets its __class__ cell
        source = f"class {target.__qualname__.split('.')[-2]}:\n" + textwrap.indent(source, "    ")
        offset -= 1
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == target.__name__:
            node.decorator_list = []  # the decorated wrapper stays the original object
    ast.increment_lineno(tree, offset)
    module_code = compile(tree, inspect.getsourcefile(target), "exec")

    def find(code):
        for const in code.co_consts:
            if isinstance(const, type(code)):
                if const.co_name == target.__name__:
                    return const
                found = find(const)
                if found is not None:
                    return found
        return None

    code = find(module_code)
    if code.co_freevars != target.__code__.co_freevars:
        raise RuntimeError(f"cpu_compat: cannot recompile {target.__qualname__}: closure differs")
    target.__code__ = code


# --------------------------------------------------------------------------- 1. gloo process group


@paddle.no_grad()
def _reduce_scatter(pg, out, inputs, op):
    # All-reduce a copy of the whole input, keep this rank's chunk: the same
    # result as reduce_scatter, at n times the traffic.
    if isinstance(inputs, (list, tuple)):
        full = paddle.concat([t.reshape([-1]) for t in inputs])
    else:
        full = inputs.reshape([-1]).clone()
    task = pg.all_reduce(full, op, True)
    chunk = full.reshape([pg.size(), -1])[pg.rank()]
    paddle.assign(chunk.reshape(out.shape), output=out)
    return task


@paddle.no_grad()
def _all_to_all(pg, out_list, in_list):
    # Every rank's inputs gathered on every rank ([ranks, ranks x chunk]); rank r keeps chunk r of
    # each sender. Equal chunks only (as gloo's all_gather needs equal sizes).
    ranks, rank = pg.size(), pg.rank()
    sizes = {t._numel() for t in list(in_list) + list(out_list)}
    if len(sizes) != 1 or len(in_list) != ranks or len(out_list) != ranks:
        raise NotImplementedError("cpu_compat: all_to_all over gloo needs one equal-sized chunk per rank")
    flat = paddle.concat([t.reshape([-1]) for t in in_list])
    gathered = paddle.empty([ranks * flat.shape[0]], dtype=flat.dtype)
    task = pg.all_gather(gathered, flat, True)
    rows = gathered.reshape([ranks, ranks, -1])  # [sender, receiver, chunk]
    for sender, out in enumerate(out_list):
        paddle.assign(rows[sender, rank].reshape(out.shape), output=out)
    return task


def _all_to_all_tensor(pg, out, x, out_sizes=(), in_sizes=()):
    # all_to_all of one tensor, split equally along axis 0 (stream/all_to_all.py:43,47,275,279)
    ranks = pg.size()
    # Split sizes given: the uneven path on every rank, even where this rank's sizes happen to be equal
    # (a rank choosing by its own sizes skipped the sizes' all_gather its peers ran: a MoE dispatch under a
    # capacity factor hung in gloo, "op.preamble.length <= op.nbytes").
    if out_sizes or in_sizes:
        return _all_to_all_uneven(pg, out, x, list(out_sizes), list(in_sizes))
    parts = [paddle.empty_like(part) for part in paddle.split(out, ranks, axis=0)]
    task = _all_to_all(pg, parts, list(paddle.split(x, ranks, axis=0)))
    paddle.assign(paddle.concat(parts, axis=0), output=out)
    return task


@paddle.no_grad()
def _all_to_all_uneven(pg, out, x, out_sizes, in_sizes):
    # Uneven splits along axis 0 (MoE dispatch, alltoall_single's in/out_split_sizes): every chunk is
    # padded to the largest chunk any rank sends (one all_gather of the sizes), exchanged as equal
    # chunks, and the padding dropped.
    ranks = pg.size()
    sizes = paddle.to_tensor([max(in_sizes + out_sizes)], dtype="int64")
    every = paddle.empty([ranks], dtype="int64")
    pg.all_gather(every, sizes, True).wait()
    rows = max(int(every.max()), 1)
    tail = list(x.shape[1:])
    padded_in = paddle.zeros([ranks * rows] + tail, dtype=x.dtype)
    start = 0
    for r, n in enumerate(in_sizes):
        if n:
            padded_in[r * rows:r * rows + n] = x[start:start + n]
        start += n
    padded_out = paddle.empty([ranks * rows] + tail, dtype=x.dtype)
    task = _all_to_all_tensor(pg, padded_out, padded_in)
    kept = [padded_out[r * rows:r * rows + n] for r, n in enumerate(out_sizes) if n]
    if kept:
        paddle.assign(paddle.concat(kept), output=out)
    return task


def _part(tensor, num, index):
    """Part `index` of `num` equal parts of the flattened tensor: a view of its memory."""
    size = tensor._numel() // num
    return tensor.reshape([-1])._slice(index * size, (index + 1) * size)


def _patch_gloo_process_group():
    # ProcessGroupGloo raises "does not support ... use_calc_stream" for every
    # *_on_calc_stream method (phi/core/distributed/collective/process_group.h),
    # and "Unimplemented" for reduce_scatter. Gloo ops are synchronous, so the
    # calc-stream semantics (ordered with compute) hold for the sync_op=True call.
    # Patching the gloo class only leaves NCCL/XCCL/BKCL process groups untouched.
    sum_op = core.ReduceOp.SUM
    methods = {
        "all_reduce_on_calc_stream": lambda pg, t, op=sum_op: pg.all_reduce(t, op, True),
        "all_gather_on_calc_stream": lambda pg, out, x: pg.all_gather(out, x, True),
        "all_gather_into_tensor_on_calc_stream": lambda pg, out, x: pg.all_gather_into_tensor(out, x, True),
        "broadcast_on_calc_stream": lambda pg, t, src: pg.broadcast(t, src, True),
        "reduce_on_calc_stream": lambda pg, t, dst, op: pg.reduce(t, dst, op, True),
        "scatter_on_calc_stream": lambda pg, out, x, src: pg.scatter(out, x, src, True),
        "scatter_tensor_on_calc_stream": lambda pg, out, x, src: pg.scatter_tensor(out, x, src, True),
        "send_on_calc_stream": lambda pg, t, dst: pg.send(t, dst, True),
        "recv_on_calc_stream": lambda pg, t, src: pg.recv(t, src, True),
        # partial p2p (pipeline with mp > 1): gloo's send/recv_partial are unimplemented and its
        # all_gather_partial passes the whole tensor as the input (size check fails): use views
        "send_partial_on_calc_stream": lambda pg, t, dst, num, id: pg.send(_part(t, num, id), dst, True),
        "recv_partial_on_calc_stream": lambda pg, t, src, num, id: pg.recv(_part(t, num, id), src, True),
        "all_gather_partial": lambda pg, out, x, num, id: pg.all_gather(out.reshape([-1]), _part(x, num, id), True),
        "all_gather_partial_on_calc_stream": lambda pg, out, x, num, id: pg.all_gather(
            out.reshape([-1]), _part(x, num, id), True
        ),
        "reduce_scatter": lambda pg, out, xs, op, sync_op=True: _reduce_scatter(pg, out, xs, op),
        "reduce_scatter_on_calc_stream": lambda pg, out, xs, op: _reduce_scatter(pg, out, xs, op),
        "reduce_scatter_tensor": lambda pg, out, x, op, sync_op=True: _reduce_scatter(pg, out, x, op),
        "reduce_scatter_tensor_on_calc_stream": lambda pg, out, x, op: _reduce_scatter(pg, out, x, op),
        "all_to_all": lambda pg, outs, xs, sync_op=True: _all_to_all(pg, outs, xs),
        "all_to_all_on_calc_stream": lambda pg, outs, xs: _all_to_all(pg, outs, xs),
        "all_to_all_tensor": lambda pg, out, x, sync_op=True: _all_to_all_tensor(pg, out, x),
        "all_to_all_tensor_on_calc_stream": lambda pg, out, x: _all_to_all_tensor(pg, out, x),
        "all_to_all_single": lambda pg, out, x, out_sizes, in_sizes, sync_op=True: _all_to_all_tensor(
            pg, out, x, out_sizes, in_sizes),
        "all_to_all_single_on_calc_stream": lambda pg, out, x, out_sizes, in_sizes: _all_to_all_tensor(
            pg, out, x, out_sizes, in_sizes),
    }
    for name, method in methods.items():
        setattr(core.ProcessGroupGloo, name, method)


# --------------------------------------------------------------------------- 2-3. model-parallel ops


class _CIdentity(PyLayer):
    """c_identity: a copy forward; the gradient all-reduced (sum) over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return paddle.assign(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()
        dist.all_reduce(dy, group=ctx.group)
        return dy


class _CSplit(PyLayer):
    """c_split: this rank's chunk of the last axis; the gradient all-gathered along it."""

    @staticmethod
    def forward(ctx, x, group, rank, nranks):
        ctx.group = group
        return paddle.split(x, nranks, axis=-1)[rank].clone()

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_last_axis(dy, ctx.group)


class _CConcat(PyLayer):
    """c_concat: all-gather along the last axis; the gradient is this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group, rank, nranks):
        ctx.rank, ctx.nranks = rank, nranks
        return _all_gather_last_axis(x, group)

    @staticmethod
    def backward(ctx, dy):
        return paddle.split(dy, ctx.nranks, axis=-1)[ctx.rank].clone()


class _CSoftmaxWithCrossEntropy(PyLayer):
    """Softmax cross entropy over logits split along the vocabulary (last) axis.

    Same outputs as the GPU kernel: (softmax of the local shard, loss of shape
    label.shape), loss and gradient 0 where label == ignore_index.
    """

    @staticmethod
    def forward(ctx, logits, label, ignore_index, group, rank, nranks):
        vocab = logits.shape[-1]
        logits_max = logits.max(axis=-1, keepdim=True)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max
        exp = paddle.exp(shifted)
        sum_exp = exp.sum(axis=-1, keepdim=True)
        dist.all_reduce(sum_exp, group=group)
        local_label = label - rank * vocab
        in_shard = (local_label >= 0) & (local_label < vocab)
        index = paddle.where(in_shard, local_label, paddle.zeros_like(local_label))
        target = paddle.take_along_axis(shifted, index, axis=-1)
        target = paddle.where(in_shard, target, paddle.zeros_like(target))
        dist.all_reduce(target, group=group)
        keep = (label != ignore_index).astype(logits.dtype)
        loss = (paddle.log(sum_exp) - target) * keep
        softmax = exp / sum_exp
        ctx.save_for_backward(softmax, index, in_shard.astype(logits.dtype) * keep, keep)
        ctx.mark_non_differentiable(softmax)
        return softmax, loss

    @staticmethod
    def backward(ctx, dsoftmax, dloss):
        softmax, index, target_weight, keep = ctx.saved_tensor()
        one_hot = paddle.nn.functional.one_hot(index.squeeze(-1), softmax.shape[-1])
        dlogits = (softmax * keep - one_hot * target_weight) * dloss
        return dlogits, None


class _MpOpsCpuKernels:
    """`_C_ops` as seen by mp_ops: CPU versions of the four c_* ops, the rest forwarded."""

    def __init__(self, c_ops):
        self._c_ops = c_ops

    def __getattr__(self, name):
        return getattr(self._c_ops, name)

    def c_identity(self, x, ring_id, use_calc_stream, use_model_parallel):
        if not _is_cpu(x):
            return self._c_ops.c_identity(x, ring_id, use_calc_stream, use_model_parallel)
        return _CIdentity.apply(x, _group_of(ring_id))

    def c_split(self, x, rank, nranks, ring_id, use_model_parallel):
        if not _is_cpu(x):
            return self._c_ops.c_split(x, rank, nranks, ring_id, use_model_parallel)
        return _CSplit.apply(x, _group_of(ring_id), rank, nranks)

    def c_concat(self, x, rank, nranks, ring_id, use_calc_stream, use_model_parallel):
        if not _is_cpu(x):
            return self._c_ops.c_concat(x, rank, nranks, ring_id, use_calc_stream, use_model_parallel)
        return _CConcat.apply(x, _group_of(ring_id), rank, nranks)

    def c_softmax_with_cross_entropy(self, logits, label, ignore_index, ring_id, rank, nranks):
        if not _is_cpu(logits):
            return self._c_ops.c_softmax_with_cross_entropy(logits, label, ignore_index, ring_id, rank, nranks)
        return _CSoftmaxWithCrossEntropy.apply(logits, label, ignore_index, _group_of(ring_id), rank, nranks)


def _patch_mp_ops():
    from paddle.distributed.fleet.layers.mpu import mp_ops

    # mp_ops.py:49,63,147,260,429 call _C_ops.c_identity/c_split/c_concat/
    # c_softmax_with_cross_entropy, which have no CPU kernel. Only mp_ops'
    # module-level `_C_ops` name is replaced, and each op delegates to the real
    # kernel for a non-CPU tensor.
    mp_ops._C_ops = _MpOpsCpuKernels(mp_ops._C_ops)

    # mp_ops.py:65-75: c_split_eager.forward splits the LAST axis, but its
    # backward all-gathers the gradient into axis 0 (shape [n*d0, ..., dk/n]
    # instead of [d0, ..., dk]); RowParallelLinear(input_is_parallel=False)
    # then gets a wrong dX silently. Fixed on CPU only (GPU not verified here):
    # the gradient of a last-axis split is the last-axis all-gather.
    upstream_backward = mp_ops.c_split_eager.backward

    @functools.wraps(upstream_backward)
    def backward(ctx, dy):
        if not _is_cpu(dy):
            return upstream_backward(ctx, dy)
        return _all_gather_last_axis(dy, ctx.group)

    mp_ops.c_split_eager.backward = staticmethod(backward)


# --------------------------------------------------------------------------- 4-5. device id, input broadcast


def _patch_parallel_env():
    # parallel.py:756-764 sets _device_id only for custom devices and CUDA/XPU
    # builds; PipelineLayer reads ParallelEnv().device_id (pp_layers.py:453) and
    # fails with AttributeError on a CPU-only build. A class-level default of 0
    # applies only where __init__ set nothing, i.e. never on an accelerator build.
    from paddle.distributed.parallel import ParallelEnv

    if not hasattr(ParallelEnv, "_device_id"):
        ParallelEnv._device_id = 0


def _patch_broadcast_input_data():
    # hybrid_parallel_util.py:205-213 asserts a gpu/xpu/custom device and parses
    # "gpu:N"; TensorParallel._pre_forward (tensor_parallel.py:66) calls it for
    # every forward with mp>1. On CPU: the same broadcast, with the CPU place.
    from paddle.distributed.fleet.meta_parallel import tensor_parallel
    from paddle.distributed.fleet.utils import hybrid_parallel_util as hpu

    upstream = hpu.broadcast_input_data

    @functools.wraps(upstream)
    def broadcast_input_data(hcg, *inputs, **kwargs):
        if paddle.get_device() != "cpu":
            return upstream(hcg, *inputs, **kwargs)
        place = paddle.CPUPlace()
        if len(inputs) > 0:
            inputs = hpu._broadcast_nested_data(hcg, "cpu", place, inputs)
        if len(kwargs) > 0:
            kwargs = hpu._broadcast_nested_data(hcg, "cpu", place, kwargs)
        return inputs, kwargs

    hpu.broadcast_input_data = broadcast_input_data
    tensor_parallel.broadcast_input_data = broadcast_input_data


# --------------------------------------------------------------------------- 6. one store per gloo group

_group_stores = []  # the stores must outlive their process groups


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _patch_gloo_group_store():
    # collective.py:261 creates every new group's ProcessGroupGloo on the shared
    # default TCPStore; its connect step uses unprefixed keys ("0", "1", ...),
    # so with many groups (4-process fleet.init) a rank can read a peer address
    # left by an earlier group ("Connection refused" / pair timeout). Each new
    # gloo group gets its own TCPStore: group rank 0 serves it on a free port
    # published under a group-specific key of the default store. The default
    # group (parallel.py:1172 holds its own reference) is unchanged.
    from paddle.distributed import collective

    upstream = collective._new_process_group_impl

    @functools.wraps(upstream)
    def _new_process_group_impl(backend, store, rank, world_size, group_name, pg_options, group_id=0, **kwargs):
        if backend == "gloo" and group_id != 0:
            key = f"cpu_compat/gloo_store/{group_id}"
            if rank == 0:
                host = os.environ.get("PADDLE_CURRENT_ENDPOINT", "127.0.0.1:0").rsplit(":", 1)[0]
                port = _free_port()
                store.set(key, f"{host}:{port}")
                group_store = core.TCPStore(host, port, True, world_size)
            else:
                store.wait(key)
                host, port = store.get(key).decode().rsplit(":", 1)
                group_store = core.TCPStore(host, int(port), False, world_size)
            _group_stores.append(group_store)
            store = group_store
        return upstream(backend, store, rank, world_size, group_name, pg_options, group_id, **kwargs)

    collective._new_process_group_impl = _new_process_group_impl


# --------------------------------------------------------------------------- 7-8. pipeline p2p

_pipe_pair_groups = {}  # frozenset({rank, neighbour}) -> 2-rank group


def _pair_group(group, peer):
    if group is None or group.nranks <= 2:
        return group
    return _pipe_pair_groups.get(frozenset((dist.get_rank(), peer)), group)


def _patch_pipeline_pair_groups():
    from paddle.distributed.fleet.base.topology import HybridCommunicateGroup
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    # topology.py:564: the pipeline sends/receives on the whole pipe group.
    # Gloo tags each op with a per-group sequence number, so with pp > 2 a relay
    # (0 sends to 1 while 1 sends to 2) never matches and hangs. With gloo and
    # pp > 2, every rank also creates one 2-rank group per neighbour pair of
    # every pipeline (same order everywhere: new_group must be called
    # collectively), and p2p goes through the pair group.
    upstream_set_p2p = HybridCommunicateGroup._set_p2p_prev_next

    @functools.wraps(upstream_set_p2p)
    def _set_p2p_prev_next(self):
        upstream_set_p2p(self)
        if self._pp_degree > 2 and _is_gloo(self.get_pipe_parallel_group()):
            for ranks in self._topo.get_comm_list("pipe"):
                for i, rank in enumerate(ranks):
                    pair = sorted((rank, ranks[(i + 1) % len(ranks)]))
                    group = dist.new_group(pair)
                    if self.global_rank in pair:
                        _pipe_pair_groups[frozenset(pair)] = group

    HybridCommunicateGroup._set_p2p_prev_next = _set_p2p_prev_next

    # p2p_communication.py:272-299 (batched p2p), :540 (unbatched p2p) and
    # :62-207 (shape/dtype metadata) all take the pipe group; route to the pair.
    upstream_send, upstream_recv = p2p._send_on_calc_stream, p2p._recv_on_calc_stream

    @functools.wraps(upstream_send)
    def _send_on_calc_stream(tensor, group, dst, nranks=1, rank_id=0):
        return upstream_send(tensor, _pair_group(group, dst), dst, nranks, rank_id)

    @functools.wraps(upstream_recv)
    def _recv_on_calc_stream(tensor, group, src, nranks=1, rank_id=0):
        return upstream_recv(tensor, _pair_group(group, src), src, nranks, rank_id)

    p2p._send_on_calc_stream = _send_on_calc_stream
    p2p._recv_on_calc_stream = _recv_on_calc_stream

    upstream_p2p_ops = p2p._p2p_ops_tuple_or_tensor

    @functools.wraps(upstream_p2p_ops)
    def _p2p_ops_tuple_or_tensor(tensors, p2p_func, pp_rank, pp_group):
        return upstream_p2p_ops(tensors, p2p_func, pp_rank, _pair_group(pp_group, pp_rank))

    p2p._p2p_ops_tuple_or_tensor = _p2p_ops_tuple_or_tensor

    upstream_send_meta, upstream_recv_meta = p2p.SendRecvMeta.send_meta, p2p.SendRecvMeta.recv_meta

    @functools.wraps(upstream_send_meta)
    def send_meta(self, tensor, group, reverse=False, broadcast=False):
        if not broadcast:
            peer = p2p._hcg._get_p2p_prev_rank() if reverse else p2p._hcg._get_p2p_next_rank()
            group = _pair_group(group, peer)
        return upstream_send_meta(self, tensor, group, reverse=reverse, broadcast=broadcast)

    @functools.wraps(upstream_recv_meta)
    def recv_meta(self, group, reverse=False, broadcast=False):
        if not broadcast:
            peer = p2p._hcg._get_p2p_next_rank() if reverse else p2p._hcg._get_p2p_prev_rank()
            group = _pair_group(group, peer)
        return upstream_recv_meta(self, group, reverse=reverse, broadcast=broadcast)

    p2p.SendRecvMeta.send_meta = send_meta
    p2p.SendRecvMeta.recv_meta = recv_meta


def _patch_batched_p2p_order():
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    # p2p_communication.py:357-386 runs a batch in list order (send_prev,
    # recv_prev, send_next, recv_next). NCCL groups the batch; gloo runs one
    # blocking op at a time, so around a ring (interleaved schedule) every rank
    # waits in recv_prev: deadlock. On gloo the ops are ordered by neighbour
    # pair (a global order, so the lowest unfinished pair can always proceed)
    # and, within a pair, the lower rank sends first and the higher receives first.
    upstream_batch = p2p.batch_send_recv_on_calc_stream

    @functools.wraps(upstream_batch)
    def batch_send_recv_on_calc_stream(p2p_op_list):
        if p2p_op_list and _is_gloo(p2p_op_list[0].group):
            me = dist.get_rank()

            def order(op):
                sends = op.op is p2p._send_on_calc_stream
                return (min(me, op.peer), max(me, op.peer), sends != (me < op.peer))

            p2p_op_list = sorted(p2p_op_list, key=order)
        return upstream_batch(p2p_op_list)

    p2p.batch_send_recv_on_calc_stream = batch_send_recv_on_calc_stream


# --------------------------------------------------------------------------- 9. group-sharded stages 2 and 3


def _patch_group_sharded():
    from paddle.distributed.fleet.meta_parallel.sharding import (
        group_sharded_optimizer_stage2 as stage2_opt,
        group_sharded_stage3 as stage3,
        group_sharded_storage as storage,
        group_sharded_utils as utils,
    )
    from paddle.distributed.sharding import group_sharded

    # The wrappers work on CPU processes over gloo (reduce/broadcast/all_gather/
    # all_reduce only); what fails is a device assertion or a "gpu:N" parse.
    # Each edit adds a `device == "cpu"` case and leaves the accelerator path as is.

    # group_sharded.py:125-128: assert device in gpu/xpu/custom.
    _edit_source(
        group_sharded.group_sharded_parallel,
        (
            '), "group_sharded_parallel only support gpu, xpu and custom_device now"',
            ') or device == "cpu", "group_sharded_parallel only support gpu, xpu and custom_device now"',
        ),
    )
    # group_sharded_optimizer_stage2.py:86-90: assert is_compiled_with_cuda/xpu/custom;
    # :238: int("cpu".split(":")[1]) -> IndexError (dev_id is only used by offload).
    _edit_source(
        stage2_opt.GroupShardedOptimizerStage2.__init__,
        (
            '), "Only GPU and XPU and CustomDevice is supported now"',
            ') or device == "cpu", "Only GPU and XPU and CustomDevice is supported now"',
        ),
        (
            'self.dev_id = int(paddle.get_device().split(":")[1])',
            'self.dev_id = 0 if device == "cpu" else int(paddle.get_device().split(":")[1])',
        ),
    )
    # group_sharded_stage3.py:123-127: assert is_compiled_with_cuda/xpu/custom.
    _edit_source(
        stage3.GroupShardedStage3.__init__,
        (
            '), "Only support CUDA / XPU / CustomDevice."',
            ') or device == "cpu", "Only support CUDA / XPU / CustomDevice."',
        ),
    )
    # group_sharded_utils.py:163-173 (ClipGradByGlobalNorm under stage 2/3):
    # parses "gpu:N" from the device, and when the current device is "cpu"
    # (meant: offload) copies the partial norm to the accelerator with .cuda().
    # When the whole run is on CPU (device "cpu"), the norm already is where the
    # gloo all-reduce runs.
    _edit_source(
        utils.GroupShardedClipGrad._dygraph_clip,
        (
            'dev_id = int(self._device.split(":")[1])',
            'dev_id = 0 if self._device == "cpu" else int(self._device.split(":")[1])',
        ),
        (
            'if paddle.device.get_device() == "cpu":',
            'if paddle.device.get_device() == "cpu" and self._device != "cpu":',
        ),
    )

    # group_sharded_storage.py:194-196 copies each parameter into the CPU-side
    # buffer via `param.cpu()` then clears `param`; on CPU `param.cpu()` is
    # `param` itself, so the copy reads a cleared tensor ("Tensor not
    # initialized"), and :161 then calls cvt_to_device, which raises on a
    # CPU-only build. Upstream's convert_gpu=False path (used for offload
    # buffers, which live on CPU) is exactly the CPU case: copy, no device move.
    upstream_add = storage.ParamStorage.add_rank_params

    @functools.wraps(upstream_add)
    def add_rank_params(self, trainable_params, param2align, convert_gpu=True):
        if self._device == "cpu":
            convert_gpu = False
        return upstream_add(self, trainable_params, param2align, convert_gpu)

    storage.ParamStorage.add_rank_params = add_rank_params


# --------------------------------------------------------------------------- 10. fused comm buffers


def _patch_tensor_fusion_device():
    from paddle.distributed.fleet.utils import tensor_fusion_helper as fusion

    # tensor_fusion_helper.py:64-78 (stage-1 sharding with tensor_fusion,
    # split_param or comm_overlap; pp/dp comm overlap): the buffer-alignment
    # table has no "cpu" entry and a CPU place reports device type "unknown", so
    # it asserts. On CPU the device is "cpu" with the accelerators' 256-byte
    # alignment, so fused buffers (and split_param shards) have the GPU layout;
    # their storages then take the CPU path of patch 9.
    fusion.alignment.setdefault("cpu", fusion.alignment["gpu"])
    upstream = fusion.get_current_device_type

    @functools.wraps(upstream)
    def get_current_device_type():
        return "cpu" if paddle.get_device() == "cpu" else upstream()

    fusion.get_current_device_type = get_current_device_type


# --------------------------------------------------------------------------- 11. recompute in a pipeline


def _patch_recompute_hybrid_device():
    import importlib

    recompute_hybrid = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")

    _edit_source(
        recompute_hybrid._HPRecomputeFunction.forward,
        ('), f"Recompute with RNG is not support', ') or cur_device == "cpu", f"Recompute with RNG is not support'),
    )
