"""Expert parallelism (expert_parallel_degree; models/moe.py): the same training as one process.

One 2-process launch (tests/workers/moe_worker.py) with ep2 over the data-parallel ranks (dp2: each
reads its own samples) trains mixtral-tiny for 4 steps, resumes a one-process checkpoint under ep2,
and stops an ep2 run at step 2 for one process to resume; then it watches the mechanism:
    each rank holds E/ep experts (0-3 and 4-7), and its dispatching all-to-all carries its
    k x tokens (token, expert) pairs per layer in forward and their gradients in backward;
    its loss and its experts' gradients equal the whole model's on both ranks' tokens.
The same launch trains Qwen3-MoE with global-batch balancing and DeepSeek-V3 with its bias rule under ep2 (2 steps).
A second launch trains ep2 x tp2 (4 processes: the experts split like the dense MLP over the
tensor-parallel pair, the all-to-all between the data-parallel pair), the same with sequence
parallelism, and Qwen2-MoE with capacity and z-loss under tp2 x dp2 + SP; a third ep2 within dp4 (two
expert groups; each expert's gradient summed over its two holders), then ep2 over the sharding ranks
with stages 1 and 2 (fleet's own expert and moe_sharding groups, llm_pretrain/parallel/expert_optimizer.py): sd2
with 2 processes (also mixtral-real under stage 2: its 8.5M-element embedding is above the stage-2 buffer),
and sd4 with 4 (two moe_sharding ranks hold the same experts and split their optimizer states; also resumed
from one process and stopped for one process to resume), and the first one also trains
mixtral-real (expert matrices 1024 x 2816 = 2.9M elements, above 2**20; embedding and head 8.5M,
above 2**23). Everything is compared with one process training the same global batch (8 samples: 4
micro-batches of 2 there, 2 per rank under ep2): per-step loss and grad norm, final weights (merged
checkpoints, each expert a logical tensor), 1e-5.

Under the pipeline (models/pipeline.py RouterCarry) one more 4-process launch, pp2 x dp2, trains
mixtral-tiny without and with ep2 and qwen2-moe-tiny with ep2, a capacity factor and the z-loss: one
decoder layer per stage, so the load-balancing loss, taken over both layers, spans the stages. The same launch
trains DeepSeek-V3 with ep2 and its bias rule (2 steps; issue 35): its dense layer 0 on stage 0, its MoE layer 1 and
MTP block on stage 1, each router's bias moved by the load summed over both micro-batches and the dp pair; and issue
34's ERNIE 4.5 MoE (the same layout of dense and MoE layers, its correction bias) and Qwen3-MoE with global-batch
balancing, with ep2 (ISSUE34_PIPELINE). The session's pp2 x sd2 launch trains DeepSeek-V3 and those two under
sharding stage 1 with ep2 over the sharding ranks (PP_SHARDED, ISSUE34_PP_SHARDED).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from launch_utils import REPO_ROOT, launch
from shared_launches import contribute, once
from parity_utils import (
    DEVICE, KERNEL_OPTIONS, argv, assert_every_replica_matches, assert_same_router_biases, assert_same_router_metrics,
    assert_same_training, base_arguments, final_weights, run_launch, run_record, run_single, run_spec, train_records,
    write_json,
)

STEPS, STOP = 4, 2
# mixtral-real (92.6M parameters) trains 2 steps: a step of it costs about as much as a launch, and the sizes,
# not the steps, are what it is here for (its matrices and embedding above Paddle's thresholds).
REAL = {"model_name_or_path": "mixtral-real", "max_steps": 2, "save_steps": 2}
QWEN_CAPPED = {"model_name_or_path": "qwen2-moe-tiny", "moe_capacity_factor": 0.5, "router_z_loss_coef": 0.001}
# Qwen3-MoE (issue 34; 16 experts top 4, 2 layers, 2 steps) under ep2 over dp2 with Qwen's global-batch balancing:
# each rank one micro-batch of 4 (its half of the global batch), its picks summed with the other rank's before the
# load-balancing loss, against one process with one micro-batch of all 8 samples (the same f_e over the same
# tokens; without the balancing the ranks' own halves give another loss, ~3e-4 off here)
QWEN3_GLOBAL = {"model_name_or_path": "qwen3-moe-tiny", "max_steps": 2, "save_steps": 2,
                "moe_global_batch_balance": True}
# DeepSeek-V3 (issue 35; deepseek-v3-tiny: 1 dense + 1 MoE layer of 8 experts top 2, MTP) under ep2 over dp2 with its
# auxiliary-loss-free bias rule on, 2 steps: models/deepseek_moe.py's block is models/moe.py's MoE (the same
# all-to-all dispatch), and each rank's expert load is summed over the data-parallel ranks before the bias moves
DEEPSEEK = {"model_name_or_path": "deepseek-v3-tiny", "max_steps": 2, "save_steps": 2, "moe_bias_update_rate": 0.01}
# ERNIE 4.5 MoE (issue 34; ernie4_5_moe-tiny: layer 0 dense, layer 1 MoE of 8 experts top 2 with 2 shared experts and
# the correction bias, moved here by the bias rule) under ep2 over the sharding ranks, 2 steps
ERNIE_MOE = {"model_name_or_path": "ernie4_5_moe-tiny", "max_steps": 2, "save_steps": 2, "moe_bias_update_rate": 0.01}
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
                argv(args_file, work / "single-to-sd4", exit_interval=STOP),
                argv(args_file, work / "single-real", **REAL),
                argv(args_file, work / "single-qwen-capped", **QWEN_CAPPED),
                argv(args_file, work / "single-qwen3-global", **QWEN3_GLOBAL, per_device_train_batch_size=8,
                     gradient_accumulation_steps=1),
                argv(args_file, work / "single-deepseek", **DEEPSEEK),
                argv(args_file, work / "single-ernie-moe", **ERNIE_MOE)], work, "single")
    plan = {"ep": 2, "runs": [argv(args_file, work / "ep2", **ep2),
                              argv(args_file, work / "single-to-ep2", **ep2),
                              argv(args_file, work / "ep2-to-single", **ep2, exit_interval=STOP),
                              argv(args_file, work / "ep2-real", **REAL, **ep2),
                              argv(args_file, work / "ep2-recompute-full_attn", **ep2, recompute=True,
                                   recompute_granularity="full_attn"),
                              argv(args_file, work / "qwen3-global-ep2", **QWEN3_GLOBAL, expert_parallel_degree=2,
                                   per_device_train_batch_size=4, gradient_accumulation_steps=1),
                              argv(args_file, work / "deepseek-ep2", **DEEPSEEK, **ep2),
                              argv(args_file, work / "ernie-moe-ep2", **ERNIE_MOE, **ep2),
                              # the reference of pp2dp2ep2-qwen3-global (below): the same micro-batches balanced together
                              argv(args_file, work / "qwen3-global-ep2-acc2", **QWEN3_GLOBAL, **ep2)]}
    result = launch(str(WORKER), 2, [str(write_json(work / "ep2.plan.json", plan))], log_dir=work / "ep2.log",
                    timeout=900, device=DEVICE)
    result.check()
    # ep2 over the sharding ranks (fleet's expert and moe_sharding groups, data_parallel_degree 1), stages 1 and 2:
    # one moe_sharding rank here (each rank keeps the states of its own experts), two with 4 processes below
    # The last run keeps fleet's float32 master gradients (amp_master_grad's hooks, tests/workers/moe_worker.py).
    plan = {"ep": 0, "runs": [argv(args_file, work / f"ep2sd2s{stage}", **ep2, sharding=f"stage{stage}")
                              for stage in (1, 2)] + [argv(args_file, work / "ep2sd2s2-real", **ep2, sharding="stage2", **REAL),
                                                      argv(args_file, work / "ep2sd2s1-master-grad", **ep2,
                                                           sharding="stage1")]
            + [argv(args_file, work / f"deepseek-ep2sd2s{stage}", **DEEPSEEK, **ep2, sharding=f"stage{stage}")
               for stage in (1, 2)]
            + [argv(args_file, work / f"qwen3-global-ep2sd2s{stage}", **QWEN3_GLOBAL, expert_parallel_degree=2,
                    per_device_train_batch_size=4, gradient_accumulation_steps=1, sharding=f"stage{stage}")
               for stage in (1, 2)]
            + [argv(args_file, work / f"ernie-moe-ep2sd2s{stage}", **ERNIE_MOE, **ep2, sharding=f"stage{stage}")
               for stage in (1, 2)],
            "fp32_master_grad": [3]}
    master_grads = {"ep2sd2s1-master-grad": launch(
        str(WORKER), 2, [str(write_json(work / "ep2sd2.plan.json", plan))], log_dir=work / "ep2sd2.log", timeout=900,
        device=DEVICE).check().results()}
    # ep2 within sd4: two expert groups (ranks 0-1, 2-3), fleet's moe_sharding groups 0,2 and 1,3 hold the same
    # experts and split their optimizer states; resumed from one process and stopped for one process to resume
    sd4 = {"expert_parallel_degree": 2, "gradient_accumulation_steps": 1}
    plan = {"ep": 0, "runs": [argv(args_file, work / "ep2sd4s1", **sd4, sharding="stage1"),
                              argv(args_file, work / "ep2sd4s2", **sd4, sharding="stage2"),
                              argv(args_file, work / "single-to-sd4", **sd4, sharding="stage2"),
                              argv(args_file, work / "sd4-to-single", **sd4, sharding="stage1", exit_interval=STOP),
                              argv(args_file, work / "ep2sd4s1-master-grad", **sd4, sharding="stage1")],
            "fp32_master_grad": [4]}
    master_grads["ep2sd4s1-master-grad"] = launch(
        str(WORKER), 4, [str(write_json(work / "ep2sd4.plan.json", plan))], log_dir=work / "ep2sd4.log", timeout=900,
        device=DEVICE).check().results()
    run_single([argv(args_file, work / "ep2-to-single"), argv(args_file, work / "sd4-to-single")], work, "resume")
    # ep2 x tp2: the experts split like the dense MLP over the tensor-parallel pair, the all-to-all between
    # the data-parallel pair (4 processes); also with sequence parallelism (the MoE block gathers the
    # tensor-parallel ranks' chunks: the router sees whole tokens), and Qwen2-MoE (shared expert, capacity
    # and z-loss) under tp2 x dp2 with sequence parallelism
    sp = {"tensor_parallel_degree": 2, "sequence_parallel": True}
    plan = {"ep": 0, "runs": [argv(args_file, work / "ep2tp2", **ep2, tensor_parallel_degree=2),
                              argv(args_file, work / "ep2tp2-sp", **ep2, **sp),
                              argv(args_file, work / "qwen-capped-tp2dp2-sp", **QWEN_CAPPED, **sp,
                                   gradient_accumulation_steps=2)]}
    launch(str(WORKER), 4, [str(write_json(work / "ep2tp2.plan.json", plan))], log_dir=work / "ep2tp2.log",
           timeout=900, device=DEVICE).check()
    # ep2 within dp4: two expert groups (ranks 0-1, 2-3), each expert on two ranks (0 and 2, or 1 and 3)
    plan = {"ep": 0, "runs": [argv(args_file, work / "ep2dp4", expert_parallel_degree=2, gradient_accumulation_steps=1)]}
    launch(str(WORKER), 4, [str(write_json(work / "ep2dp4.plan.json", plan))], log_dir=work / "ep2dp4.log",
           timeout=900, device=DEVICE).check()
    return work, result.results(), master_grads



def assert_halves_of_the_experts_written_apart(run, blocks, experts: int) -> None:
    """In checkpoint-2 of `run`, the first half of the experts of `blocks` (MoE blocks' names) all in one file and the
    second half all in another: each of the two ranks holding them wrote its own."""
    index = json.loads((run / "checkpoint-2" / "tensors.index.json").read_text())
    files = {}
    for block in blocks:
        for expert in range(experts):
            [piece] = index["tensors"][f"{block}.experts.{expert}.down_proj.weight"]["slices"]
            files.setdefault(expert // (experts // 2), set()).add(piece["file"])
    assert all(len(held) == 1 for held in files.values()) and files[0] != files[1], (blocks, files)

def test_ep2_trains_like_one_process(trained):
    work, _, _ = trained
    for reference, name in (("single", "ep2"), ("single", "single-to-ep2"), ("single", "ep2-to-single"),
                            ("single", "ep2tp2"), ("single", "ep2dp4"), ("single-real", "ep2-real"),
                            ("single", "ep2tp2-sp"), ("single-qwen-capped", "qwen-capped-tp2dp2-sp"),
                            ("single", "ep2sd2s1"), ("single", "ep2sd2s2"), ("single", "ep2sd4s1"),
                            ("single", "ep2sd4s2"), ("single", "single-to-sd4"), ("single", "sd4-to-single"),
                            ("single-real", "ep2sd2s2-real"), ("single", "ep2-recompute-full_attn")):
        steps = REAL["max_steps"] if name.endswith("-real") else STEPS
        diffs = assert_same_training(work / reference, work / name, step=steps)
        print(f"{name}: {diffs}")
        assert [r["step"] for r in train_records(work / name)] == list(range(1, steps + 1))
        # the load-balancing loss logged (mean over the data replicas; the load ratio and the pairs dropped are
        # rank 0's tokens under data parallelism)
        for a, b in zip(train_records(work / reference), train_records(work / name)):
            assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], abs=1e-5)
    assert train_records(work / "qwen-capped-tp2dp2-sp")[0]["tokens_dropped"] > 0
    assert run_record(work / "ep2tp2-sp")["built"]["sequence_parallel"]["enabled"]
    assert run_record(work / "ep2")["layout"]["world_size"] == 2
    recomputed = run_record(work / "ep2-recompute-full_attn")["built"]["recompute"]
    assert recomputed == {"full_attn": [0, 1]}, recomputed  # both layers, this granularity only
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


def _layout_degrees(record: dict, name: str) -> tuple[int, int]:
    """(data-parallel, sharding) degree a run of these tests has: ep2 over dp2, or over sd2 ("...sd2s<stage>")."""
    assert record["layout"]["world_size"] == 2, record["layout"]
    return (1, 2) if "sd2s" in name else (2, 1)


@pytest.mark.parametrize("name", ["qwen3-global-ep2", "qwen3-global-ep2sd2s1", "qwen3-global-ep2sd2s2"])
def test_qwen3_moe_ep2_with_global_batch_balancing_trains_like_one_process(trained, name):
    """Qwen3-MoE under ep2 over dp2, and over the sharding ranks with stages 1 and 2 (fleet's expert group,
    data_parallel_degree 1), with moe_global_batch_balance: losses (language model + the load-balancing loss
    over the global batch: the picks summed over the data-parallel and the sharding group, models/moe.py
    global_batch_stats), grad norms, router metrics and weights equal one process's over all 8 samples at once;
    each rank wrote its 8 of the 16 experts."""
    work, _, _ = trained
    print(assert_same_training(work / "single-qwen3-global", work / name, step=2))
    assert_same_router_metrics(work / "single-qwen3-global", work / name)
    record = run_record(work / name)
    layout = record["layout"]
    assert record["model_config"]["family"] == "qwen3_moe"
    assert (layout["data_parallel_degree"], layout["sharding_degree"]) == _layout_degrees(record, name)
    if "sd2s" in name:  # each rank keeps the states of its own 8 experts of both layers (3 matrices each)
        assert record["built"]["expert_states"]["states_kept"] == [2 * 8 * 3] * 2, record["built"]["expert_states"]
    index = json.loads((work / name / "checkpoint-2" / "tensors.index.json").read_text())
    for expert, rank in ((0, 0), (7, 0), (8, 1), (15, 1)):
        slices = index["tensors"][f"layers.1.mlp.experts.{expert}.down_proj.weight"]["slices"]
        assert [s["file"] for s in slices] == [f"tensors.rank{rank:05d}.safetensors"]


@pytest.mark.parametrize("name", ["deepseek-ep2", "deepseek-ep2sd2s1", "deepseek-ep2sd2s2"])
def test_deepseek_v3_ep2_with_the_bias_rule_trains_like_one_process(trained, name):
    """DeepSeek-V3 under ep2 over dp2, and over the sharding ranks with stages 1 and 2 (fleet's expert group,
    data_parallel_degree 1; issue 35): losses (main, MTP), grad norms, router metrics, weights and the routers'
    correction biases (the main MoE layer's and the MTP block's, moved from the load summed over both ranks:
    sum_over_data_replicas covers the data-parallel and the sharding group) equal one process's; each rank wrote
    its 4 of the 8 experts of both MoE blocks."""
    work, _, _ = trained
    print(assert_same_training(work / "single-deepseek", work / name, step=2))
    assert_same_router_metrics(work / "single-deepseek", work / name)
    assert_same_router_biases(work / "single-deepseek", work / name)
    for a, b in zip(train_records(work / "single-deepseek"), train_records(work / name), strict=True):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], abs=1e-5)
    record = run_record(work / name)
    layout = record["layout"]
    assert record["model_config"]["family"] == "deepseek_v3"
    assert (layout["data_parallel_degree"], layout["sharding_degree"]) == ((2, 1) if name == "deepseek-ep2" else (1, 2))
    if name != "deepseek-ep2":  # fleet's expert group over the sharding ranks: each keeps its own experts' states
        assert record["built"]["expert_states"]["states_kept"] == [2 * 4 * 3] * 2, record["built"]["expert_states"]
    index = json.loads((work / name / "checkpoint-2" / "tensors.index.json").read_text())
    for block in ("layers.1.mlp", "mtp.block.mlp"):
        for expert, rank in ((0, 0), (3, 0), (4, 1), (7, 1)):
            slices = index["tensors"][f"{block}.experts.{expert}.down_proj.weight"]["slices"]
            assert [s["file"] for s in slices] == [f"tensors.rank{rank:05d}.safetensors"]


@pytest.mark.parametrize("name", ["ernie-moe-ep2", "ernie-moe-ep2sd2s1", "ernie-moe-ep2sd2s2"])
def test_ernie4_5_moe_ep2_trains_like_one_process(trained, name):
    """ERNIE 4.5 MoE (layer 0 dense, layer 1 MoE with shared experts and the correction bias moved by the bias rule)
    under ep2 over dp2, and over the sharding ranks with stages 1 and 2: losses, grad norms, router metrics,
    weights and the correction bias (the load summed over both ranks, sum_over_data_replicas) equal one process's;
    each rank wrote its 4 of the 8 experts, the shared experts whole (dense: every rank's copy)."""
    work, _, _ = trained
    print(assert_same_training(work / "single-ernie-moe", work / name, step=2))
    assert_same_router_metrics(work / "single-ernie-moe", work / name)
    assert_same_router_biases(work / "single-ernie-moe", work / name, expected=("layers.1.mlp",))
    record = run_record(work / name)
    layout = record["layout"]
    assert record["model_config"]["family"] == "ernie4_5_moe"
    assert (layout["data_parallel_degree"], layout["sharding_degree"]) == _layout_degrees(record, name)
    if "sd2s" in name:  # each rank keeps the states of its own 4 experts (3 matrices each)
        assert record["built"]["expert_states"]["states_kept"] == [4 * 3] * 2, record["built"]["expert_states"]
    index = json.loads((work / name / "checkpoint-2" / "tensors.index.json").read_text())
    for expert, rank in ((0, 0), (3, 0), (4, 1), (7, 1)):
        slices = index["tensors"][f"layers.1.mlp.experts.{expert}.down_proj.weight"]["slices"]
        assert [s["file"] for s in slices] == [f"tensors.rank{rank:05d}.safetensors"]


def test_each_rank_holds_its_experts_and_the_all_to_all_carries_k_x_tokens(trained):
    _, results, _ = trained
    for rank, result in results.items():
        assert result["experts_held"] == list(range(4 * rank, 4 * rank + 4))
        for rows in result["rows_per_layer"]:
            assert rows == {"forward": result["pairs_per_layer"], "backward": result["pairs_per_layer"]}
        assert result["loss_diff"] < 1e-5
        assert result["expert_grad_diff"] < 1e-6 and result["expert_grad_max"] > 1e-4


def _moment_bytes_by_file(output_dir):
    """rank file -> bytes of the Adam moments it holds, and (expert group, file) -> expert moment1 tensors."""
    index = json.loads((output_dir / f"checkpoint-{STEPS}" / "tensors.index.json").read_text())["tensors"]
    moments, experts = {}, {}
    for name, entry in index.items():
        if name.endswith("/moment1_0") or name.endswith("/moment2_0"):
            for piece in entry["slices"]:
                moments[piece["file"]] = moments.get(piece["file"], 0) + 4 * math.prod(piece["shape"])
        if ".experts." in name and name.endswith("/moment1_0"):
            [piece] = entry["slices"]
            group = int(name.split(".experts.")[1].split(".")[0]) // 4  # experts 0-3: expert rank 0
            experts[group, piece["file"]] = experts.get((group, piece["file"]), 0) + 1
    return moments, experts


def test_expert_states_are_sharded_over_fleets_moe_sharding_group(trained):
    """Over sharding ranks each rank keeps the optimizer states of its own experts only, and of 1/moe_sharding
    of them when fleet's moe_sharding group has two ranks (24 expert matrices per rank: 2 layers x 4 experts x
    3); the planner's Adam moments of every rank equal the bytes that rank's optimizer held."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import validated_setup
    from llm_pretrain.planner.memory import rank_memory

    work, _, _ = trained
    file = "tensors.rank{:05d}.safetensors".format
    for name, ranks, share in (("ep2sd2s1", 2, {(0, 0): 24, (1, 1): 24}), ("ep2sd2s2", 2, {(0, 0): 24, (1, 1): 24}),
                               ("ep2sd4s1", 4, {(0, 0): 12, (0, 2): 12, (1, 1): 12, (1, 3): 12}),
                               ("ep2sd4s2", 4, {(0, 0): 12, (0, 2): 12, (1, 1): 12, (1, 3): 12})):
        moments, experts = _moment_bytes_by_file(work / name)
        assert experts == {(group, file(rank)): n for (group, rank), n in share.items()}, name
        built = run_record(work / name)["built"]["expert_states"]
        assert built["states_kept"] == [24 // (ranks // 2)] * ranks, name
        assert built["implementation"] == ("DygraphShardingOptimizer" if ranks == 4 else "AdamW")
        args, _ = parse_arguments([str(work / "moe.json"), "--expert_parallel_degree", "2", "--sharding",
                                   "stage" + name[-1], "--gradient_accumulation_steps", str(4 // ranks),
                                   "--output_dir", str(work / "plan")])
        setup, _, _ = validated_setup(args, ranks, "cpu")
        for rank in range(ranks):
            assert rank_memory(setup, 0, rank).persistent["Adam moments (fp32)"] == moments[file(rank)], (name, rank)


def test_experts_over_sharding_train_like_one_process_with_master_grads(trained):
    """amp_master_grad's float32 gradients (fleet's mix_precision_utils hooks, on float32 weights on CPU) under
    ep2 over sharding stage 1, with fleet's moe_sharding group of one rank (sd2, 2 micro-batches) and of two
    (sd4): every step's loss and grad norm and the final weights equal one process's (issue 33, finding 1). The
    experts' gradients lived in main_grad: their AdamW read the empty param.grad (they never trained, their
    main_grad grew into the norm), and the experts' gradient hook made Paddle fill param.grad beside main_grad
    (fleet's hook asserts it empty: the second micro-batch failed)."""
    work, _, master_grads = trained
    for name, ranks in master_grads.items():
        diffs = assert_same_training(work / "single", work / name, step=STEPS)
        print(f"{name}: {diffs}")
        for rank, seen in ranks.items():  # fleet's hooks were on: every parameter's gradient is in main_grad
            assert seen["master_grads"]["3" if "sd2" in name else "4"] == {
                "params": 41, "with_main_grad": 41, "experts_with_main_grad": 24}, (name, rank, seen)
        built = run_record(work / name)["built"]["expert_states"]
        assert built["implementation"] == ("DygraphShardingOptimizer" if "sd4" in name else "MixPrecisionOptimizer")


MOE_PIPELINE_RUNS = {  # name: (model, overrides) trained under pp2 x dp2 and in one process
    "pp2dp2": ("mixtral-tiny", {}),
    "pp2dp2ep2": ("mixtral-tiny", {"expert_parallel_degree": 2}),
    "pp2dp2ep2-qwen": ("qwen2-moe-tiny", {"expert_parallel_degree": 2, "moe_capacity_factor": 0.5,
                                          "router_z_loss_coef": 0.001}),
}
# DeepSeek-V3 (issue 35) under pp2 x dp2 with ep2 over the data-parallel ranks, its bias rule on, 2 steps: layer 0
# (dense) on stage 0; layer 1 and the MTP block (both MoE, their experts split over the dp pair) on stage 1; the
# attention blocks recomputed in backward (full_attn, inside the layers; recompute changes no number)
DEEPSEEK_PIPELINE = {"pp2dp2ep2-deepseek": ("deepseek-v3-tiny", {
    **{k: v for k, v in DEEPSEEK.items() if k != "model_name_or_path"}, "expert_parallel_degree": 2,
    "recompute": True, "recompute_granularity": "full_attn"})}


# Issue 34's mixtures of experts under pp2 x dp2 with ep2 over dp, 2 steps, compared with runs of the `trained`
# fixture: ERNIE 4.5 MoE (layer 0 dense on stage 0, layer 1's experts and correction bias, moved by the bias rule,
# on stage 1) with single-ernie-moe (one process, the same arguments); Qwen3-MoE (both layers sparse: each stage
# splits its experts over its dp pair) with global-batch balancing with qwen3-global-ep2-acc2 (ep2 over dp2, 2
# micro-batches of 2 a rank): micro-batch j of dp rank r holds samples 4r + 2j, 4r + 2j + 1, and the balancing sums
# the picks of both ranks' micro-batch j, which no one-process run groups together (its micro-batches are
# contiguous; qwen3-global-ep2, 1 micro-batch a rank, is the one-process one). Name -> (model, overrides,
# reference in `trained`).
ISSUE34_PIPELINE = {
    "pp2dp2ep2-qwen3-global": ("qwen3-moe-tiny", {**{k: v for k, v in QWEN3_GLOBAL.items() if k != "model_name_or_path"},
                                                  "expert_parallel_degree": 2}, "qwen3-global-ep2-acc2"),
    "pp2dp2ep2-ernie": ("ernie4_5_moe-tiny", {**{k: v for k, v in ERNIE_MOE.items() if k != "model_name_or_path"},
                                              "expert_parallel_degree": 2}, "single-ernie-moe")}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, embedded_corpus):
    work = tmp_path_factory.mktemp("expert_pipeline")
    args_file = moe_arguments(embedded_corpus, work)
    single = [argv(args_file, work / f"single-{name}", model_name_or_path=model,
                   **{k: v for k, v in overrides.items() if k not in ("expert_parallel_degree", "recompute",
                                                                      "recompute_granularity")})
              for name, (model, overrides) in {**MOE_PIPELINE_RUNS, **DEEPSEEK_PIPELINE}.items()]
    # the same training without the load-balancing loss: how far it moves the routers
    single.append(argv(args_file, work / "single-no-aux", router_aux_loss_coef=0.0))
    run_single(single, work, "single")
    runs = [argv(args_file, work / name, model_name_or_path=model, pipeline_parallel_degree=2,
                 gradient_accumulation_steps=2, **overrides)
            for name, (model, overrides) in {**MOE_PIPELINE_RUNS, **DEEPSEEK_PIPELINE}.items()]
    runs += [argv(args_file, work / name, model_name_or_path=model, pipeline_parallel_degree=2,
                  gradient_accumulation_steps=2, **overrides) for name, (model, overrides, _) in ISSUE34_PIPELINE.items()]
    # expert parallelism under the pipeline with the GPU kernels' branches through their CPU stand-ins
    runs.append(run_spec("pp2dp2ep2-kernels", argv(args_file, work / "pp2dp2ep2-kernels", pipeline_parallel_degree=2,
                                                   gradient_accumulation_steps=2, expert_parallel_degree=2,
                                                   **KERNEL_OPTIONS)))
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


def test_moe_under_the_pipeline_with_the_kernel_stand_ins(pipelined):
    """pp2 x dp2 x ep2 with flash attention, the fused rotary embedding and RMSNorm (CPU stand-ins) and the
    swiglu kernel in the experts: the same training as one process on the plain path."""
    work = pipelined
    print(assert_same_training(work / "single-pp2dp2ep2", work / "pp2dp2ep2-kernels", step=STEPS))
    assert_same_router_metrics(work / "single-pp2dp2ep2", work / "pp2dp2ep2-kernels")
    kernels = run_record(work / "pp2dp2ep2-kernels")["built"]["kernels"]
    assert DEVICE != "cpu" or kernels["stand_ins"] == ["flash_attn", "flash_attn_grad", "fused_rms_norm_quant",
                                                       "fused_rotary_position_embedding"], kernels
    assert "use_fused_swiglu" in kernels["fused_branches"]


def check_deepseek_under_the_pipeline(work) -> None:
    """DeepSeek-V3 under pp2 x dp2 with ep2 over dp (the combination PaddleFormers trains it in: PP x EP): losses
    (main, MTP), grad norms, router metrics and weights as one process's (the replica check among them: every dp
    rank's copy of the stage's weights, the router biases included, is the same); both router biases (layer 1's
    and the MTP block's, on the last stage) moved from the load of the 2 micro-batches summed over the dp pair as one
    process's; layer 0 on stage 0, layer 1 and the MTP block on stage 1; each dp rank of the last stage wrote its 4
    of the 8 experts of both MoE blocks; the attention blocks of the three recomputed (full_attn), as one process
    that does not recompute."""
    name = "pp2dp2ep2-deepseek"
    print(assert_same_training(work / f"single-{name}", work / name, step=2))
    print(assert_every_replica_matches(work / f"single-{name}", work / name, step=2))
    assert_same_router_metrics(work / f"single-{name}", work / name)
    assert_same_router_biases(work / f"single-{name}", work / name)
    for a, b in zip(train_records(work / f"single-{name}"), train_records(work / name), strict=True):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], abs=1e-5)
    record = run_record(work / name)
    layout = record["layout"]
    assert record["model_config"]["family"] == "deepseek_v3"
    assert (layout["pipeline_parallel_degree"], layout["data_parallel_degree"]) == (2, 2)
    assert record["built"]["schedule"]["chunk_layers"] == [[[0]], [[1, 2]]], record["built"]["schedule"]
    assert record["built"]["recompute"] == {"full_attn": [0, 1, 2], "pipeline_recompute_interval": 0}, record["built"]
    assert_halves_of_the_experts_written_apart(work / name, ("layers.1.mlp", "mtp.block.mlp"), 8)


def test_deepseek_v3_under_the_pipeline_with_ep2_trains_like_one_process(pipelined):
    check_deepseek_under_the_pipeline(pipelined)


# DeepSeek-V3 under pp2 x sharding 2 (stage 1) with ep2 over the sharding ranks (PaddleFormers' PP x EP x sharding):
# the session's one pp2 x sd2 launch (tests/shared_launches.py), its one-process reference made once beside it
PP_SHARDED = "pp2sd2ep2-deepseek"


# Issue 34's mixtures of experts in the same launch, compared with runs of the `trained` fixture as ISSUE34_PIPELINE's
# (the sharding pair reads the samples a dp pair would): Qwen3-MoE with global-batch balancing (the picks summed over
# the stage's sharding pair) and ERNIE 4.5 MoE with the bias rule (dense stage 0). Name -> (model, overrides, reference)
ISSUE34_PP_SHARDED = {name.replace("dp2", "sd2"): spec for name, spec in ISSUE34_PIPELINE.items()}


def _pp_sharded_runs(work, corpus):
    args_file = moe_arguments(corpus, work)
    overrides = {k: v for k, v in DEEPSEEK.items()}
    once(work / "single.done", lambda: run_single([argv(args_file, work / f"single-{PP_SHARDED}", **overrides)],
                                                  work, "single"))
    pp_sd_ep = dict(pipeline_parallel_degree=2, gradient_accumulation_steps=2, expert_parallel_degree=2,
                    sharding="stage1")
    # full recompute under the pipeline: fleet's PipelineLayer segments of one function each (pp_recompute_interval 1),
    # the MTP block's among them (models/pipeline.py); the reference does not recompute
    return [{"name": PP_SHARDED, "argv": argv(args_file, work / PP_SHARDED, **overrides, **pp_sd_ep, recompute=True)}] + [
        {"name": name, "argv": argv(args_file, work / name, model_name_or_path=model, **{**more, **pp_sd_ep})}
        for name, (model, more, _) in ISSUE34_PP_SHARDED.items()]


contribute("pp2sd2", 4, "expert_parallel", _pp_sharded_runs)


def test_deepseek_v3_under_the_pipeline_with_ep2_over_sharding_trains_like_one_process(shared_launches):
    """pp2 x sd2 stage 1 x ep2 (issue 33 item 2): losses (main, MTP), grad norms with the clip active at step 2 (its
    global norm summed over the sharding pair, then the stages: expert_optimizer.ShardedGlobalNormClip), weights,
    every sharding rank's copy of the stage's replicated weights and the router biases as one process's. Mechanism:
    stage 1 (layer 1 and the MTP block, the experts) steps through the experts' pair of optimizers that fleet's
    pipeline takes for a HybridParallelOptimizer, stage 0 (dense) through fleet's own; each sharding rank of stage 1
    holds and writes 4 of the 8 experts of both MoE blocks. Full recompute under the pipeline (the reference has
    none): every decoder layer of a stage and the MTP block ran forward twice per micro-batch (once more in
    backward, fleet's recompute_hybrid), and the run record says so."""
    observed = shared_launches.results("pp2sd2", "expert_parallel")
    work = shared_launches.work_dir("expert_parallel")
    single, run = work / f"single-{PP_SHARDED}", work / PP_SHARDED
    print(assert_same_training(single, run, step=2))
    print(assert_every_replica_matches(single, run, step=2))
    assert_same_router_metrics(single, run)
    assert_same_router_biases(single, run)
    records = train_records(run)
    assert records[-1]["grad_norm"] > 1.0, records  # the clip (max_grad_norm 1) scales step 2
    for a, b in zip(train_records(single), records, strict=True):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], abs=1e-5)
    record = run_record(run)
    layout = record["layout"]
    assert (layout["pipeline_parallel_degree"], layout["sharding_degree"], layout["sharding_stage"]) == (2, 2, 1)
    assert record["built"]["schedule"]["chunk_layers"] == [[[0]], [[1, 2]]], record["built"]["schedule"]
    assert record["built"]["recompute"] == {"full": [0, 1, 2], "pipeline_recompute_interval": 1}, record["built"]
    stage_layers = {0: [0], 1: [0], 2: [1, 2], 3: [1, 2]}  # (2: the MTP block's decoder block)
    for rank, layers in stage_layers.items():  # 4 micro-batches: 4 forwards, 4 more in backward
        calls = observed[rank][PP_SHARDED]["calls"]["forward"]
        assert {layer: calls.count(layer) for layer in set(calls)} == {layer: 8 for layer in layers}, (rank, calls)
    classes = [observed[rank][PP_SHARDED]["optimizer_classes"][0] for rank in range(4)]
    assert classes == ["HybridParallelOptimizer"] * 2 + ["PipelineExpertShardedOptimizer"] * 2, classes
    assert_halves_of_the_experts_written_apart(run, ("layers.1.mlp", "mtp.block.mlp"), 8)


@pytest.mark.parametrize("name", ISSUE34_PIPELINE)
def test_issue34_moe_under_the_pipeline_with_ep2_trains_like_its_reference(trained, pipelined, name):
    """Qwen3-MoE (global-batch balancing: each layer's picks summed over its stage's dp pair, and the tokens they
    were counted over carried to the last stage with them, models/pipeline.py RouterCarry) and ERNIE 4.5 MoE (its
    correction bias moved by the load of the 2 micro-batches summed over the dp pair) under pp2 x dp2 with ep2 over
    dp: losses, grad norms, router metrics and weights as their reference's (ISSUE34_PIPELINE), every dp replica of
    every weight and AdamW state the same, ERNIE's bias moved and equal to one process's; one layer a stage, each
    dp rank of a stage holding experts wrote its half of them, to different files."""
    reference = trained[0] / ISSUE34_PIPELINE[name][2]
    work = pipelined
    print(assert_same_training(reference, work / name, step=2))
    print(assert_every_replica_matches(reference, work / name, step=2))
    assert_same_router_metrics(reference, work / name)
    record = run_record(work / name)
    layout = record["layout"]
    assert record["model_config"]["family"] == ISSUE34_PIPELINE[name][0].removesuffix("-tiny").replace("-", "_")
    assert (layout["pipeline_parallel_degree"], layout["data_parallel_degree"]) == (2, 2)
    assert record["built"]["schedule"]["chunk_layers"] == [[[0]], [[1]]], record["built"]["schedule"]
    if name == "pp2dp2ep2-ernie":  # layer 0 dense: stage 1 holds the experts and the bias
        assert_same_router_biases(reference, work / name, expected=("layers.1.mlp",))
    experts = record["model_config"]["num_experts"]
    for layer in (0, 1) if name == "pp2dp2ep2-qwen3-global" else (1,):
        assert_halves_of_the_experts_written_apart(work / name, (f"layers.{layer}.mlp",), experts)


@pytest.mark.parametrize("name", ISSUE34_PP_SHARDED)
def test_issue34_moe_under_the_pipeline_with_ep2_over_sharding_trains_like_its_reference(trained, shared_launches,
                                                                                          name):
    """Qwen3-MoE (global-batch balancing over the stage's sharding pair) and ERNIE 4.5 MoE (its correction bias moved
    by the load of both micro-batches summed over the sharding pair) under pp2 x sd2 stage 1 with ep2 over the
    sharding ranks: losses, grad norms, router metrics, weights, every replica and ERNIE's bias as their reference's
    (ISSUE34_PP_SHARDED). Mechanism: a stage holding experts steps through the experts' pair of optimizers
    (PipelineExpertShardedOptimizer; ERNIE's dense stage 0 through fleet's own), and each sharding rank of it holds
    and writes its half of the experts."""
    observed = shared_launches.results("pp2sd2", "expert_parallel")
    run = shared_launches.work_dir("expert_parallel") / name
    model, _, reference = ISSUE34_PP_SHARDED[name]
    reference = trained[0] / reference
    print(assert_same_training(reference, run, step=2))
    print(assert_every_replica_matches(reference, run, step=2))
    assert_same_router_metrics(reference, run)
    record = run_record(run)
    layout = record["layout"]
    assert record["model_config"]["family"] == model.removesuffix("-tiny").replace("-", "_")
    assert (layout["pipeline_parallel_degree"], layout["sharding_degree"], layout["sharding_stage"]) == (2, 2, 1)
    assert record["built"]["schedule"]["chunk_layers"] == [[[0]], [[1]]], record["built"]["schedule"]
    sparse = (0, 1) if record["model_config"]["family"] == "qwen3_moe" else (1,)  # (ERNIE's layer 0 dense)
    if sparse == (1,):
        assert_same_router_biases(reference, run, expected=("layers.1.mlp",))
    classes = [observed[rank][name]["optimizer_classes"][0] for rank in range(4)]
    assert classes == [("PipelineExpertShardedOptimizer" if stage in sparse else "HybridParallelOptimizer")
                       for stage in (0, 0, 1, 1)], classes
    for layer in sparse:
        assert_halves_of_the_experts_written_apart(run, (f"layers.{layer}.mlp",), record["model_config"]["num_experts"])
