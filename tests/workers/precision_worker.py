"""Loss scaling and master gradients across 2 CPU processes (launched by tests/test_precision.py).

fleet is initialized once with sharding degree 2; each case then builds a tiny LLaMA with the
trainer's own pieces (build_model, init_weights, build_optimizer, wrap_for_training,
wrap_loss_scaler, keep_master_grads, train_step) in one layout and trains 3 steps on
different data per rank:

    scaler cases   a float32 GradScaler enabled on CPU, wrapped for the layout; at step 2 rank 1
                   alone gets an inf gradient (a hook on one weight). Each rank reports, per
                   step, whether the optimizer stepped, the LR schedule position and its weights.
    plain_stage1   the same with an UNWRAPPED scaler: the negative control (ranks disagree).
    master_grad    fleet's main_grad hooks + MixPrecisionOptimizer (float32 here) in stages 1
                   and 2, to compare with the same run without them (the test compares).

Paddle's GradScaler switches itself off on CPU (amp/grad_scaler.py: "AmpScaler can only be enabled
on CUDAPlace ..."), and its scale() switches off dynamic scaling unless the AMP dtype is float16;
`cpu_grad_scaler` passes both checks so that the float32 scaler runs the same code as on GPU.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from types import SimpleNamespace
from unittest import mock

from worker_common import dist, init_fleet, np, paddle, write_result

from llm_pretrain.parallel.distributed import Layout, record_grad_norm, wrap_for_training
from llm_pretrain.parallel.optim import build_optimizer, build_schedule
from llm_pretrain.parallel.precision import (
    Precision, fix_scale_update, keep_master_grads, loss_scaler_kind,
)
from llm_pretrain.run.trainer import train_step
from models.registry import make_config
from models.decoder import CausalLM
from models.weights import init_weights

STEPS, INF_STEP, INF_RANK = 3, 1, 1
SCALE = 1024.0
CONFIG = make_config("llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, seq_length=16)
ARGS = SimpleNamespace(learning_rate=1e-2, min_learning_rate=1e-3, effective_warmup_steps=1, decay_steps=None,
                       max_steps=10, lr_scheduler_type="cosine", max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.95,
                       adam_epsilon=1e-6, weight_decay=0.01, fp16=True, bf16=False, fp16_opt_level="O1",
                       amp_master_grad=False, scale_loss=SCALE)


class _GpuPlace:
    def is_gpu_place(self):
        return True


def cpu_grad_scaler():
    grad_scaler = importlib.import_module("paddle.amp.grad_scaler")
    with mock.patch.object(grad_scaler, "_dygraph_tracer", lambda: SimpleNamespace(_expected_place=_GpuPlace())):
        scaler = paddle.amp.GradScaler(init_loss_scaling=SCALE, decr_every_n_nan_or_inf=1)
    importlib.import_module("paddle.amp.auto_cast").amp_global_state().amp_dtype = "float16"
    assert scaler._enable and scaler._use_dynamic_loss_scaling
    return scaler


def batches(step: int, rank: int):
    rng = np.random.RandomState(1000 * step + rank)
    tokens = rng.randint(0, CONFIG.vocab_size, size=(2, 2, CONFIG.seq_length + 1)).astype("int64")
    return [(paddle.to_tensor(t[:, :-1]), paddle.to_tensor(t[:, 1:])) for t in tokens]


def full_weights(model, unwrapped, stage: int) -> dict:
    if stage == 3:
        model.get_all_parameters()  # gathers every slice (group_sharded_stage3.py)
    return {name: p.numpy().astype("float64").ravel().tolist()[:8] + [float(p.numpy().astype("float64").sum())]
            for name, p in unwrapped.canonical_named_parameters()}


def build(hcg, stage: int, master_grad: bool = False):
    """(layout, wrapped model, optimizer, schedule, unwrapped model, parameters) of sharding stage `stage`."""
    layout = Layout(world_size=2, rank=dist.get_rank(), sharding_degree=2, sharding_stage=stage,
                    sharding_rank=hcg.get_sharding_parallel_rank())
    paddle.seed(5)
    model = CausalLM(CONFIG)
    init_weights(model, CONFIG, seed=5)
    schedule = build_schedule(ARGS)
    optimizer = build_optimizer(ARGS, model, schedule)
    if master_grad:
        optimizer = keep_master_grads(model, optimizer, "float16")
    unwrapped = model
    parameters = [p for _, p in unwrapped.canonical_named_parameters()]
    model, optimizer = wrap_for_training(model, optimizer, layout, accumulation_steps=2)
    return layout, model, optimizer, schedule, unwrapped, parameters


def run_case(hcg, stage: int, scaler_mode: str, master_grad: bool = False, inject: bool = True) -> dict:
    rank = dist.get_rank()
    layout, model, optimizer, schedule, unwrapped, parameters = build(hcg, stage, master_grad)
    precision = Precision(SimpleNamespace(**{**vars(ARGS), "fp16": False}), "cpu")  # float32 autocast
    if scaler_mode == "wrapped":
        precision.use_scaler(cpu_grad_scaler(), layout)
    elif scaler_mode == "plain":
        precision.scaler = fix_scale_update(cpu_grad_scaler())  # no cross-rank check
    clip_grad_norm = record_grad_norm(optimizer)
    target = dict(unwrapped.canonical_named_parameters())["layers.0.mlp.down_proj.weight"]
    out = {"kind": loss_scaler_kind(layout), "stepped": [], "last_epoch": [], "losses": [], "norms": [],
           "scale": [], "unscale": getattr(getattr(precision.scaler, "_unscale", None), "__qualname__", None)}
    for step in range(STEPS):
        hook = None
        if inject and step == INF_STEP and rank == INF_RANK:
            hook = target.register_hook(lambda grad: grad * float("inf"))
        result = train_step(model, optimizer, schedule, precision, batches(step, layout.data_replica_rank),
                            parameters, clip_grad_norm)
        if hook is not None:
            hook.remove()
        out["stepped"].append(result.optimizer_stepped)
        out["last_epoch"].append(schedule.last_epoch)
        out["losses"].append(float(result.loss))
        norm = None if result.grad_norm is None else float(result.grad_norm)
        out["norms"].append(norm if norm is None or np.isfinite(norm) else str(norm))
        out["scale"].append(float(precision.scaler._scale.numpy()[0]) if precision.scaler else None)
    out["weights"] = full_weights(model, unwrapped, stage)
    # Where the gradients live: main_grad (float32 master gradients) or param.grad.
    out["params_with_main_grad_hook"] = sum(hasattr(p, "main_grad") for p in parameters)
    out["params_with_main_grad"] = sum(getattr(p, "main_grad", None) is not None for p in parameters)
    out["params"] = len(parameters)
    return out


def run_replica_case(hcg) -> dict:
    """Stage 1 holds every parameter whole on both ranks. After one step, rank 1's copy of one norm
    weight and of one moment get a last-bit-sized difference (what a non-deterministic GPU kernel
    leaves): the strict check (CPU) must refuse, the resynchronizing one (GPU) must report the
    difference and give rank 1 rank 0's copy, after which the replicas are bitwise equal again."""
    from llm_pretrain.errors import RunError
    from llm_pretrain.checkpoint.replica_check import check_replicas

    rank = dist.get_rank()
    layout, model, optimizer, schedule, unwrapped, parameters = build(hcg, 1)
    precision = Precision(SimpleNamespace(**{**vars(ARGS), "fp16": False}), "cpu")
    train_step(model, optimizer, schedule, precision, batches(0, layout.data_replica_rank), parameters,
               record_grad_norm(optimizer))
    norm = dict(unwrapped.canonical_named_parameters())["layers.0.input_layernorm.weight"]
    out = {"before": check_replicas(unwrapped, optimizer, layout, 1)}
    if rank == 1:
        norm.set_value(norm.numpy() * (1 + 2**-20))
    try:
        check_replicas(unwrapped, optimizer, layout, 1)
        out["strict"] = "passed"
    except RunError as error:
        out["strict"] = str(error)
    out["resynchronized"] = check_replicas(unwrapped, optimizer, layout, 1, resynchronize_differences=True)
    out["after"] = check_replicas(unwrapped, optimizer, layout, 1)
    out["norm"] = norm.numpy().astype("float64").tolist()
    return out


def main():
    hcg, _, _ = init_fleet(sharding_degree=2)
    cases = {
        "stage1": (1, "wrapped"), "stage2": (2, "wrapped"), "stage3": (3, "wrapped"),
        "plain_stage1": (1, "plain"),
        "fp32_stage1": (1, None, False, False), "master_grad_stage1": (1, None, True, False),
        "fp32_stage2": (2, None, False, False), "master_grad_stage2": (2, None, True, False),
    }
    results, failures = {}, {}
    for name, case in cases.items():
        try:
            results[name] = run_case(hcg, *case)
        except Exception:  # noqa: BLE001 - reported to the test
            failures[name] = traceback.format_exc()
            print(failures[name], file=sys.stderr, flush=True)
        dist.barrier()
    try:
        results["replica_resync"] = run_replica_case(hcg)
    except Exception:  # noqa: BLE001 - reported to the test
        failures["replica_resync"] = traceback.format_exc()
        print(failures["replica_resync"], file=sys.stderr, flush=True)
    write_result({"results": results, "failures": failures})
    from llm_pretrain.run.run_control import exit_after_results

    exit_after_results(0)  # rank 0 died with SIGSEGV at exit after writing its result (full run, 2026-11-27 02:52)


if __name__ == "__main__":
    main()
