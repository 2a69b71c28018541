"""Expert parallelism (expert_parallel_degree; models/moe.py): the same training as one process.

One 2-process launch (tests/workers/moe_worker.py) with ep2 over the data-parallel ranks (dp2: each
reads its own samples) trains mixtral-tiny for 4 steps, resumes a one-process checkpoint under ep2,
and stops an ep2 run at step 2 for one process to resume; then it watches the mechanism:
    each rank holds E/ep experts (0-3 and 4-7), and its dispatching all-to-all carries its
    k x tokens (token, expert) pairs per layer in forward and their gradients in backward;
    its loss and its experts' gradients equal the whole model's on both ranks' tokens.
A second launch trains ep2 x tp2 (4 processes: the experts split like the dense MLP over the
tensor-parallel pair, the all-to-all between the data-parallel pair), a third ep2 within dp4 (two
expert groups; each expert's gradient summed over its two holders), and the first one also trains
mixtral-real (expert matrices 1024 x 2816 = 2.9M elements, above 2**20; embedding and head 8.5M,
above 2**23). Everything is compared with one process training the same global batch (8 samples: 4
micro-batches of 2 there, 2 per rank under ep2): per-step loss and grad norm, final weights (merged
checkpoints, each expert a logical tensor), 1e-5.

Under the pipeline (models/pipeline.py RouterCarry) one more 4-process launch, pp2 x dp2, trains
mixtral-tiny without and with ep2 and qwen2-moe-tiny with ep2, a capacity factor and the z-loss: one
decoder layer per stage, so the load-balancing loss, taken over both layers, spans the stages.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from launch_utils import REPO_ROOT, launch
from parity_utils import (
    DEVICE, argv, assert_same_router_metrics, assert_same_training, base_arguments, final_weights, run_launch,
    run_record, run_single, train_records, write_json,
)

STEPS, STOP = 4, 2
WORKER = REPO_ROOT / "tests" / "workers" / "moe_worker.py"


def moe_arguments(corpus: dict, work):
    """The argument file of these tests: mixtral-tiny (2 layers) for STEPS steps, every step logged."""
    return write_json(work / "moe.json", base_arguments(corpus, work, model_name_or_path="mixtral-tiny",
                                                        num_hidden_layers=2, max_steps=STEPS, save_steps=STEPS,
                                                        logging_steps=1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_corpus):
    work = tmp_path_factory.mktemp("expert_parallel")
    args_file = moe_arguments(embedded_corpus, work)
    ep2 = {"expert_parallel_degree": 2, "gradient_accumulation_steps": 2}
    run_single([argv(args_file, work / "single"), argv(args_file, work / "single-to-ep2", exit_interval=STOP),
                argv(args_file, work / "single-real", model_name_or_path="mixtral-real")], work, "single")
    plan = {"ep": 2, "runs": [argv(args_file, work / "ep2", **ep2),
                              argv(args_file, work / "single-to-ep2", **ep2),
                              argv(args_file, work / "ep2-to-single", **ep2, exit_interval=STOP),
                              argv(args_file, work / "ep2-real", model_name_or_path="mixtral-real", **ep2)]}
    result = launch(str(WORKER), 2, [str(write_json(work / "ep2.plan.json", plan))], log_dir=work / "ep2.log",
                    timeout=900, device=DEVICE)
    result.check()
    run_single([argv(args_file, work / "ep2-to-single")], work, "resume")
    # ep2 x tp2: the experts split like the dense MLP over the tensor-parallel pair, the all-to-all between
    # the data-parallel pair (4 processes)
    plan = {"ep": 0, "runs": [argv(args_file, work / "ep2tp2", **ep2, tensor_parallel_degree=2)]}
    launch(str(WORKER), 4, [str(write_json(work / "ep2tp2.plan.json", plan))], log_dir=work / "ep2tp2.log",
           timeout=900, device=DEVICE).check()
    # ep2 within dp4: two expert groups (ranks 0-1, 2-3), each expert on two ranks (0 and 2, or 1 and 3)
    plan = {"ep": 0, "runs": [argv(args_file, work / "ep2dp4", expert_parallel_degree=2, gradient_accumulation_steps=1)]}
    launch(str(WORKER), 4, [str(write_json(work / "ep2dp4.plan.json", plan))], log_dir=work / "ep2dp4.log",
           timeout=900, device=DEVICE).check()
    return work, result.results()


def test_ep2_trains_like_one_process(trained):
    work, _ = trained
    for reference, name in (("single", "ep2"), ("single", "single-to-ep2"), ("single", "ep2-to-single"),
                            ("single", "ep2tp2"), ("single", "ep2dp4"), ("single-real", "ep2-real")):
        diffs = assert_same_training(work / reference, work / name, step=STEPS)
        print(f"{name}: {diffs}")
        assert [r["step"] for r in train_records(work / name)] == [1, 2, 3, 4]
    assert run_record(work / "ep2")["layout"]["world_size"] == 2
    assert run_record(work / "single-to-ep2")["start_step"] == STOP
    assert run_record(work / "ep2-to-single")["start_step"] == STOP
    # each expert is one logical tensor of the checkpoint, written by the rank that holds it
    index = json.loads((work / "ep2" / f"checkpoint-{STEPS}" / "tensors.index.json").read_text())
    for expert, rank in ((0, 0), (3, 0), (4, 1), (7, 1)):
        slices = index["tensors"][f"layers.1.mlp.experts.{expert}.down_proj.weight"]["slices"]
        assert [s["file"] for s in slices] == [f"tensors.rank{rank:05d}.safetensors"]
    # within dp4, the first expert group's ranks write the experts (their copies on ranks 2 and 3 are not)
    index = json.loads((work / "ep2dp4" / f"checkpoint-{STEPS}" / "tensors.index.json").read_text())
    for expert, rank in ((0, 0), (4, 1)):
        slices = index["tensors"][f"layers.0.mlp.experts.{expert}.gate_proj.weight/moment1_0"]["slices"]
        assert [s["file"] for s in slices] == [f"tensors.rank{rank:05d}.safetensors"]
    assert train_records(work / "ep2")[-1]["moe_aux_loss"] > 0.99
    for name in ("ep2", "ep2tp2", "ep2dp4"):  # router metrics over every rank's tokens (metrics.gather_router_metrics)
        assert_same_router_metrics(work / "single", work / name)
    assert run_record(work / "ep2tp2")["layout"]["tensor_parallel_degree"] == 2


def test_each_rank_holds_its_experts_and_the_all_to_all_carries_k_x_tokens(trained):
    _, results = trained
    for rank, result in results.items():
        assert result["experts_held"] == list(range(4 * rank, 4 * rank + 4))
        for rows in result["rows_per_layer"]:
            assert rows == {"forward": result["pairs_per_layer"], "backward": result["pairs_per_layer"]}
        assert result["loss_diff"] < 1e-5
        assert result["expert_grad_diff"] < 1e-6 and result["expert_grad_max"] > 1e-4


MOE_PIPELINE_RUNS = {  # name: (model, overrides) trained under pp2 x dp2 and in one process
    "pp2dp2": ("mixtral-tiny", {}),
    "pp2dp2ep2": ("mixtral-tiny", {"expert_parallel_degree": 2}),
    "pp2dp2ep2-qwen": ("qwen2-moe-tiny", {"expert_parallel_degree": 2, "moe_capacity_factor": 0.5,
                                          "router_z_loss_coef": 0.001}),
}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, embedded_corpus):
    work = tmp_path_factory.mktemp("expert_pipeline")
    args_file = moe_arguments(embedded_corpus, work)
    single = [argv(args_file, work / f"single-{name}", model_name_or_path=model,
                   **{k: v for k, v in overrides.items() if k != "expert_parallel_degree"})
              for name, (model, overrides) in MOE_PIPELINE_RUNS.items()]
    # the same training without the load-balancing loss: how far it moves the routers
    single.append(argv(args_file, work / "single-no-aux", router_aux_loss_coef=0.0))
    run_single(single, work, "single")
    runs = [argv(args_file, work / name, model_name_or_path=model, pipeline_parallel_degree=2,
                 gradient_accumulation_steps=2, **overrides) for name, (model, overrides) in MOE_PIPELINE_RUNS.items()]
    run_launch(4, runs, work, "pp2dp2", timeout=900)
    return work


def test_moe_under_the_pipeline_trains_like_one_process(pipelined):
    """pp2 x dp2 (with and without ep2): every step's loss (language model + auxiliary losses) and grad norm,
    the router metrics of train_log.jsonl and the final weights equal one process's. Stage 0's router
    (layers.0.mlp.gate) gets the gradient of a loss taken on stage 1: without the load-balancing loss it
    would differ by ~1e-2 after 4 steps (a stage that dropped it fails here)."""
    work = pipelined
    for name in MOE_PIPELINE_RUNS:
        diffs = assert_same_training(work / f"single-{name}", work / name, step=STEPS)
        print(f"{name}: {diffs}")
        layout = run_record(work / name)["layout"]
        assert (layout["pipeline_parallel_degree"], layout["data_parallel_degree"]) == (2, 2)
        assert run_record(work / name)["built"]["schedule"]["chunk_layers"] == [[[0]], [[1]]]
        assert_same_router_metrics(work / f"single-{name}", work / name)
        assert train_records(work / name)[-1]["moe_aux_loss"] > 0.99
    assert sum(r["tokens_dropped"] for r in train_records(work / "pp2dp2ep2-qwen")) > 0
    gate = "layers.0.mlp.gate.weight"
    moved = np.abs(final_weights(work / "single-pp2dp2", STEPS)[gate]
                   - final_weights(work / "single-no-aux", STEPS)[gate]).max()
    assert moved > 1e-3, moved
