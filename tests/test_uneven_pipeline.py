"""Uneven pipeline stages (issue 24): layers that do not divide over the stages, and explicit splits.

Every run trains like one process (losses, grad norms, final weights, every replica: 1e-5 fp32), and
its run record shows each stage holding the decoder layers the split gives it (the mechanism: with the
split ignored, fleet's even split or a refusal would show). Two launches (the 2-process runs in the
session's pp2 launch, beside the parity tests' pp2 runs: tests/shared_launches.py):

    2 processes  pp2 [3, 5] (llama-tiny, 8 layers); pp2 [1, 7] (gpt3-tiny, tied head: a Megatron-style
                 first stage with the embedding and one layer); stop under [3, 5], resume under [6, 2]
    3 processes  pp3 over 8 layers (automatic: fleet's uniform split as PaddleNLP, [2, 4, 2]); pp3 over
                 4 layers ([1, 2, 1]); gpt3-tiny pp3 (tied head across three stages); resume under pp3
                 of a run stopped under pp2 [3, 5]; interleaved pp3 x 2 virtual stages [1, 2, 1, 1, 2, 1]
                 (8 micro-batches of 1); with the kernel options through their CPU stand-ins: the 8-layer
                 automatic split, GPT-3's (the fast LayerNorm's stand-in), the resume (the pp2 part plain),
                 that interleaved split again and pp3 [3, 2, 3] (each stage's stand-in calls: as many as the
                 layers it holds make); pp3 over 4 layers and the interleaved split keep pp3's plain path;
                 DeepSeek-V3 (6 layers, MTP, the bias rule, 2 steps) interleaved pp3 x 2 and in uneven stages
                 [1, 3, 2], its MTP block in the last chunk of the last stage (check_deepseek); issue 34's
                 Qwen3-MoE (global-batch balancing) and ERNIE 4.5 MoE (the bias rule) interleaved pp3 x 2 the same
                 way (check_issue34_moe)

and one launch per fleet schedule (4 processes: VPPFhenBInBalancedMemory; PipelineParallelWithInterleaveFthenB
in the session's pp4 launch), through the mechanism probes: parity, the schedule class, and each stage's
order of forwards and backwards per chunk.
"""

from __future__ import annotations

import pytest

from launch_utils import REPO_ROOT, launch
from llm_pretrain.parallel.layout import paddle_has_deep_ep
from parity_utils import (
    DEVICE, KERNEL_OPTIONS, argv, assert_every_replica_matches, assert_same_router_biases, assert_same_router_metrics,
    assert_same_training, assert_stand_ins_ran, base_arguments, run_launch, run_record, run_single, run_spec,
    train_records, write_json,
)
from schedule_orders import first_step, fthenb_balanced, interleaved
from shared_launches import contribute

MECHANISM_WORKER = REPO_ROOT / "tests" / "workers" / "mechanism_runs.py"
# The dense runs train 3 steps (parity.base_arguments' 5 cut, the suite's budget; the resumes: 1 after step 2)
STEPS, STOP = 3, 2
DENSE_STEPS = {"max_steps": STEPS, "save_steps": STEPS}
MODELS = {"llama": DENSE_STEPS, "llama4": {"num_hidden_layers": 4, **DENSE_STEPS},
          "gpt3": {"model_name_or_path": "gpt3-tiny", **DENSE_STEPS},
          # DeepSeek-V3 (issue 35): layer 0 dense as published, MTP, the bias rule; 6 micro-batches of 1 (at least
          # 2 x pp3: fleet's PipelineParallelWithInterleave), 2 steps
          "deepseek": {"model_name_or_path": "deepseek-v3-tiny", "num_hidden_layers": 6, "max_steps": 2,
                       "save_steps": 2, "moe_bias_update_rate": 0.01, "per_device_train_batch_size": 2,
                       "gradient_accumulation_steps": 3},
          # Issue 34's mixtures of experts interleaved as DeepSeek-V3 (6 layers, 3 micro-batches of 2, 2 steps):
          # Qwen3-MoE with global-batch balancing (every layer sparse), ERNIE 4.5 MoE with the bias rule (layers 1, 3,
          # 5 MoE: each stage holds a dense and an MoE chunk)
          "qwen3-moe": {"model_name_or_path": "qwen3-moe-tiny", "num_hidden_layers": 6, "max_steps": 2,
                        "save_steps": 2, "moe_global_batch_balance": True, "per_device_train_batch_size": 2,
                        "gradient_accumulation_steps": 3},
          "ernie-moe": {"model_name_or_path": "ernie4_5_moe-tiny", "num_hidden_layers": 6, "max_steps": 2,
                        "save_steps": 2, "moe_bias_update_rate": 0.01, "per_device_train_batch_size": 2,
                        "gradient_accumulation_steps": 3}}
PP2, PP3 = {"pipeline_parallel_degree": 2}, {"pipeline_parallel_degree": 3}
# 8 micro-batches of 1 (the same 8 samples per step): at least 2 x pp, fleet's PipelineParallelWithInterleave
INTERLEAVED = dict(PP3, virtual_pp_degree=2, pipeline_layers_per_stage=[1, 2, 1, 1, 2, 1],
                   per_device_train_batch_size=1, gradient_accumulation_steps=8)
# name -> (model, processes, overrides, expected decoder layers of each stage's chunks)
RUNS = {
    "pp2-3-5": ("llama", 2, dict(PP2, pipeline_layers_per_stage=[3, 5]), [[[0, 1, 2]], [[3, 4, 5, 6, 7]]]),
    # the kernel options through their CPU stand-ins (parity_utils.run_spec: LLM_PRETRAIN_KERNEL_STANDINS=1)
    "pp2-3-5-kernels": ("llama", 2, dict(PP2, pipeline_layers_per_stage=[3, 5], **KERNEL_OPTIONS),
                        [[[0, 1, 2]], [[3, 4, 5, 6, 7]]]),
    "gpt3-pp2-1-7": ("gpt3", 2, dict(PP2, pipeline_layers_per_stage=[1, 7]), [[[0]], [[1, 2, 3, 4, 5, 6, 7]]]),
    # the automatic split and GPT-3's tied head across three stages with the kernel options through their stand-ins
    # (the fast LayerNorm's for GPT-3); pp3-4 and pp3vpp2 keep pp3 on the plain path
    "pp3-8-kernels": ("llama", 3, dict(PP3, **KERNEL_OPTIONS), [[[0, 1]], [[2, 3, 4, 5]], [[6, 7]]]),
    "pp3-4": ("llama4", 3, PP3, [[[0]], [[1, 2]], [[3]]]),
    "gpt3-pp3-kernels": ("gpt3", 3, dict(PP3, **KERNEL_OPTIONS), [[[0, 1]], [[2, 3, 4, 5]], [[6, 7]]]),
    "pp3vpp2": ("llama", 3, INTERLEAVED, [[[0], [4]], [[1, 2], [5, 6]], [[3], [7]]]),
    # the same interleaved uneven split, and an uneven pp3 one, with the kernel options through their stand-ins
    "pp3vpp2-kernels": ("llama", 3, dict(INTERLEAVED, **KERNEL_OPTIONS), [[[0], [4]], [[1, 2], [5, 6]], [[3], [7]]]),
    "pp3-3-2-3-kernels": ("llama", 3, dict(PP3, pipeline_layers_per_stage=[3, 2, 3], **KERNEL_OPTIONS),
                          [[[0, 1, 2]], [[3, 4]], [[5, 6, 7]]]),
    # DeepSeek-V3's MTP block (decoder layer 6) in the last chunk of the last stage: interleaved (fleet's even
    # "layer:DecoderLayer" segmentation, chunk v x 3 + s on stage s) and uneven 1F1B
    "deepseek-pp3vpp2": ("deepseek", 3, dict(PP3, virtual_pp_degree=2), [[[0], [3]], [[1], [4]], [[2], [5, 6]]]),
    "deepseek-pp3-1-3-2": ("deepseek", 3, dict(PP3, pipeline_layers_per_stage=[1, 3, 2]),
                           [[[0]], [[1, 2, 3]], [[4, 5, 6]]]),
    "qwen3-moe-pp3vpp2": ("qwen3-moe", 3, dict(PP3, virtual_pp_degree=2), [[[0], [3]], [[1], [4]], [[2], [5]]]),
    "ernie-moe-pp3vpp2": ("ernie-moe", 3, dict(PP3, virtual_pp_degree=2), [[[0], [3]], [[1], [4]], [[2], [5]]]),
}
# Stopped at step 2 under the first split, resumed under the second (layout-free checkpoints). Under pp3 with
# the kernel options through their stand-ins: a checkpoint of the plain path resumed on the kernels' branches.
RESUMES = {
    "resume-3-5-to-6-2": ("llama", dict(PP2, pipeline_layers_per_stage=[3, 5]), 2,
                          dict(PP2, pipeline_layers_per_stage=[6, 2]), 2, [[[0, 1, 2, 3, 4, 5]], [[6, 7]]]),
    "resume-3-5-to-pp3-kernels": ("llama", dict(PP2, pipeline_layers_per_stage=[3, 5]), 2,
                                  dict(PP3, **KERNEL_OPTIONS), 3,
                          [[[0, 1]], [[2, 3, 4, 5]], [[6, 7]]]),
}


def argument_files(work, corpus) -> dict:
    return {m: write_json(work / f"{m}.json", base_arguments(corpus, work, **o)) for m, o in MODELS.items()}


def runs_of(processes: int, work, corpus) -> list[dict]:
    """The runs of the launch of `processes` (resumes: the first part where it runs, before the second)."""
    files = argument_files(work, corpus)
    runs = [run_spec(name, argv(files[model], work / name, **overrides))
            for name, (model, n, overrides, _) in RUNS.items() if n == processes]
    for name, (model, first, first_n, second, second_n, _) in RESUMES.items():
        if first_n == processes:
            runs.append({"name": f"{name}-first", "argv": argv(files[model], work / name, exit_interval=STOP, **first)})
        if second_n == processes:
            runs.append(run_spec(name, argv(files[model], work / name, **second)))
    return sorted(runs, key=lambda run: "env" in run)  # stand-in runs last: once installed, they stay in the process


# pp2 trains in the session's pp2 launch (tests/shared_launches.py), beside the parity tests' pp2 runs.
contribute("pp2", 2, "uneven", lambda work, corpus: runs_of(2, work, corpus))


PP3_OBSERVED: dict[int, dict] = {}  # the pp3 launch's observations per rank (the stand-in runs' "kernel_calls")


@pytest.fixture(scope="module")
def uneven(shared_launches, embedded_corpus):
    work = shared_launches.work_dir("uneven")
    files = argument_files(work, embedded_corpus)
    run_single([argv(files[m], work / "single" / m) for m in MODELS], work, "single")
    shared_launches.results("pp2", "uneven")  # before pp3: it holds the first parts of resumes under pp3
    pp3 = run_launch(3, runs_of(3, work, embedded_corpus), work, "pp3", timeout=900)
    PP3_OBSERVED.update(pp3.results() if DEVICE == "cpu" else {})
    return work


def test_uneven_stages_train_like_one_process(uneven):
    expected = {name: (model, layers) for name, (model, _, _, layers) in RUNS.items()}
    expected.update({name: (model, layers) for name, (model, *_, layers) in RESUMES.items()})
    for name, (model, layers) in expected.items():
        reference, out = uneven / "single" / model, uneven / name
        step = MODELS[model].get("max_steps", 5)
        diffs = assert_same_training(reference, out, step=step)
        diffs["every_replica"] = assert_every_replica_matches(reference, out, step=step)
        print(f"{name} vs single-process {model}: {diffs}")
        # The mechanism: each stage holds the layers of the split (read from the built PipelineLayer).
        assert run_record(out)["built"]["schedule"]["chunk_layers"] == layers, name
    assert run_record(uneven / "pp3vpp2")["built"]["schedule"]["class"] == "PipelineParallelWithInterleave"
    check_deepseek(uneven)
    check_issue34_moe(uneven)
    assert DEVICE != "cpu" or run_record(uneven / "pp2-3-5-kernels")["built"]["kernels"]["stand_ins"] == [
        "flash_attn", "flash_attn_grad", "fused_rms_norm_quant", "fused_rotary_position_embedding"]
    # pp3's stand-in runs: each stage calls every kernel once per decoder layer it holds (the norms twice, and the
    # last stage's final norm) per micro-batch, in each step it trains (the resume: 1 after step 2); GPT-3 has
    # learned positions (no rotary kernel) and LayerNorm (the fast one's stand-in)
    for name in ("pp3vpp2-kernels", "pp3-3-2-3-kernels", "pp3-8-kernels", "gpt3-pp3-kernels",
                 "resume-3-5-to-pp3-kernels"):
        if name in RUNS:
            model, _, overrides, chunk_layers = RUNS[name]
        else:
            model, *_, overrides, _, chunk_layers = RESUMES[name]
        forwards = (STEPS - STOP if name in RESUMES else STEPS) * overrides.get("gradient_accumulation_steps", 4)
        counts = []
        for stage, chunks in enumerate(chunk_layers):
            layers = sum(len(chunk) for chunk in chunks)
            norms = forwards * (2 * layers + (stage == len(chunk_layers) - 1))
            counts.append({"flash_attn": forwards * layers, "flash_attn_grad": forwards * layers,
                           **({"fast_ln": norms} if model == "gpt3" else {
                               "fused_rotary_position_embedding": forwards * layers, "fused_rms_norm_quant": norms})})
        assert_stand_ins_ran([PP3_OBSERVED[rank]["observations"][str(uneven / name)] for rank in sorted(PP3_OBSERVED)],
                             uneven / name, tuple(counts[0]), counts)


def check_deepseek(uneven) -> None:
    """DeepSeek-V3 (issue 35) interleaved and in uneven 1F1B stages (the parity and chunk layers above): fleet's
    schedule class and 2 virtual stages, the MTP block (decoder layer 6) in the last chunk of the last stage, the
    MTP losses, the router metrics (the MTP block's router among them, its statistics carried through every chunk)
    and the router biases of the five MoE layers and the MTP block moved as one process's."""
    reference = uneven / "single" / "deepseek"
    for name, cls, stages in (("deepseek-pp3vpp2", "PipelineParallelWithInterleaveFthenB", 2),
                              ("deepseek-pp3-1-3-2", "PipelineParallel", 1)):
        schedule = run_record(uneven / name)["built"]["schedule"]
        assert schedule["class"] == cls and schedule["virtual_stages"] == stages, (name, schedule)
        assert schedule["chunk_layers"][-1][-1][-1] == 6, (name, schedule)  # the MTP block: last
        ref, got = train_records(reference), train_records(uneven / name)
        assert all(abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-5 for a, b in zip(ref, got, strict=True)), (ref, got)
        assert_same_router_metrics(reference, uneven / name)
        assert_same_router_biases(reference, uneven / name,
                                  expected=tuple(f"layers.{i}.mlp" for i in range(1, 6)) + ("mtp.block.mlp",))


def check_issue34_moe(uneven) -> None:
    """Qwen3-MoE (global-batch balancing) and ERNIE 4.5 MoE (the bias rule) interleaved (issue 34; the parity and
    chunk layers above): fleet's schedule class and 2 virtual stages, the router metrics of every MoE layer carried
    through the chunks (models/pipeline.py RouterCarry) and ERNIE's correction biases (layers 1, 3, 5: one on every
    stage, beside a dense chunk) moved as one process's."""
    for name, model, biased in (("qwen3-moe-pp3vpp2", "qwen3-moe", ()),
                                ("ernie-moe-pp3vpp2", "ernie-moe", ("layers.1.mlp", "layers.3.mlp", "layers.5.mlp"))):
        record = run_record(uneven / name)
        assert record["model_config"]["family"] == MODELS[model]["model_name_or_path"].removesuffix("-tiny").replace(
            "-", "_"), record["model_config"]
        schedule = record["built"]["schedule"]
        assert schedule["class"] == "PipelineParallelWithInterleaveFthenB" and schedule["virtual_stages"] == 2, (
            name, schedule)
        assert_same_router_metrics(uneven / "single" / model, uneven / name)
        if biased:
            assert_same_router_biases(uneven / "single" / model, uneven / name, expected=biased)


@pytest.mark.parametrize("overrides, words", [
    (dict(PP2, pipeline_layers_per_stage=[3, 4]), ["pipeline_layers_per_stage", "sums to 7", "num_hidden_layers 8"]),
    (dict(PP2, pipeline_layers_per_stage=[0, 8]), ["pipeline_layers_per_stage", "empty"]),
    (dict(PP2, pipeline_layers_per_stage=[2, 2, 4]), ["pipeline_layers_per_stage", "3 entries", "needs 2"]),
    ({"pipeline_layers_per_stage": [8]}, ["pipeline_layers_per_stage", "pipeline_parallel_degree > 1"]),
    (dict(PP3, virtual_pp_degree=2), ["virtual_pp_degree 2", "[0, 2, 2, 2, 2, 0]", "empty"]),  # automatic
    (dict(INTERLEAVED, per_device_train_batch_size=2, gradient_accumulation_steps=4),
     ["gradient_accumulation_steps", "4", "pipeline_parallel.py:3482"]),
    # schedules fleet cannot run here, refused with the Paddle line that stops them
    (dict(PP2, pipeline_parallel_config="use_dualpipev", gradient_accumulation_steps=2, per_device_train_batch_size=4),
     ["gradient_accumulation_steps", "dualpipev.py:703"]),
    (dict(PP3, pipeline_parallel_config="use_dualpipev", virtual_pp_degree=2, per_device_train_batch_size=1,
          gradient_accumulation_steps=8), ["use_dualpipev", "pp_layers.py:445-447"]),
    (dict(PP2, pipeline_parallel_config="use_dualpipev", do_eval=True), ["use_dualpipev", "pipeline_parallel.py:1383"]),
    (dict(PP2, pipeline_parallel_config="best_unbalanced_scheduler"), ["best_unbalanced_scheduler", "model.py:148-162"]),
] + ([] if paddle_has_deep_ep() else [  # a Paddle build without DeepEP (this CPU one) cannot run DualPipeV
    (dict(PP2, pipeline_parallel_config="use_dualpipev"), ["use_dualpipev", "deep_ep", "dualpipev.py:28-31"]),
]) + [
    (dict(PP2, pipeline_parallel_config="zero_bubble"), ["pipeline_parallel_config", "'zero_bubble'", "use_dualpipev"]),
])
def test_bad_split_is_one_line_before_fleet(embedded_corpus, tmp_path, monkeypatch, overrides, words):
    """A UsageError (printed as one `error:` line, exit 2, by run_pretrain: tests/test_strategy_validation.py)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError
    from llm_pretrain.run_pretrain import run as train  # the preflight, then the trainer

    args_file = write_json(tmp_path / "args.json", base_arguments(embedded_corpus, tmp_path, **overrides))
    args, warnings = parse_arguments([str(args_file), "--output_dir", str(tmp_path / "out")])
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", str(overrides.get("pipeline_parallel_degree", 1)))
    with pytest.raises(UsageError) as error:
        train(args, warnings)
    message = str(error.value)
    assert all(word in message for word in words) and "\n" not in message, message
    assert not (tmp_path / "out").exists()


def test_automatic_split_is_fleets_uniform_segmentation():
    """The automatic split (layout.pipeline_split) is what fleet's SegmentLayers "uniform" gives PaddleNLP."""
    from paddle.distributed.fleet.meta_parallel.parallel_layers.pp_layers import SegmentLayers

    from llm_pretrain.parallel.layout import pipeline_split

    for layers, stages in ((4, 3), (8, 3), (70, 12), (10, 3), (13, 4), (31, 6), (30, 4)):
        items = layers + 3  # embedding, decoder layers, final norm, head
        bounds = SegmentLayers([None] * items, stages).uniform(items, stages)
        decoder_before = [min(max(b - 1, 0), layers) for b in bounds]
        assert pipeline_split(layers, stages) == [b - a for a, b in zip(decoder_before, decoder_before[1:])]
    assert pipeline_split(70, 12) == [5] + [6] * 10 + [5]  # BLOOM-176B (Megatron-DeepSpeed: 72 = 12 x 6 items)
    assert pipeline_split(8, 4, 2) == [1] * 8


# fleet's newer schedules, chosen through pipeline_parallel_config (paddle/distributed/fleet/model.py:140-162).
SCHEDULES = {  # name -> (processes, overrides, class, expected chunk layers, expected order of stage s)
    # pp4 x 2 virtual stages with 4 micro-batches (pp <= micro-batches < 2 pp) and PaddleNLP's option
    "vpp-balanced": (4, dict(pipeline_parallel_degree=4, virtual_pp_degree=2,
                             pipeline_parallel_config="best_unbalanced_scheduler"),
                     "VPPFhenBInBalancedMemory", [[[s], [s + 4]] for s in range(4)],
                     lambda stage: fthenb_balanced(stage, 4, 2, 4)),
    # the same without the option: fleet's PipelineParallelWithInterleaveFthenB (model.py:153-163), every
    # micro-batch forward through both chunks, then every backward
    "vpp-fthenb": (4, dict(pipeline_parallel_degree=4, virtual_pp_degree=2),
                   "PipelineParallelWithInterleaveFthenB", [[[s], [s + 4]] for s in range(4)],
                   lambda stage: ["F0"] * 4 + ["F1"] * 4 + ["B1"] * 4 + ["B0"] * 4),
}


# PipelineParallelWithInterleaveFthenB needs no option: fleet's degrees are those of the session's pp4
# launch (tests/shared_launches.py), where it trains beside the parity and mechanism tests' pp4 runs.
SHARED_SCHEDULES = {"vpp-fthenb": "pp4"}
contribute("pp4", 4, "uneven", lambda work, corpus: [
    {"name": name, "argv": argv(argument_files(work, corpus)["llama"], work / name, **SCHEDULES[name][1])}
    for name in SHARED_SCHEDULES])


def test_fleet_schedules_train_like_one_process(uneven, shared_launches):
    """Each schedule in a launch of its own fleet configuration (fleet is initialized once per process:
    best_unbalanced_scheduler is one of its pp_configs), through the mechanism probes
    (tests/workers/mechanism_runs.py), which record each stage's order of forwards and backwards per chunk."""
    files = {"llama": uneven / "llama.json"}
    observed = {}
    for name, (processes, overrides, _, _, _) in SCHEDULES.items():
        if name in SHARED_SCHEDULES:
            observed[name] = shared_launches.results(SHARED_SCHEDULES[name], "uneven")
            continue
        spec = write_json(uneven / f"{name}.runs.json",
                          [{"name": name, "argv": argv(files["llama"], uneven / name, **overrides)}])
        result = launch(MECHANISM_WORKER, processes, [str(spec)], log_dir=uneven / f"{name}.log", timeout=900)
        observed[name] = result.check().results()
    for name, (processes, _, cls, layers, expected_order) in SCHEDULES.items():
        # The order first: forcing another schedule class (without best_unbalanced_scheduler fleet builds
        # PipelineParallelWithInterleaveFthenB, all forwards then all backwards) fails here.
        for stage in range(processes):
            order = first_step(observed[name][stage][name]["schedule_order"], 4, 2)
            assert order == expected_order(stage), f"{name} stage {stage}: {order}"
        diffs = assert_same_training(uneven / "single" / "llama", uneven / name, step=STEPS)
        diffs["every_replica"] = assert_every_replica_matches(uneven / "single" / "llama", uneven / name, step=STEPS)
        print(f"{name} vs single-process llama: {diffs}")
        schedule = run_record(uneven / name)["built"]["schedule"]
        assert schedule["class"] == cls and schedule["chunk_layers"] == layers, (name, schedule)


def test_schedule_orders_tell_the_schedules_apart():
    """The expected orders (tests/schedule_orders.py) differ where the test above reads them: at 4
    micro-batches over pp4 x 2, VPPFhenBInBalancedMemory differs from plain FthenB on stages 1-3 and
    from the interleaved order on stages 1-2 (stages 0 and 3 coincide there)."""
    fthenb = ["F0"] * 4 + ["F1"] * 4 + ["B1"] * 4 + ["B0"] * 4
    assert [fthenb_balanced(s, 4, 2, 4) != fthenb for s in range(4)] == [False, True, True, True]
    assert [fthenb_balanced(s, 4, 2, 4) != interleaved(s, 4, 2, 4) for s in range(4)] == [False, True, True, False]
