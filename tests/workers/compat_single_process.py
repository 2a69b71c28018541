"""Plain single process (no launcher): apply_cpu_compat() must change nothing observable.

Runs a small training step, a cross entropy and a PipelineLayer-free forward
before and after apply_cpu_compat() (called twice), and checks that the patched
points stay out of the way: global _C_ops untouched, only the gloo process-group
class patched, the mp_ops kernels delegate for anything that is not a CPU
tensor. Prints one JSON object.
"""

import json

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.base import core

paddle.set_device("cpu")
upstream_c_ops_identity = paddle._C_ops.c_identity
upstream_base_all_reduce = core.ProcessGroup.all_reduce_on_calc_stream


def workload():
    paddle.seed(3)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Tanh(), paddle.nn.Linear(16, 5))
    clip = paddle.nn.ClipGradByGlobalNorm(clip_norm=0.1)
    optimizer = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters(), grad_clip=clip)
    x = paddle.to_tensor(np.random.RandomState(0).randn(4, 8).astype("float32"))
    labels = paddle.to_tensor(np.array([[0], [1], [4], [2]], dtype="int64"))
    losses = []
    for _ in range(3):
        loss = paddle.nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    return losses, [p.numpy().tolist() for p in model.parameters()]


before = workload()

from llm_pretrain.cpu.compat import _MpOpsCpuKernels, apply_cpu_compat  # noqa: E402

apply_cpu_compat()
apply_cpu_compat()  # idempotent
after = workload()

from paddle.distributed import ParallelEnv  # noqa: E402
from paddle.distributed.fleet.layers.mpu import mp_ops  # noqa: E402


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name) or name


recorder = _Recorder()
kernels = _MpOpsCpuKernels(recorder)
not_a_cpu_tensor = object()  # e.g. a static-graph Value, or (on GPU) a GPU tensor
kernels.c_identity(not_a_cpu_tensor, 0, True, True)
kernels.c_split(not_a_cpu_tensor, 0, 2, 0, True)
kernels.c_concat(not_a_cpu_tensor, 0, 2, 0, True, True)
kernels.c_softmax_with_cross_entropy(not_a_cpu_tensor, None, -100, 0, 0, 2)

print(
    json.dumps(
        {
            "same_results": before == after,
            "world_size": dist.get_world_size(),
            "initialized": dist.is_initialized(),
            "device_id": ParallelEnv().device_id,
            "global_c_ops_untouched": paddle._C_ops.c_identity is upstream_c_ops_identity,
            "mp_ops_patched": isinstance(mp_ops._C_ops, _MpOpsCpuKernels),
            "mp_ops_not_double_wrapped": not isinstance(mp_ops._C_ops._c_ops, _MpOpsCpuKernels),
            "base_process_group_untouched": core.ProcessGroup.all_reduce_on_calc_stream is upstream_base_all_reduce,
            "gloo_patched": "all_reduce_on_calc_stream" in vars(core.ProcessGroupGloo),
            "delegated": recorder.calls,
        }
    )
)
