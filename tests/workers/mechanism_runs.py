"""Run trainings through the real trainer with probes that watch the mechanisms at work.

    python -m paddle.distributed.launch --nproc_per_node 2 tests/workers/mechanism_runs.py runs.json

runs.json: [{"name": ..., "argv": [run_pretrain.py arguments]}, ...] (one parallel layout per launch); a run's
"env" ({name: value}) is set in this process for that run only (LLM_PRETRAIN_KERNEL_STANDINS: the GPU
kernels' branches through the CPU stand-ins, llm_pretrain/cpu/kernel_standins.py, whose calls each run
records as "kernel_calls").
Before the runs, this worker wraps (counting, then calling the original):

    DecoderLayer.forward / attention_block, Attention.core_attention
                       calls per decoder layer (recompute runs them again in backward) and the
                       shape of the hidden states entering each layer (1/tp of the tokens under SP)
    the SP all-reduce hooks fleet registers (sequence_parallel_utils): backward calls and
                       all-reduces per parameter
    CausalLM.forward and the optimizer's step
                       a fingerprint of one gradient before every micro-batch and at the step: data
                       parallelism must leave gradients local until the last micro-batch
    Attention.project_qkv (replicated kv heads, fewer kv heads than tensor-parallel ranks)
                       which kv head's columns of the whole v projection each rank's attention
                       takes, and which q heads it has: each rank must keep the head its q heads share
    models.parallel_layers._all_to_all
                       segment parallelism's all-to-all: calls from the PyLayer's forward and from
                       its backward, with the shapes going in
    models.moe: MoE.route, whole_sequence_stats, parallel_layers._SumOverGroup.backward
                       mixture of experts under sep/cp: the tokens each rank routes, and the tokens and
                       picks of the statistics its router losses are computed from (summed over the sep
                       group), and the backward calls of that sum (the aux loss's gradient flowing back)
    models.ring_attention.start_ring_pass
                       context parallelism's ring steps: calls from the ring attention's forward and
                       backward, with the shapes of the tensors passed
    fleet's PipelineParallel._forward_step / _backward_step (every pipeline schedule class runs each
                       micro-batch's forward and backward of each chunk through them)
                       the order of a rank's forwards and backwards in training, "F<chunk>" / "B<chunk>"
    run_record.describe_built_run
                       catches the built model and optimizer (inspected after the run: optimizer
                       state per rank, stage-3 slices, the classes of the projections) and resets the
                       allocator's peak, so that the peak after the run is that of training

A run spec with "fp32_master_grad": true keeps fleet's float32 master gradients (tests/workers/
fp32_master_grads.py); its observations add "master_grads" (parameters holding a main_grad afterwards).

Each rank writes {run name: observations} with launch_utils.write_result.
"""

import contextlib
import gc
import json
import os
import sys
from collections import defaultdict

from llm_pretrain.cpu.threads import apply_cpu_defaults  # imports no Paddle


def runs_device(runs_file: str) -> str | None:
    """The `device` of the first run (its --device, else its argument file's; None: Paddle's default)."""
    with open(runs_file) as f:
        argv = [str(a) for a in json.load(f)[0]["argv"]]
    if "--device" in argv:
        return argv[argv.index("--device") + 1]
    with open(argv[0]) as f:
        return json.load(f).get("device")


# run_pretrain sets its CPU defaults (llm_pretrain/cpu/threads.py: strided views off, threads) before
# Paddle loads; the probes import Paddle first, so they are set here, as run_pretrain would: the runs
# are the runs run_pretrain trains (the parity runs sharing these launches read them in their records).
if __name__ == "__main__":
    apply_cpu_defaults(runs_device(sys.argv[1]))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from llm_pretrain.run.run_control import exit_after_results  # noqa: E402
from llm_pretrain.selfcheck.parity import catch_crashes  # noqa: E402
from fp32_master_grads import fp32_master_grads  # noqa: E402
from paddle.base import core  # noqa: E402
from paddle.distributed.fleet.utils import sequence_parallel_utils  # noqa: E402

from llm_pretrain.cpu import kernel_standins  # noqa: E402
from llm_pretrain.observe import run_record  # noqa: E402
from llm_pretrain.run_pretrain import main  # noqa: E402
from llm_pretrain.selfcheck.parity_worker import run_environment  # noqa: E402
from models import parallel_layers, ring_attention  # noqa: E402
from models.decoder import Attention, CausalLM, DecoderLayer  # noqa: E402
from models.registry import parameter_count  # noqa: E402

probe: dict = {}


def reset_probe():
    probe.clear()
    probe.update(calls=defaultdict(list), shapes=defaultdict(set), hooks=defaultdict(lambda: [0, 0]),
                 grad_fingerprints=[], built=None, kv_heads={}, all_to_all=defaultdict(list),
                 ring=defaultdict(list), schedule_order=[], router=defaultdict(list))


def counting(owner, method):
    original = getattr(owner, method)

    def counted(self, *args, **kwargs):
        if self.training:
            probe["calls"][method].append(self.layer_index)
            if method == "forward" and owner is DecoderLayer:
                probe["shapes"][self.layer_index].add(tuple(args[0].shape))
        return original(self, *args, **kwargs)

    setattr(owner, method, counted)


def watch_sp_hooks():
    original = sequence_parallel_utils.create_non_fused_allreduce_gradient_hook

    def create(param, accumulation_steps):
        hook = original(param, accumulation_steps)

        def counted_hook():
            counts = probe["hooks"][param.name]
            counts[0] += 1
            counts[1] += counts[0] % accumulation_steps == 0  # the hook all-reduces on these calls
            return hook()

        return counted_hook

    sequence_parallel_utils.create_non_fused_allreduce_gradient_hook = create


def watch_kv_heads():
    """Per decoder layer (first training forward): the q heads this rank holds and the kv head whose
    columns of the whole v projection (all kv heads, computed on every rank) it attends with, found
    by comparing the values, not by reading Attention.kv_head."""
    from models.parallel_layers import tensor_parallel_rank_and_degree

    original = Attention.project_qkv

    def project_qkv(self, hidden, positions=None):  # positions: restarting per packed document
        if not (self.training and getattr(self, "replicated_kv", False)) or self.layer_index in probe["kv_heads"]:
            return original(self, hidden, positions)
        whole = []
        handle = self.v_proj.register_forward_post_hook(lambda layer, inputs, output: whole.append(output))
        try:
            q, k, v = original(self, hidden, positions)
        finally:
            handle.remove()
        d, kv_heads = self.config.head_dim, self.config.num_key_value_heads
        every_head = whole[0].numpy().reshape([-1, v.shape[1], kv_heads, d])
        used = [j for j in range(kv_heads) if np.array_equal(every_head[:, :, j], v.numpy()[:, :, 0])]
        rank, _ = tensor_parallel_rank_and_degree(self.config)
        probe["kv_heads"][self.layer_index] = {"q_heads": [rank * self.num_heads, (rank + 1) * self.num_heads - 1],
                                               "kv_heads_used": used, "tp_rank": rank}
        return q, k, v

    Attention.project_qkv = project_qkv


def watch_all_to_all():
    original = parallel_layers._all_to_all

    def counted(x, group, split_axis, concat_axis):
        caller = sys._getframe(1).f_code.co_name  # "forward" or "backward" of the PyLayer
        probe["all_to_all"][caller].append([list(x.shape), split_axis, concat_axis])
        return original(x, group, split_axis, concat_axis)

    parallel_layers._all_to_all = counted


def watch_ring():
    original = ring_attention.start_ring_pass

    def counted(tensors, group):
        caller = sys._getframe(1).f_code.co_name  # "forward" or "backward" of RingAttention
        probe["ring"][caller].append([list(t.shape) for t in tensors])
        return original(tensors, group)

    ring_attention.start_ring_pass = counted


def watch_router():
    from models import moe

    route, combine, backward = moe.MoE.route, moe.whole_sequence_stats, parallel_layers._SumOverGroup.backward

    def routed(self, x):
        if self.training:
            probe["router"]["routed_tokens"].append(int(x.shape[0]))
        return route(self, x)

    def combined(config, stats):
        whole = combine(config, stats)
        probe["router"]["stats"].append([int(stats.tokens), int(whole.tokens), float(whole.picks.sum())])
        return whole

    def summed_backward(ctx, grad):
        probe["router"]["sum_backward"].append(list(grad.shape))
        return backward(ctx, grad)

    moe.MoE.route, moe.whole_sequence_stats = routed, combined
    parallel_layers._SumOverGroup.backward = staticmethod(summed_backward)


def watch_pipeline_schedule():
    """Record "F<chunk>" / "B<chunk>" for each training forward / backward step fleet's schedule runs on
    this rank (chunk: the virtual stage; 0 without interleaving). Evaluation (forward only) is left out."""
    import inspect

    from paddle.distributed.fleet.meta_parallel.pipeline_parallel import PipelineParallel

    for method, kind in (("_forward_step", "F"), ("_backward_step", "B")):
        original = getattr(PipelineParallel, method)
        signature = inspect.signature(original)

        def recorded(self, *args, _original=original, _kind=kind, _signature=signature, **kwargs):
            if not getattr(self, "_forward_only", False):
                chunk = _signature.bind(self, *args, **kwargs).arguments.get("chunk_id")
                probe["schedule_order"].append(f"{_kind}{chunk or 0}")
            return _original(self, *args, **kwargs)

        setattr(PipelineParallel, method, recorded)


def grad_fingerprint(model) -> float | None:
    """Sum of one decoder weight's gradient (None before the first backward of a step): the MLP's down
    projection, a mixture of experts' router (replicated on every rank, whatever the experts' layout)."""
    try:
        mlp = model.layers[0].mlp
        grad = (mlp.gate.weight if hasattr(mlp, "experts") else mlp.down_proj.weight).grad
        return None if grad is None else float(grad.astype("float64").sum())
    except Exception:  # noqa: BLE001 - stage 3 releases parameters and gradients between uses
        return None


def watch_data_parallel():
    original_forward = CausalLM.forward

    def forward(self, input_ids, labels=None, *documents):  # documents: [document_ids] with document masks
        if self.training:
            probe["grad_fingerprints"].append(("micro_batch", grad_fingerprint(self)))
        return original_forward(self, input_ids, labels, *documents)

    CausalLM.forward = forward


def catch_built_run():
    original = run_record.describe_built_run

    def describe(model, optimizer, precision=None, **options):
        probe["built"] = (model, optimizer)
        inner = run_record.unwrap_model(model)
        if isinstance(inner, CausalLM):
            original_step = optimizer.step

            def step(*args, **kwargs):
                probe["grad_fingerprints"].append(("step", grad_fingerprint(inner)))
                return original_step(*args, **kwargs)

            optimizer.step = step
        return original(model, optimizer, precision, **options)

    run_record.describe_built_run = describe


def optimizer_state_elements(optimizer) -> int:
    """Elements of Adam's moments held by this rank (the innermost optimizer's accumulators)."""
    inner = run_record.optimizer_chain(optimizer)[-1]
    total = 0
    for name, per_param in inner._accumulators.items():
        if "moment1" in name:
            total += sum(int(np.prod(t.shape)) for t in per_param.values())
    return total


def stage3_slices(model) -> list[dict]:
    """Parameters group sharding stage 3 manages: full size and the size of this rank's slice."""
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import GroupShardedStage3

    stage3 = next((m for m in run_record.model_chain(model) if isinstance(m, GroupShardedStage3)), None)
    if stage3 is None:
        return []
    out = []
    for param in stage3._layer.parameters():
        full = int(np.prod(param.shape))
        storage = getattr(param, "fw_storage", None)
        out.append({"name": param.name, "elements": full, "unslice": hasattr(param, "unslice"),
                    "slice_elements": int(np.prod(storage.shape)) if storage is not None else None})
    return out


def observations() -> dict:
    model, optimizer = probe["built"]
    inner = run_record.unwrap_model(model)
    return {
        "calls": {k: v for k, v in probe["calls"].items()},
        "decoder_input_shapes": {str(k): sorted(v) for k, v in probe["shapes"].items()},
        "sp_hooks": {k: list(v) for k, v in probe["hooks"].items()},
        "all_to_all": {k: v for k, v in probe["all_to_all"].items()},
        "ring": {k: v for k, v in probe["ring"].items()},
        "router": {k: v for k, v in probe["router"].items()},
        "schedule_order": probe["schedule_order"],
        "grad_fingerprints": probe["grad_fingerprints"],
        "optimizer_state_elements": optimizer_state_elements(optimizer),
        "model_parameters": parameter_count(inner.config),
        "parameter_elements": sum(int(np.prod(p.shape)) for p in inner.parameters()),
        "stage3": stage3_slices(model),
        "model_classes": run_record._class_names(run_record.model_chain(model)),
        # each projection name (q_proj, o_proj, the MLPs' and experts' gate/up/down_proj) with the classes built for
        # it: fleet's column / row parallel linears under tensor parallelism, nn.Linear without
        "projection_classes": sorted({(name.rsplit(".", 1)[-1], type(layer).__name__)
                                      for name, layer in inner.named_sublayers() if name.endswith("_proj")}),
        "optimizer_classes": run_record._class_names(run_record.optimizer_chain(optimizer)),
        "kv_heads": {str(k): v for k, v in probe["kv_heads"].items()},
        "peak_allocated": core.host_memory_stat_peak_value("Allocated", 0) - probe["allocated_before"],
    }


def perturbed_replica_run(run: dict) -> dict:
    """A run whose replica on one rank differs before the end-of-training replica check: that rank
    adds a last-bit change to its copy of one replicated parameter (run["perturb_replica"]:
    {"rank": r, "parameter": canonical name}). The check must stop the run naming both."""
    import paddle.distributed as dist

    from llm_pretrain.checkpoint import replica_check


    from llm_pretrain.run import trainer
    target = run["perturb_replica"]
    check = trainer.check_replicas

    def perturbing_check(model, optimizer, layout, step, **kwargs):
        if dist.get_rank() == target["rank"]:
            param = dict(model.canonical_named_parameters())[target["parameter"]]
            with paddle.no_grad():
                param.set_value(param * (1 + 2**-20))
        try:
            return check(model, optimizer, layout, step, **kwargs)
        except Exception as error:
            probe["replica_error"] = f"{type(error).__name__}: {error}"
            raise

    trainer.check_replicas = perturbing_check
    try:
        code = main([str(a) for a in run["argv"]])
    except SystemExit as stop:  # run_pretrain exits through sys.exit on a RunError
        code = stop.code
    finally:
        trainer.check_replicas = check
    assert replica_check.check_replicas is check
    return {"exit_code": code, "error": probe.get("replica_error")}


@contextlib.contextmanager
def slowed(run: dict):
    """A rank made slow on purpose (tests/test_resilience.py), undone after the run:
    run["slow_rank"] = {"rank": r, "seconds": s}: rank r sleeps s before each step's flag reduction (the
    end of its own share of the step, llm_pretrain/run/trainer.py agree_on_step);
    run["slow_disk"] = {"rank": r, "steps": n}: rank r's first checkpoint write (on the writer thread
    under async_save) starts only once training has reached n more flag reductions (so the weights
    have changed since the save; at most 120 s): a disk slower than any machine load makes it."""
    import threading
    import time

    from llm_pretrain.checkpoint import dist_checkpoint
    from llm_pretrain.run import trainer

    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    agree_on_step, write_snapshot = trainer.agree_on_step, dist_checkpoint.write_snapshot
    slow_rank = run.get("slow_rank") if (run.get("slow_rank") or {}).get("rank") == rank else None
    slow_disk = run.get("slow_disk") if (run.get("slow_disk") or {}).get("rank") == rank else None
    steps, stepped, writes = [0], threading.Condition(), [0]

    def counted_agree_on_step(*args, **kwargs):
        if slow_rank:
            time.sleep(slow_rank["seconds"])
        with stepped:
            steps[0] += 1
            stepped.notify_all()
        return agree_on_step(*args, **kwargs)

    def slow_write_snapshot(*args, **kwargs):
        writes[0] += 1
        if writes[0] == 1:
            with stepped:
                until = steps[0] + slow_disk["steps"]
                stepped.wait_for(lambda: steps[0] >= until, timeout=120)
        return write_snapshot(*args, **kwargs)

    if slow_rank or slow_disk:
        trainer.agree_on_step = counted_agree_on_step
    if slow_disk:
        dist_checkpoint.write_snapshot = slow_write_snapshot
    try:
        yield
    finally:
        trainer.agree_on_step, dist_checkpoint.write_snapshot = agree_on_step, write_snapshot


if __name__ == "__main__":
    catch_crashes()
    for owner, method in ((DecoderLayer, "forward"), (DecoderLayer, "attention_block"), (Attention, "core_attention")):
        counting(owner, method)
    watch_sp_hooks()
    watch_kv_heads()
    watch_all_to_all()
    watch_ring()
    watch_router()
    watch_pipeline_schedule()
    watch_data_parallel()
    catch_built_run()
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    results = {}
    for run in runs:
        reset_probe()
        gc.collect()
        probe["allocated_before"] = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        if run.get("perturb_replica"):  # expected to fail: record the replica check's error
            results[run["name"]] = perturbed_replica_run(run)
            continue
        keep_master_grads = fp32_master_grads() if run.get("fp32_master_grad") else contextlib.nullcontext()
        kernel_standins.CALLS.clear()
        with run_environment(run.get("env", {})), slowed(run), keep_master_grads as master_grads:
            code = main([str(a) for a in run["argv"]])
        if code:
            sys.exit(code)
        results[run["name"]] = {**observations(), "kernel_calls": dict(kernel_standins.CALLS)}
        if master_grads is not None:
            results[run["name"]]["master_grads"] = master_grads.seen()
        probe.clear()
        gc.collect()
    from launch_utils import write_result

    write_result(results)
    exit_after_results(0)
