"""Every parallel layout trains exactly like one process: same losses, grad norms and final weights.

References run once in one plain process (the tiny preset of every family record: LLaMA with 8 layers,
the other families with 2 (FAMILY_LAYERS) and again with 8 for the interleaved pp4 (8 chunks); plus llama3-tiny, Llama 3.1's rotary scaling, in every 2-process launch and pp4;
mixtral-tiny in pp2 x tp2 and pp4; mixtral-tiny and qwen2-moe-tiny with 4 layers for 2 steps in dp2, the
uneven pp2 split and sd2; deepseek-v3-tiny with its bias rule on for 2 steps in dp2, tp2, tp2 + SP, pp2 and sd2
stage 1; qwen3-moe-tiny (2 layers, 2 steps of one micro-batch) in tp2 and tp2 + SP; qwen3-moe-tiny, ernie4_5_moe-tiny, qwen3-tiny and ernie4_5-tiny with 2 layers for 2 steps in dp2, pp2 and sd2 stage 1).
Each
test is one `paddle.distributed.launch` that runs several trainings with the same degrees, each
compared with its reference (tolerance 1e-5, fp32); the dp2, tp2, pp2, sd2, tp2 x sd2 and pp4 runs
train in the session's launch of their degrees, beside other files' runs (tests/shared_launches.py).
The pp2 and pp4vpp2 LLaMA runs also evaluate (eval batch 4 over training micro-batches of 2) and match the single
process's eval losses:

    2 processes: dp2 (every family, Llama 3.1, both mixtures of experts and DeepSeek-V3's router biases; resume)
                 tp2 (+ SP, recompute granularities, resume; every family with and without SP;
                      Qwen2 with one kv head: replicated)
                 pp2 (1F1B, recompute, resume, every family: tied embeddings for GPT-3, Bloom, Qwen2;
                      uneven stages: Llama 3.1 [3, 5], the mixtures of experts [1, 3])
                 sharding degree 2, stages 1/2/3 (each alone and with recompute, resume; every
                 family, Llama 3.1 and both mixtures of experts in every stage, with recompute)
                 two nodes of one process each (dp2)
    4 processes: dp2 x tp2 | pp2 x tp2 | sharding2 x tp2 | pp4 with 2 virtual stages (every
                 family, Llama 3.1, Mixtral) | sharding2 x dp2

The runs of the shared launches train under the mechanism probes (tests/workers/mechanism_runs.py), so
the runs added for Llama 3.1 and the mixtures of experts also check that the layout ran (mechanism(...)
below): gradients local until the last micro-batch (dp2), the stage's wrappers and the recomputed layers
(sd2), each stage's layers (pp2, uneven pp2), the schedule and its chunks (pp4), TP + SP (tp2).

The global batch is 8 samples (gradient_accumulation_steps = 4 / data replicas), but for qwen3-moe-tp (2: one micro-batch).

The dp2, tp2, pp2, sd2 and pp4 launches also train runs named *-kernels: flash attention, the fused rotary
embedding, RMSNorm and LayerNorm on (and swiglu) through their CPU stand-ins (llm_pretrain/cpu/kernel_standins.py,
LLM_PRETRAIN_KERNEL_STANDINS=1 for that run only), against the same single-process references on the plain
path; each also must have called its stand-ins on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch_utils import REPO_ROOT, free_port, launcher_process_args, process_env
from models.families import FAMILIES as FAMILY_RECORDS
from models.registry import ARCHITECTURES
from parity_utils import (
    DEVICE, KERNEL_OPTIONS, TRAIN_RUNS, argv, assert_every_replica_matches, assert_same_router_biases,
    assert_same_router_metrics, assert_same_training, assert_stand_ins_ran, base_arguments, final_weights, run_launch, run_record, run_single,
    run_spec, summary_records, train_records, write_json,
)
from shared_launches import contribute

# Every family's tiny preset (models/families/<family>.py); LLaMA's is the main reference ("llama").
# qwen2-tiny: one kv head (replicated under tp2) and a tied head (shared across pipeline stages).
# Mixture-of-experts families (mixtral, qwen2_moe) have their own layouts' parity tests (tests/test_expert_parallel.py);
# mixtral and qwen2-moe join the dp2, uneven pp2 and sd2 launches here (MOE_SHORT); mixtral the interleaved pp4
# and pp2 x tp2 (MOE).
# Issue 34's families, trained in tp2 (+ SP) here with 2 layers for 5 steps (and Qwen3 in sep2/cp2,
# tests/test_long_context.py): Qwen3, ERNIE 4.5 and ERNIE 4.5 MoE (layer 0 dense, 1 MoE with the correction bias
# and shared experts); besides, LAYOUT_SHORT below. Their other layouts llm_pretrain/parallel/layout.py
# PROVEN_DEGREES refuses; the other launches (the 4-process ones, the mechanism files) do not train them, but for
# Qwen3's and ERNIE 4.5's interleaved pp4 (INTERLEAVED_SHORT).
TP_ONLY = ("qwen3", "ernie4_5", "ernie4_5_moe")
FAMILIES = tuple(family.tiny.removesuffix("-tiny") for family in FAMILY_RECORDS.values()
                 if family.name != "llama" and not family.architectures[family.tiny].is_moe
                 and family.tiny.removesuffix("-tiny") not in TP_ONLY)
ROPE_SCALED = ("llama3",)  # Llama 3.1 (LLaMA's decoder with its rotary scaling and GQA): every launch
MOE = ("mixtral",)  # 8 layers, 5 steps: pp2 x tp2 and the interleaved pp4 (8 chunks), evaluating
# The mixtures of experts' runs added for the README's table train 2 steps ("<family>-short": 4 layers, an 8-layer
# MoE run of 5 steps costs ~4 times a dense one): data parallel, uneven stages and sharding (without expert
# parallelism; tests/test_expert_parallel.py trains Mixtral's stages 1 and 2 with ep over the sharding ranks).
SHORT = {"max_steps": 2, "save_steps": 2}
MOE_SHORT = tuple(f"{family.tiny.removesuffix('-tiny')}-short" for family in FAMILY_RECORDS.values()
                  if family.architectures[family.tiny].is_moe
                  and family.name not in ("qwen3_moe", "deepseek_v3", "ernie4_5_moe"))  # mixtral-, qwen2-moe-short
# (Qwen3-MoE and ERNIE 4.5 MoE: LAYOUT_SHORT below; DeepSeek-V3: DEEPSEEK_SHORT below;
# llm_pretrain/parallel/layout.py refuses their other layouts)
SHORT_FILES = {name: (name.removesuffix("-short"), 4) for name in MOE_SHORT}  # name -> (preset, layers)
# DeepSeek-V3 (issue 35) in dp2, tp2 (+ SP, check_deepseek_tp2), pp2 (check_deepseek_pp2) and sd2 stages 1-3
# (check_deepseek_sd2): its tiny preset (1 dense + 1 MoE layer, MTP) with the auxiliary-loss-free bias
# rule on, 2 steps: the routers' biases after them equal one process's (the load summed over the replicas,
# models/deepseek_moe.py update_correction_bias) and every rank's copy is the same (the replica check)
DEEPSEEK_SHORT = "deepseek-v3-short"
SHORT_FILES[DEEPSEEK_SHORT] = ("deepseek-v3", 2)
SHORT_EXTRA = {DEEPSEEK_SHORT: {"moe_bias_update_rate": 0.01}}
# Issue 34's families in dp2, the 1F1B pp2 (one layer a stage) and sharding stages 1-3 (with recompute,
# layout_granularity), 2 layers for 2 steps: Qwen3-MoE (every layer sparse, no shared expert),
# ERNIE 4.5 MoE (layer 0 dense, layer 1 MoE: under the pipeline the dense stage passes the router carry on untouched,
# models/pipeline.py MoEDecoderLayer), Qwen3 (the q/k norms), ERNIE 4.5 dense (interleaved rotary pairs; ~1 s a
# run in these launches on an idle machine).
LAYOUT_SHORT_MOE = ("qwen3-moe-short", "ernie4_5_moe-short")
# ... and Qwen3-MoE under tp2 and tp2 + SP (every layer sparse: each expert's gate/up and down split over the ranks,
# the router whole; check_qwen3_moe_tp2), beside ERNIE 4.5 MoE's TP_ONLY runs: 2 layers, 2 steps of one micro-batch
# of 2 (global batch 2, its own reference: 4 micro-batches a step cost ~7 s of CPU for the two runs, one ~2)
QWEN3_MOE_TP = "qwen3-moe-tp"
LAYOUT_SHORT = LAYOUT_SHORT_MOE + ("qwen3-short", "ernie4_5-short")
SHORT_FILES.update({name: (name.removesuffix("-short"), 2) for name in LAYOUT_SHORT})
SHORT_FILES[QWEN3_MOE_TP] = ("qwen3-moe", 2)
SHORT_EXTRA[QWEN3_MOE_TP] = {"gradient_accumulation_steps": 1}
# Issue 34's dense families under the interleaved pp4 (2 virtual stages of one layer a rank, 8 layers for 2 steps:
# "<family>-pp4-short"); llm_pretrain/parallel/layout.py PROVEN_INTERLEAVED
INTERLEAVED_SHORT = ("qwen3", "ernie4_5")
SHORT_FILES.update({f"{family}-pp4-short": (family, 8) for family in INTERLEAVED_SHORT})
# family -> sharding stages in sd2 without ep: Qwen2-MoE's three, Mixtral's 3 (its stages 1 and 2 train with ep2
# over the sharding ranks in tests/test_expert_parallel.py)
MOE_SHARDING = {"mixtral-short": (3,), "qwen2-moe-short": (1, 2, 3)}
# Uneven pipeline stages beside tests/test_uneven_pipeline.py's LLaMA and GPT-3 (tied head): Llama 3.1 pp2 [3, 5],
# the mixtures of experts [1, 3] of 4 layers (their router statistics carried between uneven stages). The other
# dense families share LLaMA's split by path (models/pipeline.py; docs/parallel-layouts.md says so).
UNEVEN = {"llama3": [3, 5], **{family: [1, 3] for family in MOE_SHORT}}
# Evaluation with an eval batch (4) other than the training micro-batch (2): the pipeline runs it as
# several training-sized micro-batches. Valid split at steps 2 and 4 (different samples), test split at the end.
EVALUATION = dict(do_eval=True, do_predict=True, eval_steps=2, eval_iters=2, per_device_eval_batch_size=4)
# Mixture of experts under the pipeline: eval batches of the training micro-batch (layout.check_mixture_of_experts)
MOE_EVALUATION = dict(EVALUATION, per_device_eval_batch_size=2, eval_iters=4)
# 3 eval batches of 4 = 6 micro-batches of 2, not a multiple of the 4 per training step: one pipeline call of 6.
EVALUATION_6 = dict(EVALUATION, do_predict=False, eval_iters=3)
GRANULARITIES = ("full", "full_attn", "core_attn")
LAYOUT_GRANULARITIES = GRANULARITIES + ("full_attn",)  # LAYOUT_SHORT's under sd2 stage 1 (ernie4_5-short: full_attn)


# ... and under the 1F1B pp2 Qwen3 and ERNIE 4.5 MoE (its dense stage 0 passing the router carry on) recompute in
# full: fleet's PipelineLayer segments of one decoder layer (pp_recompute_interval 1), recompute_hybrid in backward
PP2_RECOMPUTE = {"qwen3-short": {"recompute": True}, "ernie4_5_moe-short": {"recompute": True}}


def layout_granularity(i: int, stage: int) -> str:
    """LAYOUT_SHORT[i]'s recompute granularity under sd2 stage `stage`: stage 1's above, then the next ones (each
    family recomputes at 2 or 3 granularities over the stages)."""
    return LAYOUT_GRANULARITIES[(i + stage - 1) % len(LAYOUT_GRANULARITIES)]


# The other dense families train 2 layers where the layout acts inside every layer alike (dp, tp, sharding, pp2:
# one layer a stage); 8-layer runs of theirs were a sixth of the suite's time. The interleaved pp4 needs 8
# layers (2 chunks of one layer per stage): "<family>-pp4", the same model with 8.
FAMILY_LAYERS = 2
# The stand-ins a run with the kernel options calls (swiglu: the CPU build's own kernel): RMSNorm and rotary
# families, LayerNorm families
LLAMA_KERNELS = ("flash_attn", "flash_attn_grad", "fused_rotary_position_embedding", "fused_rms_norm_quant")
GPT_KERNELS = ("flash_attn", "flash_attn_grad", "fast_ln")


@dataclass
class Parity:
    work: Path
    files: dict[str, Path]        # model -> argument file
    references: dict[str, Path]   # model -> single-process output_dir

    @classmethod
    def create(cls, work: Path, corpus: dict) -> Parity:
        """The argument files (written, the same each time) and where every output goes, under work."""
        files = {"llama": write_json(work / "llama.json", base_arguments(corpus, work))}
        for family in FAMILIES + ROPE_SCALED + MOE + TP_ONLY:
            layers = {} if family in ROPE_SCALED + MOE else {"num_hidden_layers": FAMILY_LAYERS}
            files[family] = write_json(work / f"{family}.json", base_arguments(
                corpus, work, model_name_or_path=f"{family}-tiny", **layers))
        for family in FAMILIES:
            files[f"{family}-pp4"] = write_json(work / f"{family}-pp4.json", base_arguments(
                corpus, work, model_name_or_path=f"{family}-tiny"))
        for name, (preset, layers) in SHORT_FILES.items():
            files[name] = write_json(work / f"{name}.json", base_arguments(
                corpus, work, model_name_or_path=f"{preset}-tiny", num_hidden_layers=layers, **SHORT,
                **SHORT_EXTRA.get(name, {})))
        return cls(work, files, {model: work / "single" / model for model in files})

    def out(self, name: str) -> Path:
        return self.work / "runs" / name

    def run(self, name: str, model: str = "llama", **overrides) -> list[str]:
        return argv(self.files[model], self.out(name), **overrides)

    def kernels(self, name: str, model: str = "llama", **overrides) -> list[str]:
        """A run with the four kernel options on: their GPU branches through the CPU stand-ins
        (parity_utils.run_spec gives it LLM_PRETRAIN_KERNEL_STANDINS=1), checked against the plain path."""
        return self.run(name, model, **overrides, **KERNEL_OPTIONS)

    def check(self, names_and_models: list[tuple[str, str]]) -> None:
        for name, model in names_and_models:
            step = SHORT["max_steps"] if model in SHORT_FILES else 5
            diffs = assert_same_training(self.references[model], self.out(name), step=step)
            diffs["every_replica"] = assert_every_replica_matches(self.references[model], self.out(name), step=step)
            print(f"{name} vs single-process {model}: {diffs}")


def observations(ranks: dict[int, dict], name: str) -> list[dict]:
    """Each rank's probe observations of the shared launch's run `name` (run names are "NN-<output dir>")."""
    return [next(seen for run, seen in observed.items() if run.split("-", 1)[1] == name)
            for _, observed in sorted(ranks.items())]


# What the mechanism probes (tests/workers/mechanism_runs.py) saw of a run: the same facts as
# tests/test_mechanisms.py checks on its own runs of these degrees.
RECOMPUTED_PART = {"full": "forward", "full_attn": "attention_block", "core_attn": "core_attention"}
SHARDING_WRAPPERS = {1: ("DygraphShardingOptimizer", "optimizer_classes"), 2: ("GroupShardedStage2", "model_classes"),
                     3: ("GroupShardedStage3", "model_classes")}


def mechanism_data_parallel(seen: list[dict], micro_batches: int, steps: int = 5) -> None:
    """Gradients stay local until the last micro-batch of a step (the ranks' differ), then are equal."""
    prints = [s["grad_fingerprints"] for s in seen]
    kinds = [kind for kind, _ in prints[0]]
    assert kinds == (["micro_batch"] * micro_batches + ["step"]) * steps, kinds
    for i, kind in enumerate(kinds):
        a, b = prints[0][i][1], prints[1][i][1]
        if kind == "step":
            assert a == pytest.approx(b, rel=1e-6), f"gradients not all-reduced: {a} vs {b}"
        elif i % (micro_batches + 1):  # before micro-batches 2.. of a step: this rank's own samples
            assert a != pytest.approx(b, rel=1e-6), f"gradients equal before the last micro-batch ({i}): {a}"


def mechanism_recompute(seen: dict, granularity: str, layers: list[int], micro_batches: int) -> None:
    """The recomputed part of every layer ran once per micro-batch forward and once more in backward."""
    calls = seen["calls"].get(RECOMPUTED_PART[granularity], [])
    counts = {layer: calls.count(layer) for layer in layers}
    assert counts == {layer: 2 * micro_batches for layer in layers}, (granularity, counts)


def mechanism_sharding(seen: list[dict], stage: int, untrained: int = 0) -> None:
    """The stage's wrappers; optimizer states split between the ranks (stage 3: each its slices). untrained:
    parameter elements the optimizer keeps no state of (the routers' correction biases)."""
    wrapper, chain = SHARDING_WRAPPERS[stage]
    assert all(wrapper in s[chain] for s in seen), [s[chain] for s in seen]
    held, total = [s["optimizer_state_elements"] for s in seen], seen[0]["model_parameters"] - untrained
    if stage == 3:
        # stage 3 manages the trainable parameters only (group_sharded_stage3.py _trainable_params): the
        # untrained ones are neither sliced nor kept whole by it
        unmanaged = [sum(p["elements"] for p in s["stage3"] if not p["unslice"] and p["slice_elements"] is None)
                     for s in seen]
        assert unmanaged == [untrained] * len(seen), (unmanaged, untrained)
        expected = [sum(p["elements"] if p["unslice"] else p["slice_elements"] or 0 for p in s["stage3"]) for s in seen]
        assert held == expected, (held, expected)
    else:
        assert sum(held) == total and max(held) < total, (held, total)


def shared(launch_name: str, nproc: int):
    """Decorates the function listing a layout's runs: they train in the session's shared launch of
    that layout (tests/shared_launches.py), beside the mechanism probes' runs of the same degrees."""
    def register(layout_runs):
        def make_runs(work: Path, corpus: dict) -> list[dict]:
            return [run_spec(f"{i:02d}-{Path(run[run.index('--output_dir') + 1]).name}", run)
                    for i, run in enumerate(layout_runs(Parity.create(work, corpus)))]

        contribute(launch_name, nproc, "parity", make_runs)
        return layout_runs
    return register


@pytest.fixture(scope="module")
def parity(shared_launches, embedded_corpus) -> Parity:
    setup = Parity.create(shared_launches.work_dir("parity"), embedded_corpus)
    files = setup.files
    evaluation = {"llama": EVALUATION, "mixtral": MOE_EVALUATION}  # (the runs evaluating)
    runs = [argv(files[model], setup.references[model], **evaluation.get(model, {})) for model in files]
    runs += [setup.run(f"single-recompute-{g}", recompute=True, recompute_granularity=g,
                       **(EVALUATION_6 if g == "full" else {})) for g in GRANULARITIES]
    run_single(runs, setup.work, "single")
    return setup


def test_recompute_in_one_process_changes_nothing(parity):
    parity.check([(f"single-recompute-{g}", "llama") for g in GRANULARITIES])


@shared("dp2", 2)
def dp2_runs(parity: Parity) -> list[list[str]]:
    return [
        parity.run("dp2", gradient_accumulation_steps=2),
        parity.run("dp2-resume", gradient_accumulation_steps=2, exit_interval=3, check_replicas_interval=2),
        parity.run("dp2-resume", gradient_accumulation_steps=2, check_replicas_interval=2),
    ] + [parity.run(f"{family}-dp2", family, gradient_accumulation_steps=2)
         for family in FAMILIES + ROPE_SCALED + MOE_SHORT + (DEEPSEEK_SHORT,) + LAYOUT_SHORT] + [
        parity.kernels("dp2-kernels", gradient_accumulation_steps=2),
        parity.kernels("gpt3-dp2-kernels", "gpt3", gradient_accumulation_steps=2)]


def test_dp2(parity, shared_launches):
    """Issue 2's data parallelism: 2 processes with half the accumulation each; plus resume."""
    observed = shared_launches.results("dp2", "parity")
    parity.check([("dp2", "llama"), ("dp2-resume", "llama")]
                 + [(f"{family}-dp2", family)
                    for family in FAMILIES + ROPE_SCALED + MOE_SHORT + (DEEPSEEK_SHORT,) + LAYOUT_SHORT]
                 + [("dp2-kernels", "llama"), ("gpt3-dp2-kernels", "gpt3")])
    assert_stand_ins_ran(observations(observed, "dp2-kernels"), parity.out("dp2-kernels"), LLAMA_KERNELS)
    assert_stand_ins_ran(observations(observed, "gpt3-dp2-kernels"), parity.out("gpt3-dp2-kernels"), GPT_KERNELS)
    # Llama 3.1 and the mixtures of experts (the others: mech::test_data_parallel_syncs_once_per_step_and_...):
    # a router's gradient, as a dense MLP's, stays local until the last micro-batch, then is all-reduced
    for family in ROPE_SCALED + MOE_SHORT + (DEEPSEEK_SHORT,) + LAYOUT_SHORT:
        steps = SHORT["max_steps"] if family in SHORT_FILES else 5
        mechanism_data_parallel(observations(observed, f"{family}-dp2"), micro_batches=2, steps=steps)
        assert run_record(parity.out(f"{family}-dp2"))["strategy"] == "dp2"
    for family in MOE_SHORT + (DEEPSEEK_SHORT,) + LAYOUT_SHORT_MOE:  # router metrics: over both replicas' tokens
        assert_same_router_metrics(parity.references[family], parity.out(f"{family}-dp2"))
    assert_same_router_biases(parity.references[DEEPSEEK_SHORT], parity.out(f"{DEEPSEEK_SHORT}-dp2"))
    run = run_record(parity.out("dp2"))
    assert run["strategy"] == "dp2" and run["global_batch_size"] == 8
    # CPU defaults (llm_pretrain/cpu/threads.py), as the run record reads them from Paddle: the
    # harness' own OMP_NUM_THREADS=1 wins; strided views are off as nobody set FLAGS_use_stride_kernel.
    if run["built"]["runtime"]["device"] == "cpu":
        assert run["built"]["runtime"]["OMP_NUM_THREADS"] == "1" and run["built"]["runtime"]["strided_views"] is False
    # check_replicas_interval 2: after steps 2 and 4, and at the end of each part (steps 3 and 5).
    checks = [r["replica_check"] for r in summary_records(parity.out("dp2-resume"))]
    assert [(c["step"], c["checks"]) for c in checks] == [(3, 2), (5, 2)], checks
    # tokens/card/sec counts every card: global tokens / 2 cards / step time.
    record = train_records(parity.out("dp2"))[-1]
    assert record["tokens_per_card_per_sec"] == pytest.approx(8 * 32 / 2 / record["step_time_s"], rel=1e-6)


@shared("tp2", 2)
def tp2_runs(parity: Parity) -> list[list[str]]:
    tp = {"tensor_parallel_degree": 2}
    runs = [
        parity.run("tp2", **tp),
        parity.run("tp2-sp", **tp, sequence_parallel=True),
        parity.run("tp2-recompute-full", **tp, recompute=True, no_recompute_layers=[0, 5]),
        parity.run("tp2-recompute-full_attn", **tp, recompute=True, recompute_granularity="full_attn"),
        parity.run("tp2-sp-recompute-core_attn", **tp, sequence_parallel=True, recompute=True,
                   recompute_granularity="core_attn"),
        parity.run("tp2-resume", **tp, exit_interval=3),
        parity.run("tp2-resume", **tp),
    ]
    # Baichuan: ALiBi slopes sliced per rank and NormHead; GPT-3: learned positions under SP;
    # Bloom: ALiBi and the embedding LayerNorm under SP.
    for family in FAMILIES + ROPE_SCALED + TP_ONLY:
        runs += [parity.run(f"{family}-tp2", family, **tp),
                 parity.run(f"{family}-tp2-sp", family, **tp, sequence_parallel=True)]
    # the kernels' branches: ALiBi's mask per rank's heads (Bloom), one kv head replicated (Qwen2)
    return runs + [parity.kernels("tp2-sp-kernels", **tp, sequence_parallel=True),
                   parity.kernels("bloom-tp2-sp-kernels", "bloom", **tp, sequence_parallel=True),
                   parity.kernels("qwen2-tp2-kernels", "qwen2", **tp)] + deepseek_tp2_runs(parity)


def deepseek_tp2_runs(parity: Parity) -> list[list[str]]:
    """DeepSeek-V3 (issue 35): deepseek-v3-short (MLA, 1 dense + 1 MoE layer, MTP, the bias rule) for 2 steps."""
    tp = {"tensor_parallel_degree": 2}
    return [parity.run(f"{DEEPSEEK_SHORT}-tp2", DEEPSEEK_SHORT, **tp),
            # latent attention on the flash kernel (its CPU stand-in: models/mla.py flash_attention), heads split
            parity.run(f"{DEEPSEEK_SHORT}-tp2-sp", DEEPSEEK_SHORT, **tp, sequence_parallel=True,
                       use_flash_attention=True)] + [
        parity.run(f"{QWEN3_MOE_TP}-tp2{sp}", QWEN3_MOE_TP, **tp, **options)
        for sp, options in (("", {}), ("-sp", {"sequence_parallel": True}))]


# DeepSeek-V3 under tp2, as PaddleFormers 0.4.1 splits it (deepseek_v2/modeling.py DeepseekV2Attention.__init__):
# name suffix -> how the checkpoint holds the tensor (axis split in two, or None: one whole replicated box)
DEEPSEEK_TP_SPLIT = {"self_attn.q_b_proj.weight": 1, "self_attn.kv_b_proj.weight": 1, "self_attn.o_proj.weight": 0,
                     "self_attn.q_a_proj.weight": None, "self_attn.kv_a_proj_with_mqa.weight": None,
                     "self_attn.q_a_layernorm.weight": None, "mlp.gate.weight": None,
                     "mlp.e_score_correction_bias": None, "eh_proj.weight": None}


def check_deepseek_tp2(parity: Parity, observed: dict) -> None:
    """deepseek-v3-short under tp2 and tp2 + SP (its latent attention on the flash kernel): losses, grad norms, weights
    and AdamW moments as one process's,
    every replica (latent projections, norms, routers, correction biases, the MTP block's) bitwise equal on both
    ranks (parity.check's replica check); the heads split and the rest whole; the biases moved as one process's;
    under SP 32 of the micro-batch's 64 tokens between the layers (the MTP block's too), every sequence-parallel
    parameter's gradient all-reduced once per step."""
    from llm_pretrain.checkpoint.dist_checkpoint import CheckpointReader

    names = [f"{DEEPSEEK_SHORT}-tp2", f"{DEEPSEEK_SHORT}-tp2-sp"]
    parity.check([(name, DEEPSEEK_SHORT) for name in names])
    # the -sp run's latent attention took the flash kernel's stand-in on both ranks, against the plain one process
    assert_stand_ins_ran(observations(observed, names[1]), parity.out(names[1]), ("flash_attn", "flash_attn_grad"))
    steps = SHORT["max_steps"]
    for name in names:
        assert_same_router_metrics(parity.references[DEEPSEEK_SHORT], parity.out(name))
        assert_same_router_biases(parity.references[DEEPSEEK_SHORT], parity.out(name))
        with CheckpointReader(str(parity.out(name) / f"checkpoint-{steps}")) as got:
            checked = 0
            for tensor, entry in got.tensors.items():
                axis = next((a for suffix, a in DEEPSEEK_TP_SPLIT.items() if tensor.endswith(suffix)), "other")
                if axis == "other":
                    continue
                boxes = sorted(tuple(s["offsets"]) for s in entry["slices"])
                if axis is None:
                    assert boxes == [(0,) * len(entry["shape"])] and entry["slices"][0]["shape"] == entry["shape"], \
                        (name, tensor, entry)
                else:
                    assert len(boxes) == 2 and boxes[1][axis] == entry["shape"][axis] // 2, (name, tensor, entry)
                checked += 1
            assert checked == 3 * 6 + 2 * 2 + 1, (name, checked)  # 3 attentions, 2 routers, eh_proj
    sp = observations(observed, f"{DEEPSEEK_SHORT}-tp2-sp")
    for seen in sp:
        shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
        assert shapes == {(32, 64)}, shapes
        # per decoder layer (2 and the MTP block) its 2 norms, the 2 latent norms and the 2 latent projections;
        # the final norm; the MTP block's enorm, hnorm, eh_proj and its norm
        hooks = seen["sp_hooks"]
        assert len(hooks) == 3 * 6 + 1 + 4 and all(calls == [4 * steps, steps] for calls in hooks.values()), hooks


def check_qwen3_moe_tp2(parity: Parity, observed: dict) -> None:
    """qwen3-moe-tp under tp2 and tp2 + SP: losses, grad norms, weights, AdamW moments and the router metrics as
    one process's, every replica (router, norms, q/k norms) the same on both ranks; fleet's TensorParallel wrapper,
    each rank holding about half the weights (the experts split too), under SP 32 of the 64 tokens between layers."""
    names = [f"{QWEN3_MOE_TP}-tp2", f"{QWEN3_MOE_TP}-tp2-sp"]
    parity.check([(name, QWEN3_MOE_TP) for name in names])
    for name in names:
        assert_same_router_metrics(parity.references[QWEN3_MOE_TP], parity.out(name))
        for seen in observations(observed, name):
            assert "TensorParallel" in seen["model_classes"], seen["model_classes"]
            assert seen["parameter_elements"] < 0.6 * seen["model_parameters"], seen["parameter_elements"]
            shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
            assert shapes == ({(32, 64)} if name.endswith("-sp") else {(2, 32, 64)}), (name, shapes)


# Under tensor parallelism every projection is one of fleet's split linears (tp2 + SP: their sequence-parallel ones)
TP_PROJECTIONS = {"q_proj": "Column", "k_proj": "Column", "v_proj": "Column", "gate_proj": "Column",
                  "up_proj": "Column", "o_proj": "Row", "down_proj": "Row"}


def check_tp_only_split(parity: Parity, observed: dict) -> None:
    """Qwen3, ERNIE 4.5 and ERNIE 4.5 MoE under tp2 and tp2 + SP (parity: test_tensor_parallel): fleet's
    TensorParallel wrapper, each rank holding under 0.6 of the weights, every q/k/v/o projection and every MLP's,
    shared expert's and expert's gate/up/down fleet's column / row parallel linear (SP: ColumnSequenceParallelLinear,
    RowSequenceParallelLinear; ERNIE 4.5 MoE's experts and shared experts, which take the gathered tokens, plain
    tensor parallelism's, models/moe.py), under SP 32 of the micro-batch's 64 tokens between the layers. With tensor
    parallelism silently off in the model, both ranks would train the whole model on the same samples and the
    parity alone would pass."""
    for family in TP_ONLY:
        for sp in ("", "-sp"):
            name = f"{family}-tp2{sp}"
            expected = {(proj, f"{kind}{'Sequence' if sp else ''}ParallelLinear") for proj, kind in TP_PROJECTIONS.items()}
            if sp and family == "ernie4_5_moe":  # (layer 0 dense: its MLP's sequence-parallel ones)
                expected |= {(proj, f"{kind}ParallelLinear") for proj, kind in TP_PROJECTIONS.items()
                             if proj in ("gate_proj", "up_proj", "down_proj")}
            for seen in observations(observed, name):
                assert "TensorParallel" in seen["model_classes"], (name, seen["model_classes"])
                assert seen["parameter_elements"] < 0.6 * seen["model_parameters"], (name, seen["parameter_elements"])
                assert set(map(tuple, seen["projection_classes"])) == expected, \
                    (name, seen["projection_classes"])
                shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
                assert shapes == ({(32, 64)} if sp else {(2, 32, 64)}), (name, shapes)


def test_tensor_parallel(parity, shared_launches):
    observed = shared_launches.results("tp2", "parity")
    parity.check([(name, "llama") for name in ("tp2", "tp2-sp", "tp2-recompute-full", "tp2-recompute-full_attn",
                                               "tp2-sp-recompute-core_attn", "tp2-resume")]
                 + [(f"{family}-tp2{sp}", family) for family in FAMILIES + ROPE_SCALED + TP_ONLY for sp in ("", "-sp")]
                 + [("tp2-sp-kernels", "llama"), ("bloom-tp2-sp-kernels", "bloom"), ("qwen2-tp2-kernels", "qwen2")])
    for name, kernels in (("tp2-sp-kernels", LLAMA_KERNELS), ("bloom-tp2-sp-kernels", GPT_KERNELS),
                          ("qwen2-tp2-kernels", LLAMA_KERNELS)):
        assert_stand_ins_ran(observations(observed, name), parity.out(name), kernels)
    check_deepseek_tp2(parity, observed)
    # qwen2-tiny's single kv head is replicated on both ranks (not split): whole k/v projections
    assert run_record(parity.out("qwen2-tp2"))["model_config"]["num_key_value_heads"] == 1
    assert final_weights(parity.out("qwen2-tp2"))["layers.0.self_attn.k_proj.weight"].shape == (64, 16)
    assert run_record(parity.out("tp2"))["strategy"] == "tp2"
    for sp in ("", "-sp"):  # ERNIE 4.5 MoE's router metrics (one row per MoE layer) as one process's
        assert_same_router_metrics(parity.references["ernie4_5_moe"], parity.out(f"ernie4_5_moe-tp2{sp}"))
    check_qwen3_moe_tp2(parity, observed)
    check_tp_only_split(parity, observed)
    # Llama 3.1 (the others: mech::test_sequence_parallel_and_recompute_under_tp2): fleet's wrapper, about half
    # the weights per rank, 32 of the 64 tokens of a micro-batch between layers, every norm's SP hook
    # all-reducing once per step (5 steps of 4 micro-batches)
    for seen in observations(observed, "llama3-tp2-sp"):
        assert "TensorParallel" in seen["model_classes"]
        assert seen["parameter_elements"] < 0.6 * seen["model_parameters"], seen["parameter_elements"]
        shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
        assert shapes == {(32, 64)}, shapes
        hooks = seen["sp_hooks"]
        assert len(hooks) == 2 * 8 + 1 and all(calls == [20, 5] for calls in hooks.values()), hooks
    assert [r["step"] for r in train_records(parity.out("tp2-resume"))] == [1, 2, 3, 4, 5]


def eval_records(output_dir: Path) -> list[tuple]:
    with open(output_dir / "train_log.jsonl", encoding="utf-8") as f:
        return [(r["split"], r["step"], r["loss"]) for r in map(json.loads, f) if r["event"] == "eval"]


def assert_same_evaluation(reference: Path, other: Path, predict: bool = True) -> None:
    """The same eval records (split, step) with losses within 1e-5: the same samples, the same model."""
    ref, got = eval_records(reference), eval_records(other)
    expected = [("valid", 2), ("valid", 4)] + ([("test", 5)] if predict else [])
    assert [r[:2] for r in ref] == [r[:2] for r in got] == expected
    assert max(abs(a[2] - b[2]) for a, b in zip(ref, got)) <= 1e-5, (ref, got)
    assert ref[0][2] != ref[1][2]  # the second evaluation reads the next samples of the split


@shared("pp2", 2)
def pp2_runs(parity: Parity) -> list[list[str]]:
    pp = {"pipeline_parallel_degree": 2}
    return [
        parity.run("pp2", **pp, **EVALUATION),
        parity.run("pp2-recompute", **pp, recompute=True, pp_recompute_interval=2, **EVALUATION_6),
        parity.run("pp2-recompute-full_attn", **pp, recompute=True, recompute_granularity="full_attn"),
        parity.run("pp2-resume", **pp, exit_interval=2),
        parity.run("pp2-resume", **pp),
    ] + [parity.run(f"{family}-pp2", family, **pp)  # GPT-3, Bloom, Qwen2: tied embeddings
         for family in FAMILIES + ROPE_SCALED] + [
        parity.run(f"{family}-pp2-uneven", family, **pp, pipeline_layers_per_stage=split)
        for family, split in UNEVEN.items()] + [parity.run(f"{family}-pp2", family, **pp, **PP2_RECOMPUTE.get(family, {}))
                                               for family in LAYOUT_SHORT] + [
        parity.kernels("pp2-kernels", **pp), parity.kernels("baichuan-pp2-kernels", "baichuan", **pp),
        parity.run(f"{DEEPSEEK_SHORT}-pp2", DEEPSEEK_SHORT, **pp)]


def check_deepseek_pp2(parity: Parity) -> None:
    """deepseek-v3-short under pp2 (1F1B): losses, grad norms, weights and AdamW moments as one process's, the
    embedding's among them (its gradient from the last stage's MTP block, through the embeddings that rode with
    the hidden states); layer 0 on the first stage, layer 1 and the MTP module's block on the last; the MTP loss logged
    by the last stage and the router metrics (the MTP block's router among them) as one process's; the biases
    moved as one process's (each stage moved its own)."""
    name = f"{DEEPSEEK_SHORT}-pp2"
    reference = parity.references[DEEPSEEK_SHORT]
    parity.check([(name, DEEPSEEK_SHORT)])
    schedule = run_record(parity.out(name))["built"]["schedule"]
    # (decoder layer 2: the MTP module's block, built with the last stage)
    assert schedule["class"] == "PipelineParallel" and schedule["chunk_layers"] == [[[0]], [[1, 2]]], schedule
    ref, got = train_records(reference), train_records(parity.out(name))
    assert all(abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-5 for a, b in zip(ref, got, strict=True)), (ref, got)
    assert_same_router_metrics(reference, parity.out(name))
    assert_same_router_biases(reference, parity.out(name))


def test_pipeline_parallel(parity, shared_launches):
    observed = shared_launches.results("pp2", "parity")
    parity.check([(name, "llama") for name in ("pp2", "pp2-recompute", "pp2-recompute-full_attn", "pp2-resume")]
                 + [(f"{family}-pp2", family) for family in FAMILIES + ROPE_SCALED]
                 + [(f"{family}-pp2-uneven", family) for family in UNEVEN]
                 + [(f"{family}-pp2", family) for family in LAYOUT_SHORT]
                 + [("pp2-kernels", "llama"), ("baichuan-pp2-kernels", "baichuan")])
    assert_stand_ins_ran(observations(observed, "pp2-kernels"), parity.out("pp2-kernels"), LLAMA_KERNELS)
    assert_stand_ins_ran(observations(observed, "baichuan-pp2-kernels"), parity.out("baichuan-pp2-kernels"),
                         ("flash_attn", "flash_attn_grad", "fused_rms_norm_quant"))
    for family, (first, second) in UNEVEN.items():  # each stage built the layers of the split (its PipelineLayer)
        schedule = run_record(parity.out(f"{family}-pp2-uneven"))["built"]["schedule"]
        layers = [[list(range(first))], [list(range(first, first + second))]]
        assert schedule["class"] == "PipelineParallel" and schedule["chunk_layers"] == layers, (family, schedule)
    for name in [f"{family}-pp2-uneven" for family in MOE_SHORT] + [f"{family}-pp2" for family in LAYOUT_SHORT_MOE]:
        # the router statistics of stage 0's layers reach the loss on stage 1 (ERNIE 4.5 MoE: none, layer 0 dense)
        assert_same_router_metrics(parity.references[name.split("-pp2")[0]], parity.out(name))
    assert_same_evaluation(parity.references["llama"], parity.out("pp2"))
    check_deepseek_pp2(parity)
    assert_same_evaluation(parity.out("single-recompute-full"), parity.out("pp2-recompute"), predict=False)
    assert run_record(parity.out("pp2"))["strategy"] == "pp2"
    for family in FAMILIES + ROPE_SCALED + LAYOUT_SHORT:  # fleet's 1F1B, half the layers a stage (its PipelineLayer)
        layers = 8 if family in ROPE_SCALED else FAMILY_LAYERS
        schedule = run_record(parity.out(f"{family}-pp2"))["built"]["schedule"]
        assert schedule["class"] == "PipelineParallel", (family, schedule)
        assert schedule["chunk_layers"] == [[list(range(layers // 2))], [list(range(layers // 2, layers))]], \
            (family, schedule)
    for family in PP2_RECOMPUTE:  # full recompute under the pipeline (the reference has none): each stage's layer
        name = f"{family}-pp2"  # ran forward twice per micro-batch (2 steps of 4: 8 forwards, 8 more in backward)
        assert run_record(parity.out(name))["built"]["recompute"] == {"full": [0, 1], "pipeline_recompute_interval": 1}
        for stage, seen in enumerate(observations(observed, name)):
            calls = seen["calls"]["forward"]
            assert {layer: calls.count(layer) for layer in set(calls)} == {stage: 16}, (name, stage, calls)


@shared("sd2", 2)
def sd2_runs(parity: Parity) -> list[list[str]]:
    sd = {"gradient_accumulation_steps": 2}
    runs = []
    for stage, granularity in zip((1, 2, 3), GRANULARITIES):
        runs += [parity.run(f"sd2-stage{stage}", sharding=f"stage{stage}", **sd),
                 parity.run(f"sd2-stage{stage}-recompute", sharding=f"stage{stage}", recompute=True,
                            recompute_granularity=granularity, **sd)]
    for stage in (1, 3):
        runs += [parity.run(f"sd2-stage{stage}-resume", sharding=f"stage{stage}", exit_interval=3, **sd),
                 parity.run(f"sd2-stage{stage}-resume", sharding=f"stage{stage}", **sd)]
    for i, family in enumerate(FAMILIES + ROPE_SCALED):  # every family in every stage, with some recompute
        runs += [parity.run(f"{family}-sd2-stage{stage}", family, sharding=f"stage{stage}", recompute=True,
                            recompute_granularity=GRANULARITIES[(i + stage) % 3], **sd) for stage in (1, 2, 3)]
    for family, stages in MOE_SHARDING.items():  # each granularity once
        runs += [parity.run(f"{family}-sd2-stage{stage}", family, sharding=f"stage{stage}", recompute=True,
                            recompute_granularity=GRANULARITIES[stage % 3], **sd) for stage in stages]
    runs += [parity.run(f"{DEEPSEEK_SHORT}-sd2-stage{stage}", DEEPSEEK_SHORT, sharding=f"stage{stage}", **sd)
             for stage in (1, 2, 3)]
    runs += [parity.run(f"{family}-sd2-stage{stage}", family, sharding=f"stage{stage}", recompute=True,
                        recompute_granularity=layout_granularity(i, stage), **sd)
             for i, family in enumerate(LAYOUT_SHORT) for stage in (1, 2, 3)]
    return runs + [parity.kernels(f"sd2-stage{stage}-kernels", sharding=f"stage{stage}", **sd) for stage in (1, 2, 3)]


def check_deepseek_sd2(parity: Parity, observed: dict) -> None:
    """deepseek-v3-short under sharding stages 1, 2 and 3 (2 ranks, 2 micro-batches each): losses, grad norms,
    weights and AdamW moments as one process's, the optimizer states split between the ranks (the stage's fleet
    wrappers), every replica equal; the routers' load summed over the sharding ranks too (sum_over_data_replicas),
    so the biases moved as one process's and the router metrics are over both ranks'."""
    for stage in (1, 2, 3):
        name = f"{DEEPSEEK_SHORT}-sd2-stage{stage}"
        parity.check([(name, DEEPSEEK_SHORT)])
        # the two routers' correction biases (8 experts each) take no gradient: no optimizer state
        seen = observations(observed, name)
        mechanism_sharding(seen, stage, untrained=2 * 8)
        if stage < 3:  # about half the states each (stage 3: each its slices, mechanism_sharding)
            assert max(s["optimizer_state_elements"] for s in seen) < 0.6 * seen[0]["model_parameters"], stage
        assert_same_router_metrics(parity.references[DEEPSEEK_SHORT], parity.out(name))
        assert_same_router_biases(parity.references[DEEPSEEK_SHORT], parity.out(name))


def test_sharding_stages(parity, shared_launches):
    observed = shared_launches.results("sd2", "parity")
    names = [f"sd2-stage{s}{suffix}" for s in (1, 2, 3) for suffix in ("", "-recompute", "-kernels")]
    short = [(family, stage, GRANULARITIES[stage % 3]) for family, stages in MOE_SHARDING.items() for stage in stages]
    short += [(family, stage, layout_granularity(i, stage)) for i, family in enumerate(LAYOUT_SHORT)
              for stage in (1, 2, 3)]
    added = [(family, stage, GRANULARITIES[(len(FAMILIES) + stage) % 3], 8, 5) for family in ROPE_SCALED
             for stage in (1, 2, 3)] + [(family, stage, granularity, SHORT_FILES[family][1], SHORT["max_steps"])
                                        for family, stage, granularity in short]
    parity.check([(name, "llama") for name in names + ["sd2-stage1-resume", "sd2-stage3-resume"]]
                 + [(f"{family}-sd2-stage{stage}", family) for family in FAMILIES for stage in (1, 2, 3)]
                 + [(f"{family}-sd2-stage{stage}", family) for family, stage, *_ in added])
    for stage in (1, 2, 3):
        name = f"sd2-stage{stage}-kernels"
        assert_stand_ins_ran(observations(observed, name), parity.out(name), LLAMA_KERNELS)
    # Llama 3.1 and the mixtures of experts (the others' wrappers and recompute:
    # mech::test_sharding_stages_and_recompute_under_sd2), as the probes saw their runs
    for family, stage, granularity, layers, steps in added:
        name = f"{family}-sd2-stage{stage}"
        seen = observations(observed, name)
        config = ARCHITECTURES[f"{SHORT_FILES[family][0] if family in SHORT_FILES else family}-tiny"]
        # ERNIE 4.5 MoE's correction bias: moved by its own rule (or not at all), not by the optimizer
        mechanism_sharding(seen, stage, config.num_experts * config.moe_layer_count if config.has_correction_bias else 0)
        for rank_seen in seen:  # 2 micro-batches per step and rank
            mechanism_recompute(rank_seen, granularity, list(range(layers)), micro_batches=2 * steps)
        built = run_record(parity.out(name))["built"]
        assert built["sharding"]["stage"] == stage and built["recompute"] == {granularity: list(range(layers))}, built
        if family in MOE_SHORT + LAYOUT_SHORT_MOE:
            assert_same_router_metrics(parity.references[family], parity.out(name))
    assert run_record(parity.out("sd2-stage2"))["strategy"] == "sd2_stage2"
    check_deepseek_sd2(parity, observed)


@shared("dp2tp2", 4)  # beside the elastic test's first part (tests/test_elastic.py)
def dp2_tp2_runs(parity: Parity) -> list[list[str]]:
    return [parity.run("dp2tp2-sp", tensor_parallel_degree=2, sequence_parallel=True, gradient_accumulation_steps=2)]


def test_dp2_tp2(parity, shared_launches):
    shared_launches.results("dp2tp2", "parity")
    parity.check([("dp2tp2-sp", "llama")])
    assert run_record(parity.out("dp2tp2-sp"))["strategy"] == "tp2dp2"


def test_pp2_tp2(parity):
    degrees = {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}
    run_launch(4, [parity.run("pp2tp2", **degrees),
                   parity.run("pp2tp2-sp-recompute", **degrees, sequence_parallel=True, recompute=True),
                   parity.run("mixtral-pp2tp2", "mixtral", **degrees)],
               parity.work, "pp2tp2")
    parity.check([("pp2tp2", "llama"), ("pp2tp2-sp-recompute", "llama"), ("mixtral-pp2tp2", "mixtral")])
    # mixtral: experts split over the tensor-parallel pair, the router statistics passed between the stages
    # by fleet's partial p2p (each tensor-parallel rank sends half, pp_utils/p2p_communication.py)
    assert_same_router_metrics(parity.references["mixtral"], parity.out("mixtral-pp2tp2"))


@shared("tp2sd2", 4)
def tp2sd2_runs(parity: Parity) -> list[list[str]]:
    degrees = {"tensor_parallel_degree": 2, "gradient_accumulation_steps": 2}
    return [parity.run("sd2tp2-stage1", sharding="stage1", **degrees),
            parity.run("sd2tp2-stage2", sharding="stage2", **degrees)]


def test_sharding2_tp2(parity, shared_launches):
    shared_launches.results("tp2sd2", "parity")
    parity.check([("sd2tp2-stage1", "llama"), ("sd2tp2-stage2", "llama")])
    assert run_record(parity.out("sd2tp2-stage1"))["strategy"] == "tp2sd2_stage1"


@shared("pp4", 4)
def pp4_runs(parity: Parity) -> list[list[str]]:
    degrees = {"pipeline_parallel_degree": 4, "virtual_pp_degree": 2}
    # 4 micro-batches of 2 (fewer than 2 x pp) give fleet's PipelineParallelWithInterleaveFthenB; Llama 3.1 runs
    # 8 of 1 (PipelineParallelWithInterleave). A mixture of experts keeps 4 of 2: its load-balancing loss is
    # taken per micro-batch, so 8 of 1 is another loss than one process's 4 of 2. (Qwen2-MoE here, 8 layers for
    # 2 steps, passed and costs ~1.7 of these runs: left out, its pipeline is Mixtral's RouterCarry code.)
    eight = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8}
    return [parity.run("pp4vpp2", **degrees, **EVALUATION)] + [
        parity.run(f"{family}-pp4vpp2", f"{family}-pp4", **degrees) for family in FAMILIES] + [
        parity.run("mixtral-pp4vpp2-recompute", "mixtral", **degrees, recompute=True, **MOE_EVALUATION),
        parity.run("llama3-pp4vpp2", "llama3", **degrees, **eight),
        parity.kernels("pp4vpp2-kernels", **degrees), parity.kernels("mixtral-pp4vpp2-kernels", "mixtral", **degrees)] + [
        parity.run(f"{family}-pp4vpp2-short", f"{family}-pp4-short", **degrees) for family in INTERLEAVED_SHORT]


def test_pp4_interleaved(parity, shared_launches):
    observed = shared_launches.results("pp4", "parity")
    parity.check([("pp4vpp2", "llama")] + [(f"{family}-pp4vpp2", f"{family}-pp4") for family in FAMILIES]
                 + [(f"{family}-pp4vpp2-short", f"{family}-pp4-short") for family in INTERLEAVED_SHORT]
                 + [("mixtral-pp4vpp2-recompute", "mixtral"), ("llama3-pp4vpp2", "llama3"),
                    ("pp4vpp2-kernels", "llama"), ("mixtral-pp4vpp2-kernels", "mixtral")])
    for name in ("pp4vpp2-kernels", "mixtral-pp4vpp2-kernels"):
        assert_stand_ins_ran(observations(observed, name), parity.out(name), LLAMA_KERNELS)
    fthenb = "PipelineParallelWithInterleaveFthenB"  # 4 micro-batches of 2 on 4 stages (below 2 x pp)
    for name, cls in ([(f"{family}-pp4vpp2", fthenb) for family in FAMILIES]
                      + [(f"{family}-pp4vpp2-short", fthenb) for family in INTERLEAVED_SHORT]
                      + [("llama3-pp4vpp2", "PipelineParallelWithInterleave"), ("mixtral-pp4vpp2-recompute", fthenb)]):
        schedule = run_record(parity.out(name))["built"]["schedule"]  # 2 chunks of one layer per stage
        assert schedule["class"] == cls and schedule["virtual_stages"] == 2, (name, schedule)
        assert schedule["chunk_layers"] == [[[s], [s + 4]] for s in range(4)], (name, schedule)
    assert_same_evaluation(parity.references["llama"], parity.out("pp4vpp2"))
    assert run_record(parity.out("pp4vpp2"))["strategy"] == "pp4vpp2"
    # mixtral: the load-balancing loss over the 8 layers of 8 chunks on 4 stages, recomputed by PipelineLayer's
    # segments; the router metrics of train_log.jsonl (from the last stage; evaluation adds none) and the
    # evaluation losses (language model + auxiliary) are one process's
    assert_same_router_metrics(parity.references["mixtral"], parity.out("mixtral-pp4vpp2-recompute"))
    assert_same_evaluation(parity.references["mixtral"], parity.out("mixtral-pp4vpp2-recompute"))


def test_sharding2_dp2(parity):
    run_launch(4, [parity.run("sd2dp2-stage1", sharding="stage1", sharding_parallel_degree=2,
                              gradient_accumulation_steps=1)], parity.work, "sd2dp2")
    parity.check([("sd2dp2-stage1", "llama")])
    run = run_record(parity.out("sd2dp2-stage1"))
    assert run["strategy"] == "dp2sd2_stage1" and run["layout"]["data_parallel_degree"] == 2


def test_two_nodes(parity):
    """The same job as two 'nodes' of one process each on this machine, one launcher per node."""
    runs_file = write_json(parity.work / "two-nodes.runs.json",
                           [parity.run("two-nodes-dp2", gradient_accumulation_steps=2)])
    master = f"127.0.0.1:{free_port()}"
    env = {**os.environ, **process_env(DEVICE),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2", "--master", master,
         *launcher_process_args(1, DEVICE, first_device=node),
         "--log_dir", str(parity.work / f"two-nodes.log{node}"), str(TRAIN_RUNS), str(runs_file)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    parity.check([("two-nodes-dp2", "llama")])
    assert run_record(parity.out("two-nodes-dp2"))["layout"]["world_size"] == 2
