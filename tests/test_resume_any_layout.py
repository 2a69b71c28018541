"""Stop under one parallel layout, resume under another: the same losses as one process (issue 15).

Every pair trains layout A for 2 steps and stops with a checkpoint (exit_interval 2), then the
same output_dir resumes under layout B to step 4; the per-step losses and grad norms of steps
1-4 and the final weights must equal one process running 4 steps (1e-5, fp32). Without
resharding (weights or optimizer state lost, or a slice read from the wrong place) step 3
already differs.

    pair                     model                                   what it exercises
    1 process -> stage1      llama-tiny (GQA: 2 kv heads of 4)       stage-1 optimizer-state assignment
    4 processes -> 2         llama-tiny, tp2 x sd2 stage1 -> pp2     world size, tensor + sharding -> pipeline
    stage2 -> tp2            llama-tiny                              stage-2 owners -> vocab/column/row slices
    dp2 -> 1 process         llama-tiny                              replicas written once; micro-batch 2 -> 4
    dp2 -> 1 process         llama-tiny, 2 layers, wsd               warmup-stable-decay resumed mid-decay (the
                                                                     scheduler's step in the checkpoint's index)
    tp2 -> pp2               llama-tiny with fused q|k|v, gate|up    per-part slices of fused projections
                                                                     (every tp2 run with sequence parallelism)
    pp2 -> stage1            gpt3-tiny (tied embeddings)             the last stage's tied copy
    pp4 interleaved -> tp2 x sd2  gpt3-tiny (tied)                   virtual stages, tied copy, 4 -> 4
    tp2 -> stage2            gpt3-tiny                               loaded into stage 2's fused buffers
    stage3 -> dp2            llama-real (above 2**20: sliced)        Paddle's stage-3 flat slices, saved
    1 process -> stage3      llama-real                              ... and loaded into the slices

Issues 34 and 35's families (2 layers, DeepSeek-V3 3) train 2 steps, stop after 1 and resume for step 2 (the
suite's CPU budget):

    tp2 -> pp2 uneven        deepseek-v3-tiny, 3 layers (MLA, 1 dense MLA's heads split, its latent projections
    [2, 1]                   + 2 MoE layers, MTP; bias rule on,      whole -> uneven 1F1B stages (layers 0-1, then
                             rate 0.01)                              layer 2 and MTP on the last); the routers'
                                                                     correction biases (layers 1 and 2's, the MTP
                                                                     block's) read back and moved on
    stage2 -> dp2            ernie4_5_moe-tiny (bias rule on)        its correction bias (no optimizer state)
                                                                     out of stage 2 into dp replicas
    dp2 x ep2 -> 1 process   qwen3-moe-tiny (16 experts, top 4;      each expert and its AdamW states, written by
                             Qwen3's q/k norms)                      the rank holding it, regrouped whole
    tp2 -> pp2               qwen3-tiny (q/k norms per head, head_dim  tp's halves of q|k|v (32 apart from hidden /
                             32, GQA 4:2, tied embeddings)           heads), SP's replicated q/k norms written once
                                                                     -> whole layers a stage, the tied copy on the last
    pp2 -> stage3            ernie4_5-tiny (tied embeddings, head_dim  the last stage's tied copy dropped, read
                             32, GQA 4:2)                            into stage 3's managed parameters

Their router metrics (aux loss, expert load, drops) of every step equal one process's too, and the correction
biases after the last step (within 1e-7: a whole number of rate steps each). Not reading the biases back
(mutation correction_bias_not_resumed) fails the DeepSeek-V3 and ERNIE 4.5 MoE pairs.

The global batch is 8 samples in every layout (gradient_accumulation_steps 4 / data replicas),
so the samples of each step are the same. Launches are grouped by layout (fleet is initialized
once per process); the order below makes every A run before its B (ep over dp is
the dp2 launch: fleet's groups are the same). Six of them train in the
session's shared launch of their degrees (tests/shared_launches.py), beside other files' runs.
"""

from __future__ import annotations

import json
import math

import pytest

from parity_utils import argv, assert_same_router_biases, assert_same_router_metrics, assert_same_training, \
    base_arguments, run_launch, run_record, run_single, train_records, write_json
from shared_launches import contribute, once

STEPS, STOP = 4, 2
SHORT_STEPS, SHORT_STOP = 2, 1  # issues 34/35's families (MODELS' SHORT): within the suite's CPU budget
SHORT = {"max_steps": SHORT_STEPS, "save_steps": SHORT_STEPS, "num_hidden_layers": 2}  # (base_arguments: 8)
SD2 = {"sharding": "stage1", "gradient_accumulation_steps": 2}
LAYOUTS = {  # name -> (processes, overrides)
    "single": (1, {}),
    "single_mb4": (1, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}),
    "sd2_stage1": (2, SD2),
    "sd2_stage2": (2, {**SD2, "sharding": "stage2"}),
    "sd2_stage3": (2, {**SD2, "sharding": "stage3"}),
    "tp2": (2, {"tensor_parallel_degree": 2, "sequence_parallel": True}),  # SP: same weights, other grads path
    "pp2": (2, {"pipeline_parallel_degree": 2}),
    # uneven 1F1B stages (fleet's list of boundaries; DeepSeek-V3's 3 layers: 0-1, then 2 and the MTP block)
    "pp2_2_1": (2, {"pipeline_parallel_degree": 2, "pipeline_layers_per_stage": [2, 1]}),
    "dp2": (2, {"gradient_accumulation_steps": 2}),
    "dp2_ep2": (2, {"gradient_accumulation_steps": 2, "expert_parallel_degree": 2}),  # fleet's dp2 launch (ep over dp)
    "tp2sd2": (4, {**SD2, "tensor_parallel_degree": 2}),
    "pp4vpp2": (4, {"pipeline_parallel_degree": 4, "virtual_pp_degree": 2}),
}
PAIRS = [  # (model, layout A, layout B)
    ("llama", "single", "sd2_stage1"),
    ("llama", "tp2sd2", "pp2"),
    ("llama", "sd2_stage2", "tp2"),
    ("llama", "dp2", "single_mb4"),
    ("llama_wsd", "dp2", "single_mb4"),
    ("llama_fused", "tp2", "pp2"),
    ("gpt3", "pp2", "sd2_stage1"),
    ("gpt3", "pp4vpp2", "tp2sd2"),
    ("gpt3", "tp2", "sd2_stage2"),
    ("real", "sd2_stage3", "dp2"),
    ("real", "single", "sd2_stage3"),
    ("deepseek", "tp2", "pp2_2_1"),
    ("ernie4_5_moe", "sd2_stage2", "dp2"),
    ("qwen3_moe", "dp2_ep2", "single"),
    ("qwen3", "tp2", "pp2"),
    ("ernie4_5", "pp2", "sd2_stage3"),
]
# Launches in an order that runs every A before its B (sd2 and single twice: the pairs form cycles).
# The three sharding stages share one fleet layout (sharding degree 2), so "sd2" runs any of them.
LAUNCH_ORDER = [("single", 1), ("pp4vpp2", 4), ("tp2sd2", 4), ("sd2", 2), ("tp2", 2), ("pp2", 2), ("sd2", 2),
                ("dp2", 2), ("single", 1)]
MODELS = {
    "llama": {},
    "llama_fused": {"fuse_attention_qkv": True, "fuse_attention_ffn": True},
    "gpt3": {"model_name_or_path": "gpt3-tiny"},
    # warmup 1 step, held at step 2, 1-sqrt decay over steps 2-4: the stop at step 2 resumes mid-decay
    "llama_wsd": {"num_hidden_layers": 2, "lr_scheduler_type": "wsd", "wsd_decay_ratio": 0.5,
                  "wsd_decay_style": "1-sqrt"},
    # Weight decay 0.1 (not the 0.01 of the other models): Paddle's stage 3 renames sliced parameters
    # ("slice@..."), which the decay filter handles (llm_pretrain/parallel/optim.py decays_parameter); missing
    # them would differ from one process by more than the tolerance (3e-4 in loss at decay 1.0).
    "real": {"model_name_or_path": "llama-real", "num_hidden_layers": 2, "weight_decay": 0.1},
    # Issues 34 and 35 (2 layers each): DeepSeek-V3 (1 dense + 1 MoE layer, MLA, MTP) and ERNIE 4.5 MoE with the
    # auxiliary-loss-free bias rule on, so that the routers' correction biases have moved by the stop and must be
    # read back to continue; Qwen3-MoE (16 experts, every layer sparse; Qwen3's attention with its q/k norms). Their
    # tiny presets have 2 layers; they train 2 steps, stopped after 1 (SHORT_STOP), within the suite's CPU budget
    # (measured: 4 steps and a Qwen3 tp2 -> 1 pair ~17 s of CPU; these three ~9.6 s)
    # DeepSeek-V3 with 3 layers (1 dense, 2 MoE) so that pp2's stages are uneven (pp2_2_1): measured no dearer than
    # 2 layers under an even pp2 (10.3 s against 10.5 s of the reference and both parts, at load 9)
    "deepseek": {"model_name_or_path": "deepseek-v3-tiny", "moe_bias_update_rate": 0.01, **SHORT,
                 "num_hidden_layers": 3},
    "ernie4_5_moe": {"model_name_or_path": "ernie4_5_moe-tiny", "moe_bias_update_rate": 0.01, **SHORT},
    "qwen3_moe": {"model_name_or_path": "qwen3-moe-tiny", **SHORT},
    # Issue 34's dense families (2 layers, 2 steps, SHORT): Qwen3's q/k norms under tp2 + SP -> pp2, ERNIE 4.5's tied
    # head from pp2's last stage into stage 3 (measured: ~1 s of CPU a pair, s11-34b)
    "qwen3": {"model_name_or_path": "qwen3-tiny", **SHORT},
    "ernie4_5": {"model_name_or_path": "ernie4_5-tiny", **SHORT},
}
# the router blocks holding a correction bias (parity_utils.assert_same_router_biases)
BIASED = {"deepseek": ("layers.1.mlp", "layers.2.mlp", "mtp.block.mlp"), "ernie4_5_moe": ("layers.1.mlp",)}
# the decoder layers of each stage's chunks under an explicit split (the mechanism: fleet's even split would differ)
CHUNK_LAYERS = {("deepseek", "pp2_2_1"): [[[0, 1]], [[2, 3]]]}  # 3: DeepSeek-V3's MTP block, on the last stage
MIXTURES = ("deepseek", "ernie4_5_moe", "qwen3_moe")


def _launch_group(layout: str) -> str:
    return layout.split("_")[0]  # sd2_stage1/2/3 share fleet's layout (sharding degree 2); single_mb4 is one process


def _pair_name(model: str, a: str, b: str) -> str:
    return f"{model}-{a}-to-{b}"


def argument_files(work, corpus) -> dict:
    return {model: write_json(work / f"{model}.json", base_arguments(
        corpus, work, **{"max_steps": STEPS, "save_steps": STEPS, **overrides})) for model, overrides in MODELS.items()}


def steps_of(model: str) -> tuple[int, int]:
    """(steps, the step the first part stops at) of the model's pairs."""
    return (SHORT_STEPS, SHORT_STOP) if MODELS[model].get("max_steps") == SHORT_STEPS else (STEPS, STOP)


def references(work) -> dict:
    return {model: work / "single" / model for model in MODELS}


def plan() -> list[list[tuple[str, str, str, str]]]:
    """The runs of each launch of LAUNCH_ORDER, [(model, layout, pair name, "A" or "B")]: every pair's A
    part in the first launch of its layout, its B part in the first launch of B's layout after that."""
    done: set[tuple[str, str]] = set()  # (pair name, "A" or "B") already run
    planned = []
    for group, _ in LAUNCH_ORDER:
        runs = []
        for model, a, b in PAIRS:
            name = _pair_name(model, a, b)
            for role, layout in (("A", a), ("B", b)):
                if (name, role) in done or _launch_group(layout) != group:
                    continue
                if role == "B" and (name, "A") not in done:
                    continue
                runs.append((model, layout, name, role))
                done.add((name, role))
        planned.append(runs)
    assert len(done) == 2 * len(PAIRS), f"the launch order leaves pairs unfinished: {done}"
    return planned


def launch_runs(index: int, work, corpus) -> list[list[str]]:
    """run_pretrain arguments of launch `index` (launch 0: the references first)."""
    files = argument_files(work, corpus)
    runs = [argv(files[model], references(work)[model]) for model in MODELS] if index == 0 else []
    return runs + [argv(files[model], work / "runs" / name, **LAYOUTS[layout][1],
                        **({"exit_interval": steps_of(model)[1]} if role == "A" else {}))
                   for model, layout, name, role in plan()[index]]


def first_launch(work, corpus) -> None:
    """Launch 0 (one process: the references and the first parts under one process), once per session
    (a shared launch needing it may run on the other xdist worker)."""
    once(work / "launch0.done", lambda: run_single(launch_runs(0, work, corpus), work, "launch0-single"))


# Launches of LAUNCH_ORDER that train in the session's shared launch of their degrees
# (tests/shared_launches.py), beside the parity and mechanism tests' runs: index -> shared launch.
# The others (the second sd2 and the last single) run here, after them.
SHARED = {1: "pp4", 2: "tp2sd2", 3: "sd2", 4: "tp2", 5: "pp2", 7: "dp2"}


def _first_parts_launches(index: int) -> set[int]:
    """The launches holding the A parts of launch `index`'s B parts."""
    planned = plan()
    return {i for name in (name for _, _, name, role in planned[index] if role == "B")
            for i, runs in enumerate(planned) if (name, "A") in {(n, r) for _, _, n, r in runs}}


def _shared_contribution(index: int):
    def make_runs(work, corpus) -> list[dict]:
        if 0 in _first_parts_launches(index):
            first_launch(work, corpus)
        return [{"name": f"{index}-{i}", "argv": run} for i, run in enumerate(launch_runs(index, work, corpus))]
    return make_runs


for _index, _launch in SHARED.items():
    _after = {SHARED[i] for i in _first_parts_launches(_index) if i != 0}
    assert all(i == 0 or i in SHARED for i in _first_parts_launches(_index)), \
        f"launch {_index} resumes runs of a launch this file runs itself, after the shared ones"
    contribute(_launch, LAUNCH_ORDER[_index][1], "resume", _shared_contribution(_index), after=tuple(sorted(_after)))


@pytest.fixture(scope="module")
def resumed(shared_launches, embedded_corpus):
    """Run every reference and pair; returns (work dir, model -> reference output_dir)."""
    work = shared_launches.work_dir("resume")
    first_launch(work, embedded_corpus)
    for index, (group, processes) in enumerate(LAUNCH_ORDER[1:], start=1):
        if index in SHARED:
            shared_launches.results(SHARED[index], "resume")
        elif processes == 1:
            run_single(launch_runs(index, work, embedded_corpus), work, f"launch{index}-{group}")
        else:
            run_launch(processes, launch_runs(index, work, embedded_corpus), work, f"launch{index}-{group}",
                       timeout=900)
    return work, references(work)


@pytest.mark.parametrize("model,a,b", PAIRS, ids=[_pair_name(*p) for p in PAIRS])
def test_resume_under_another_layout(resumed, model, a, b):
    work, references = resumed
    out = work / "runs" / _pair_name(model, a, b)
    steps, stop = steps_of(model)
    diffs = assert_same_training(references[model], out, step=steps)
    print(f"{out.name}: {diffs}")
    assert [r["step"] for r in train_records(out)] == list(range(1, steps + 1))
    if model in MIXTURES:  # aux loss, expert load and drops of every step; the biases moved as one process's
        assert_same_router_metrics(references[model], out)
    if model in BIASED:
        assert_same_router_biases(references[model], out, step=steps, expected=BIASED[model])
    if "lr_scheduler_type" in MODELS[model]:  # every step's rate is the closed form, before and after the resume
        top, bottom = 0.003, 0.0003  # parity.base_arguments' learning_rate and min_learning_rate
        expected_rates = [top, top, bottom + (1 - math.sqrt(1 / 2)) * (top - bottom), bottom]
        assert [r["learning_rate"] for r in train_records(out)] == pytest.approx(expected_rates, rel=1e-9)
    run = run_record(out)  # the second run: resumed at step 2, under layout B
    assert run["start_step"] == stop
    expected = LAYOUTS[b][1]
    assert run["layout"]["world_size"] == LAYOUTS[b][0]
    for key, value in (("tensor_parallel_degree", expected.get("tensor_parallel_degree", 1)),
                       ("pipeline_parallel_degree", expected.get("pipeline_parallel_degree", 1)),
                       ("sharding_stage", int(expected.get("sharding", "stage0")[-1]))):
        assert run["layout"][key] == value, (key, run["layout"])
    if (model, b) in CHUNK_LAYERS:
        assert run["built"]["schedule"]["chunk_layers"] == CHUNK_LAYERS[model, b], run["built"]["schedule"]


def test_stage3_checkpoint_holds_flat_slices_of_sliced_parameters(resumed):
    """llama-real under stage 3: Paddle slices parameters above 2**20 elements; each rank wrote its
    flat range (several boxes) and the index covers each tensor exactly once."""
    work, _ = resumed
    index = json.loads((work / "runs" / _pair_name("real", "sd2_stage3", "dp2") / f"checkpoint-{STOP}"
                        / "tensors.index.json").read_text())
    embedding = index["tensors"]["embeddings.word_embeddings.weight"]
    assert embedding["shape"] == [8320, 1024]
    assert {s["file"] for s in embedding["slices"]} == {"tensors.rank00000.safetensors",
                                                        "tensors.rank00001.safetensors"}
    moment = index["tensors"]["embeddings.word_embeddings.weight/moment1_0"]
    assert len({s["file"] for s in moment["slices"]}) == 2
    for name, entry in index["tensors"].items():
        assert sum(math.prod(s["shape"]) for s in entry["slices"]) == math.prod(entry["shape"]), name


def test_replicas_are_written_once(resumed):
    """dp2 and tp2: every tensor's slices are disjoint, replicated tensors appear in one file (Qwen3's q/k norms,
    whole on both tp ranks, among them)."""
    work, _ = resumed
    for model, a, b in (("llama", "dp2", "single_mb4"), ("llama_fused", "tp2", "pp2"), ("qwen3", "tp2", "pp2")):
        pair = _pair_name(model, a, b)
        checkpoint = work / "runs" / pair / f"checkpoint-{steps_of(model)[1]}"
        index = json.loads((checkpoint / "tensors.index.json").read_text())
        if model == "qwen3":
            norms = [name for name in index["tensors"] if name.endswith(("q_norm.weight", "k_norm.weight"))]
            assert len(norms) == 4 and all(len(index["tensors"][n]["slices"]) == 1 for n in norms), norms
        for name, entry in index["tensors"].items():
            assert sum(math.prod(s["shape"]) for s in entry["slices"]) == math.prod(entry["shape"]), (pair, name)
        files = {s["file"] for e in index["tensors"].values() for s in e["slices"]}
        assert len(files) == 2, (pair, files)  # both ranks write a share


def test_experts_under_ep2_are_written_by_the_rank_holding_them(resumed):
    """Qwen3-MoE stopped under ep2 over dp2: each of the 16 experts of each layer is one logical tensor with its AdamW
    states, written by the rank holding it (experts 0-7 rank 0, 8-15 rank 1), which one process then reads whole."""
    work, _ = resumed
    index = json.loads((work / "runs" / _pair_name("qwen3_moe", "dp2_ep2", "single") / f"checkpoint-{SHORT_STOP}"
                        / "tensors.index.json").read_text())
    written = {}  # expert -> the files holding its weights and states
    for name, entry in index["tensors"].items():
        if ".experts." in name:
            expert = int(name.split(".experts.")[1].split(".")[0])
            written.setdefault(expert, set()).update(s["file"] for s in entry["slices"])
    assert written == {e: {f"tensors.rank{e // 8:05d}.safetensors"} for e in range(16)}, written
    assert "layers.1.mlp.experts.15.down_proj.weight/moment2_0" in index["tensors"]
