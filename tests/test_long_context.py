"""Segment parallelism (PaddleNLP's sep_parallel_degree) and context parallelism (ring attention,
context_parallel_degree), both on fleet's sep group, train like one process.

The ranks of a sep group read the same samples and each holds 1/sep of every sequence; an
all-to-all switches to 1/sep of the heads for attention and back (models/parallel_layers.py).
Under cp each rank holds chunks i and 2cp-1-i of every sequence and k/v blocks travel around the
ring (models/ring_attention.py). sep2 and cp2 give fleet the same groups, so they share launches.
References run once in one plain process; each launch runs several trainings with the same
degrees and compares each with its reference (loss and grad norm per step, final weights; 1e-5,
fp32). The global batch is 8 samples everywhere (sep ranks share theirs: sep2 keeps the 4
accumulation steps of one process).

    2 processes, sep2   every family record (models.families.FAMILY_NAMES: global RoPE positions,
                        learned GPT-3 positions, per-head ALiBi slopes for Bloom/Baichuan, Qwen2's
                        single kv head repeated) + Llama 3.1's rotary scaling + recompute;
                        resume 1 process -> sep2 and sep2 -> 1 process; the run record
    2 processes, cp2    every family record + Llama 3.1 (global positions for RoPE, learned, ALiBi;
                        Qwen2: one kv head, fewer than cp), recompute; resume 1 process -> cp2 ->
                        1 process
    4 processes         sep2 x tp2 (+ sequence parallelism; Bloom's ALiBi slopes sliced by both)
                        sep2 x dp2; cp2 x tp2 (+SP), cp2 x dp2; sep2 and cp2 x sharding 2 at stages 1,
                        2 (cp2: every family) and 3; cp4 (LLaMA, Bloom's ALiBi, GPT-3, Qwen2 with 1 kv head);
                        Qwen3 and ERNIE 4.5 (PAIR_MODELS, 2 steps) under sep2 x tp2 + SP, cp2 x tp2 + SP and
                        sep2 / cp2 x sharding 2 at stages 1-3 (PAIR_SHARDING: stage 2 both, stage 1 ERNIE 4.5,
                        stage 3 Qwen3); DeepSeek-V3 with packed documents under sep2 x tp2 + SP and cp2 x tp2 + SP
                        (DEEPSEEK_PAIRS), and without them under sep2 / cp2 x sharding 2 stage 2 (DEEPSEEK_SHARDING);
                        Qwen3-MoE under sep2 x tp2 + SP, ERNIE 4.5 MoE under cp2 x tp2 + SP (MOE_PAIRS)
    4 processes, pp2    pp2 x cp2 (LLaMA evaluating too, Bloom, GPT-3 with full recompute) and pp2 x sep2
                        (LLaMA) in one launch of the mechanism worker: parity, and s/2 tokens entering
                        every layer of both stages, ring / all-to-all steps counted; LLaMA with packed
                        documents under both (the document ids passed between the stages)
    8 processes, pp4    interleaved (2 virtual stages) x cp2 (LLaMA) and x sep2 (Bloom): the same, both
                        with the kernel options through their CPU stand-ins (each rank's calls counted)
    mixture of experts  Mixtral (also with capacity and z-loss) and Qwen2-MoE under sep2 and cp2, and
                        sep2 / cp2 x tp2 + SP: per-step losses, grad norms, final weights and the router
                        metrics of train_log.jsonl equal one process's; DeepSeek-V3 under sep2 and cp2 (MLA's
                        all-to-all or ring, the sequence-wise loss over whole sequences, MTP): also its MTP losses
                        and router biases; Qwen3-MoE (global-batch balancing) and ERNIE 4.5 MoE (the bias rule:
                        its correction bias too) under sep2 and cp2, 2 steps of one micro-batch
    packed documents    in the sep2/cp2 launch, reset_attention_mask, reset_position_ids and eod_mask_loss on:
                        GPT-3 sep2 (the whole sequence's mask after the all-to-all; learned positions of this
                        rank's tokens), LLaMA cp2 (the ring masks each block; rotary positions restarting per
                        document, this rank's chunks of them; tests/test_ring_blocks.py: blocks masked entirely
                        skipped, ALiBi, cp4); LLaMA sep2 with the kernel options (FlashMask's stand-in on the
                        whole sequence's row indices after the all-to-all) and cp2 (FlashMask per ring block,
                        each with its own row indices); in the pp2 launch LLaMA under pp2 x cp2 and pp2 x sep2;
                        DeepSeek-V3's latent attention under sep2 x tp2 + SP and cp2 x tp2 + SP (4 processes)
    kernel stand-ins    in the sep2/cp2 launch: LLaMA sep2 (sdpa's flash), LLaMA, Bloom (ALiBi) and Mixtral
                        cp2 (the ring's FlashBlocks) with the kernel options through their CPU stand-ins;
                        LLaMA also under sep2 x tp2 + SP, cp2 x tp2 + SP, sep2 x dp2, cp2 x dp2, cp2 x
                        sharding 2 at stages 1, 2 and 3, sep2 x sharding 2 at stages 1 and 3, cp4
                        (the ring's overlapped pass between different neighbours), pp2 x cp2 and pp2 x sep2,
                        pp4 x 2 virtual stages x cp2 (and Bloom x sep2: the launch's only runs),
                        with packed documents under sep2 and cp2 (FlashMask's stand-in), each rank's stand-in
                        calls checked (the launch worker's "kernel_calls"; the newer runs: as many as
                        every layer makes, llama_kernel_calls)
    mechanism (sep2)    each rank holds s/2 tokens between layers; the all-to-all runs 4 times per
                        layer in forward and 4 times in backward; the ranks' gradients differ
                        before the optimizer's sep reduction; a Mixtral router routes s/2 tokens per
                        rank but its losses use statistics of all s (summed over the sep group)
    mechanism (cp2)     each rank holds s/2 tokens between layers; per layer the ring passes k/v
                        once in forward and k/v + dk/dv once, dk/dv once more, in backward
"""

from __future__ import annotations

from pathlib import Path

import pytest

import json

from launch_utils import REPO_ROOT, launch
from models.families import FAMILIES
from parity_utils import (
    DEVICE, KERNEL_OPTIONS, argv, assert_every_replica_matches, assert_same_router_biases, assert_same_training,
    assert_stand_ins_ran,
    base_arguments, run_launch, run_record, run_single, run_spec, train_records, write_json,
)

# Every dense family record and llama3-tiny (Llama 3.1's rotary scaling); the mixture-of-experts families in
# MOE_MODELS (2 layers; "mixtral-capped": capacity factor 0.5 and z-loss, which drop and penalize as one process).
# ERNIE 4.5 dense (SEP_CP_MODELS): sep2 and cp2 in the 2-process launch, and PAIR_MODELS' pairs below; its other
# layouts with sep or cp (with dp, the pipeline) are refused (llm_pretrain/parallel/layout.py
# PROVEN_DEGREES, PROVEN_PAIRS), not trained here.
SEP_CP_MODELS = ("ernie4_5",)
# Issue 34's dense families (Qwen3's q/k norms, head_dim 32 apart from hidden / heads) also under two degrees at once, in the
# 4-process launches of test_sep2_with_tp2_dp2_and_sharding: sep2 x tp2 + SP, cp2 x tp2 + SP, sep2 x sharding 2 and
# cp2 x sharding 2 (PAIR_SHARDING's stages; llm_pretrain/parallel/layout.py PROVEN_PAIRS); "<model>-short": 2 layers
# for 2 steps of one micro-batch of 2 (the suite's budget; under sharding 2 one sample a rank), against their own
# one-process references.
PAIR_MODELS = ("qwen3", "ernie4_5")
# Every run here trains 2 steps (parity.base_arguments' 5 cut: the second step's loss and grad norm are taken on the
# weights the first update left, so a wrong gradient, reduction or optimizer state shows by then; the suite's budget)
STEPS = {"max_steps": 2, "save_steps": 2}
SHORT = {**STEPS, "gradient_accumulation_steps": 1}
MODELS = tuple(name for name, family in FAMILIES.items()
               if not family.architectures[family.tiny].is_moe and name not in SEP_CP_MODELS) + ("llama3",)
MOE_MODELS = {"mixtral": {"model_name_or_path": "mixtral-tiny"},
              "mixtral-capped": {"model_name_or_path": "mixtral-tiny", "moe_capacity_factor": 0.5,
                                 "router_z_loss_coef": 0.001},
              "qwen2_moe": {"model_name_or_path": "qwen2-moe-tiny"},
              # Issue 34's mixtures of experts, "-short" (SHORT: 2 steps of one micro-batch): Qwen3-MoE with global-batch
              # balancing (its picks summed over the sep group, then over the data replicas: none here), ERNIE 4.5 MoE
              # with the bias rule on (the load of the whole sequences moves the same bias on both ranks); the sums'
              # mechanism in one process: tests/test_qwen3.py::test_router_statistics_under_sep_and_cp_cover_the_whole_sequence
              "qwen3_moe-short": {"model_name_or_path": "qwen3-moe-tiny", "moe_global_batch_balance": True, **SHORT},
              "ernie4_5_moe-short": {"model_name_or_path": "ernie4_5_moe-tiny", "moe_bias_update_rate": 0.01, **SHORT}}
# DeepSeek-V3 (issue 35) under sep2: deepseek-v3-tiny (MLA, 1 dense + 1 MoE layer, MTP) for 2 steps with the bias
# rule on and the sequence-wise balance loss at 0.1 (published 0.0001: a loss of a rank's half sequences would hide
# below the tolerance), and under cp2
DEEPSEEK = {"model_name_or_path": "deepseek-v3-tiny", "num_hidden_layers": 2, "max_steps": 2, "save_steps": 2,
            "moe_bias_update_rate": 0.01, "seq_aux_loss_coef": 0.1}
# ... and "deepseek-docs-short" (one micro-batch of 2 a step, as PAIR_MODELS' "-short"; packed documents, DOCUMENT_KEYS)
# in PAIR_MODELS' 4-process launch under sep2 x tp2 + SP and cp2 x tp2 + SP: MLA's heads split by tp (the latents
# replicated), then sep's all-to-all with the whole sequence's document mask, or cp's ring with the document ids; the
# sequence-wise loss and the bias load summed over the sep group, not over tp's ranks (they route the same tokens).
# One run a pair with the documents on (the suite's budget: about 5 s of CPU a 4-process run).
SEP2 = {"sep_parallel_degree": 2}
CP2 = {"context_parallel_degree": 2}
DEEPSEEK_PAIRS = (("deepseek-docs-sep2tp2-sp", {**SEP2, "tensor_parallel_degree": 2, "sequence_parallel": True}),
                  ("deepseek-docs-cp2tp2-sp", {**CP2, "tensor_parallel_degree": 2, "sequence_parallel": True}))
# ... and "deepseek" under sep2 x sharding 2 and cp2 x sharding 2 at stage 2 in the sep2sd2 launch (a launch holds
# one fleet layout; 2 micro-batches of 2 a rank, the global batch of 8): the sequence-wise loss and the bias load
# summed over sep, the load then over the sharding ranks, the gradients over sep by us (GroupShardedStage2 reduces
# over the sharding group only). Without packed documents: under eod_mask_loss each rank's loss is the mean over
# its own micro-batch's unmasked tokens (as Megatron's), so a split of the batch differs from one process by 1e-4.
DEEPSEEK_SHARDING = (("deepseek-sep2sd2-stage2", {**SEP2, "sharding": "stage2", "gradient_accumulation_steps": 2}),
                     ("deepseek-cp2sd2-stage2", {**CP2, "sharding": "stage2", "gradient_accumulation_steps": 2}))
# Issue 34's mixtures of experts under a sequence split with tp2 + SP, one pair each (the suite's budget: about 2 s of
# CPU a run): Qwen3-MoE with global-batch balancing under sep2 x tp2, ERNIE 4.5 MoE with the bias rule under cp2 x tp2;
# the router statistics summed over the sep group, not over tp's ranks (they route the same tokens); the other pair of
# each is refused (llm_pretrain/parallel/layout.py PROVEN_PAIRS)
MOE_PAIRS = (("qwen3_moe-short-sep2tp2-sp", "qwen3_moe-short", {**SEP2, "tensor_parallel_degree": 2}),
             ("ernie4_5_moe-short-cp2tp2-sp", "ernie4_5_moe-short", {**CP2, "tensor_parallel_degree": 2}))
# PAIR_MODELS with sharding 2 (model, sep or cp, degrees, stage): both under sep2 and cp2 at stage 2 (Qwen3's cp2 x
# sharding stage 2 is one of MODELS' runs, 2 steps of 4 micro-batches); stages 1 and 3 one family each under sep2 and under cp2 (ERNIE 4.5:
# stage 1, fleet's sharding optimizer; Qwen3: stage 3, GroupShardedStage3 and our sum over the sep group), so every
# stage of both pairs is trained by some family (llm_pretrain/parallel/layout.py _SEQUENCE_PAIRS; ~1 s of CPU a run)
PAIR_SHARDING = (("ernie4_5", "cp2", CP2, 2), ("qwen3", "sep2", SEP2, 2), ("ernie4_5", "sep2", SEP2, 2),
                 ("ernie4_5", "cp2", CP2, 1), ("ernie4_5", "sep2", SEP2, 1), ("qwen3", "sep2", SEP2, 3),
                 ("qwen3", "cp2", CP2, 3))
STOP = 1  # resume pairs stop after this step (and resume for the last: the restored AdamW state and schedule)
# Runs of the sep2/cp2 launch with the four kernel options through the CPU stand-ins: (name, model, degrees)
KERNEL_RUNS = (("llama-sep2-kernels", "llama", SEP2), ("llama-cp2-kernels", "llama", CP2),
               ("bloom-cp2-kernels", "bloom", CP2), ("mixtral-cp2-kernels", "mixtral", CP2))
# LLaMA's kernels with the options on: the flash pair (sdpa's after sep's all-to-all, the ring's FlashBlocks under
# cp), the fused rotary embedding and RMSNorm (swiglu is Paddle's own CPU kernel, not a stand-in)
LLAMA_KERNELS = ("flash_attn", "flash_attn_grad", "fused_rotary_position_embedding", "fused_rms_norm_quant")
# ... and with packed documents FlashMask's pair instead of flash_attn's (models/decoder.py flashmask_attention)
DOCUMENT_KERNELS = ("flashmask_attention", "flashmask_attention_grad", "fused_rotary_position_embedding",
                    "fused_rms_norm_quant")
# Two evaluations of 2 batches of 4 (the pipeline runs each as 4 training-sized micro-batches of 2).
EVALUATION = dict(do_eval=True, eval_steps=1, eval_iters=2, per_device_eval_batch_size=4)


# Layers: sep and cp act inside every layer alike, so the families train 2 layers (a third of the suite's
# time was 8-layer runs here, each layer adding its all-to-alls or ring passes); the pipelines over cp/sep
# need layers to split: 4 a stage under pp2, chunks of one layer under pp4 x 2 virtual stages (PIPELINE_MODELS).
LAYERS = 2
PIPELINE_LAYERS = 8
PIPELINE_STEPS = STEPS["max_steps"]  # the "-pp" files' too (8 micro-batches a step under pp4 x 2 virtual stages)
PIPELINE_MODELS = ("llama", "bloom", "gpt3")  # "<model>-pp": the same model with PIPELINE_LAYERS
# "<model>-docs": packed documents, every document key on (tests/test_documents.py); one run per layout
# (the suite's budget): GPT-3's learned positions under sep2, LLaMA's rotary ones through the ring under cp2
DOCUMENT_MODELS = ("llama", "gpt3")
DOCUMENT_RUNS = (("gpt3", "sep2", SEP2), ("llama", "cp2", CP2))
# ... and LLaMA's under the pipeline over cp2 and sep2 (the pp2 launch): the ids travel between the stages
DOCUMENT_PP2 = (("llama-docs-cp2pp2", CP2, "pp2cp2"), ("llama-docs-sep2pp2", SEP2, "pp2sep2"))
DOCUMENT_KEYS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)


class Runs:
    def __init__(self, work: Path, corpus: dict):
        self.work = work
        self.files = {model: write_json(work / f"{model}.json", base_arguments(
            corpus, work, model_name_or_path=f"{model}-tiny", num_hidden_layers=LAYERS, **STEPS))
            for model in (*MODELS, *SEP_CP_MODELS)}
        self.files.update({f"{model}-short": write_json(work / f"{model}-short.json", base_arguments(
            corpus, work, model_name_or_path=f"{model}-tiny", num_hidden_layers=LAYERS, **SHORT))
            for model in PAIR_MODELS})
        self.files.update({model: write_json(work / f"{model}.json", base_arguments(
            corpus, work, num_hidden_layers=2, **{**STEPS, **keys})) for model, keys in MOE_MODELS.items()})
        self.files.update({f"{model}-pp": write_json(work / f"{model}-pp.json", base_arguments(
            corpus, work, model_name_or_path=f"{model}-tiny", num_hidden_layers=PIPELINE_LAYERS, **STEPS))
            for model in PIPELINE_MODELS})
        self.files.update({f"{model}-docs": write_json(work / f"{model}-docs.json", base_arguments(
            corpus, work, model_name_or_path=f"{model}-tiny", num_hidden_layers=LAYERS, **DOCUMENT_KEYS, **STEPS))
            for model in DOCUMENT_MODELS})
        self.files["deepseek"] = write_json(work / "deepseek.json", base_arguments(corpus, work, **DEEPSEEK))
        self.files["deepseek-docs-short"] = write_json(work / "deepseek-docs-short.json", base_arguments(
            corpus, work, **DEEPSEEK, gradient_accumulation_steps=1, **DOCUMENT_KEYS))

    def reference(self, model: str) -> Path:
        return self.work / "single" / model

    def out(self, name: str) -> Path:
        return self.work / "runs" / name

    def run(self, name: str, model: str = "llama", **overrides) -> list[str]:
        return argv(self.files[model], self.out(name), **overrides)

    def kernels(self, name: str, model: str = "llama", **overrides) -> dict:
        """A launch's run with the kernel options on, through the CPU stand-ins (run_spec sets the switch)."""
        return run_spec(name, self.run(name, model, **overrides, **KERNEL_OPTIONS))

    def check_stand_ins(self, result, name: str, kernels: tuple[str, ...] = LLAMA_KERNELS,
                        micro_batches: int | None = None, ring: bool = False) -> None:
        """Every rank of a parity-worker launch called `kernels` in run `name` (its "kernel_calls"); with
        `micro_batches` (per step on each rank), LLaMA's kernels exactly as often as every layer calls them."""
        out = str(self.out(name))
        observed = [seen["observations"][out] for _, seen in sorted(result.results().items())] if DEVICE == "cpu" else []
        counts = None if micro_batches is None else [llama_kernel_calls(micro_batches, ring)] * len(observed)
        assert_stand_ins_ran(observed, self.out(name), kernels, counts)

    def check(self, names_and_models) -> None:
        for name, model in names_and_models:
            step = PIPELINE_STEPS if model.endswith("-pp") else STEPS["max_steps"]
            diffs = assert_same_training(self.reference(model), self.out(name), step=step)
            diffs["every_replica"] = assert_every_replica_matches(self.reference(model), self.out(name), step=step)
            if model in MOE_MODELS:
                assert_same_router_metrics(self.reference(model), self.out(name))
            print(f"{name} vs single-process {model}: {diffs}")


def llama_kernel_calls(micro_batches: int, ring: bool, layers: int = LAYERS, final_norm: bool = True,
                       steps: int = STEPS["max_steps"]) -> dict:
    """A LLaMA run's stand-in calls on one rank in `steps` steps of `micro_batches`
    through `layers` decoder layers: per layer one flash call and its gradient (the ring of cp2: one per block,
    2 blocks; its batch_isend_irecv once in forward, 3 times in backward), one fused rotary embedding (q and k
    together) and two fused RMSNorms, plus the final norm (a pipeline: on the last stage only)."""
    forwards = steps * micro_batches
    calls = {"flash_attn": forwards * layers * (2 if ring else 1), "fused_rotary_position_embedding": forwards * layers,
             "fused_rms_norm_quant": forwards * (2 * layers + final_norm)}
    calls["flash_attn_grad"] = calls["flash_attn"]
    if ring:
        calls["batch_isend_irecv"] = forwards * layers * 4
    return calls


def assert_same_router_metrics(reference: Path, other: Path) -> None:
    """train_log.jsonl's router metrics at every step equal one process's: the load-balancing loss, the ratio
    of the most to the least loaded expert, the pairs dropped (each rank's router sees part of the sequences)."""
    ref, got = train_records(reference), train_records(other)
    for a, b in zip(ref, got, strict=True):
        assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], abs=1e-5), (other, b, a)
        assert b["expert_load_max_min_ratio"] == pytest.approx(a["expert_load_max_min_ratio"], rel=1e-6), (other, b, a)
        assert b["tokens_dropped"] == a["tokens_dropped"], (other, b, a)
    assert any(r["tokens_dropped"] for r in ref) == ("capped" in reference.name)


def check_deepseek(runs: Runs, name: str, model: str = "deepseek") -> None:
    """DeepSeek-V3 under sep2 or cp2 (issue 35), alone or with tp2 + SP and packed documents: losses (main and MTP),
    grad norms, router metrics, weights, AdamW states and the routers' correction biases (moved by the load of the
    whole sequences, summed over sep, not over tp) equal one process's, every replica the same on every rank;
    each rank holds 16 of the 32 tokens between the layers; under sep 2 of the 4 heads inside the latent attention (its
    all-to-all, rotary positions the whole sequence's; under tp2 1: tp's 2, then sep's), under cp chunks 0 and 3 of 4
    (the ring over k and v, MLA's softmax scale)."""
    reference, out = runs.reference(model), runs.out(name)
    steps = DEEPSEEK["max_steps"]
    diffs = assert_same_training(reference, out, step=steps)
    diffs["every_replica"] = assert_every_replica_matches(reference, out, step=steps)
    assert_same_router_metrics(reference, out)
    assert_same_router_biases(reference, out, step=steps)
    for a, b in zip(train_records(reference), train_records(out), strict=True):
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], abs=1e-5), (b, a)
    built = run_record(out)["built"]
    if "sep2" in name:
        split = built["segment_parallel"]
        heads = 1 if "tp2" in name else 2
        assert split["tokens_per_rank"] == 16 and split["attention_heads_per_rank"] == heads, built
    else:
        ring = built["context_parallel"]
        assert ring["tokens_per_rank"] == 16 and ring["chunks_of_2cp"] == [0, 3], built
    print(f"{name} vs single-process {model}: {diffs}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_corpus) -> Runs:
    setup = Runs(tmp_path_factory.mktemp("long_context"), embedded_corpus)
    references = [argv(setup.files[model], setup.reference(model))
                  for model in (*MODELS, *SEP_CP_MODELS, *MOE_MODELS, *(f"{m}-pp" for m in PIPELINE_MODELS),
                                *(f"{m}-short" for m in PAIR_MODELS),
                                *(f"{m}-docs" for m in DOCUMENT_MODELS), "deepseek", "deepseek-docs-short")]
    # First half of "1 process -> sep2" (the second half runs in the sep2 launch).
    references.append(setup.run("single-to-sep2", exit_interval=STOP))
    references.append(setup.run("single-to-cp2", exit_interval=STOP))
    references.append(argv(setup.files["llama-pp"], setup.reference("llama-eval"), **EVALUATION))
    run_single(references, setup.work, "single")
    return setup


def test_sep2_every_family_and_resume(runs):
    result = run_launch(2, [runs.run(f"{model}-sep2", model, **SEP2) for model in (*MODELS, *SEP_CP_MODELS)] + [
        runs.run("llama-sep2-recompute", recompute=True, recompute_granularity="core_attn", **SEP2),
        runs.run("bloom-sep2-recompute", "bloom", recompute=True, **SEP2),
        runs.run("qwen2-sep2-recompute-full_attn", "qwen2", recompute=True, recompute_granularity="full_attn", **SEP2),
        runs.run("single-to-sep2", **SEP2),
        runs.run("sep2-to-single", exit_interval=STOP, **SEP2),
    ] + [runs.run(f"{model}-cp2", model, **CP2) for model in (*MODELS, *SEP_CP_MODELS)] + [
        runs.run("llama-cp2-recompute", recompute=True, recompute_granularity="core_attn", **CP2),
        runs.run("bloom-cp2-recompute-full_attn", "bloom", recompute=True, recompute_granularity="full_attn", **CP2),
        runs.run("single-to-cp2", **CP2),
        runs.run("cp2-to-single", exit_interval=STOP, **CP2),
    ] + [runs.run(f"{model}-{name}", model, **degrees) for model in MOE_MODELS
         for name, degrees in (("sep2", SEP2), ("cp2", CP2))] + [
        runs.run(f"{model}-docs-{name}", f"{model}-docs", **degrees) for model, name, degrees in DOCUMENT_RUNS] + [
        # the GPU kernels' branches through their CPU stand-ins: sdpa's flash after sep's all-to-all, the
        # ring's FlashBlocks (Bloom: ALiBi as the blocks' additive mask), Mixtral's experts under cp
        run_spec(name, runs.run(name, model, **degrees, **KERNEL_OPTIONS)) for name, model, degrees in KERNEL_RUNS] + [
        # packed documents on the flash path under sep: flashmask_attention on the whole sequence's row indices
        # after the all-to-all (rotary positions restarting per document, this rank's tokens of them)
        runs.kernels("llama-docs-sep2-kernels", "llama-docs", **SEP2),
        # ... and under cp: each ring block on flashmask_attention with the block's own row indices
        runs.kernels("llama-docs-cp2-kernels", "llama-docs", **CP2),
        runs.run("deepseek-sep2", "deepseek", **SEP2), runs.run("deepseek-cp2", "deepseek", **CP2)],
        runs.work, "sep2", timeout=1800)
    run_single([runs.run("sep2-to-single"), runs.run("cp2-to-single")], runs.work, "after-sep2")
    runs.check([(f"{model}-sep2", model) for model in (*MODELS, *SEP_CP_MODELS)] + [
        ("llama-sep2-recompute", "llama"), ("bloom-sep2-recompute", "bloom"),
        ("qwen2-sep2-recompute-full_attn", "qwen2"), ("single-to-sep2", "llama"), ("sep2-to-single", "llama")])
    runs.check([(f"{model}-cp2", model) for model in (*MODELS, *SEP_CP_MODELS)] + [
        ("llama-cp2-recompute", "llama"), ("bloom-cp2-recompute-full_attn", "bloom"), ("single-to-cp2", "llama"),
        ("cp2-to-single", "llama")])
    runs.check([(f"{model}-{name}", model) for model in MOE_MODELS for name in ("sep2", "cp2")])
    runs.check([(name, model) for name, model, _ in KERNEL_RUNS])
    # packed documents: the same masked training as one process (test_documents.py proves the masks matter)
    runs.check([(f"{model}-docs-{name}", f"{model}-docs") for model, name, _ in DOCUMENT_RUNS]
               + [("llama-docs-sep2-kernels", "llama-docs"), ("llama-docs-cp2-kernels", "llama-docs")])
    runs.check_stand_ins(result, "llama-docs-sep2-kernels", DOCUMENT_KERNELS)
    runs.check_stand_ins(result, "llama-docs-cp2-kernels", DOCUMENT_KERNELS)
    if DEVICE == "cpu":  # FlashMask per ring block: each layer's forward (one fused rope call) computes the
        # diagonal block and the other one unless the documents mask it entirely; backward the same blocks
        for rank, seen in sorted(result.results().items()):
            calls = seen["observations"][str(runs.out("llama-docs-cp2-kernels"))]["kernel_calls"]
            rope, blocks = calls["fused_rotary_position_embedding"], calls["flashmask_attention"]
            assert rope < blocks <= 2 * rope and calls["flashmask_attention_grad"] == blocks, (rank, calls)
            assert not calls.get("flash_attn"), (rank, calls)
    for model, name, _ in DOCUMENT_RUNS:
        assert run_record(runs.out(f"{model}-docs-{name}"))["documents"]["document_masks"], model
    for name, model, _ in KERNEL_RUNS:
        stand_ins = run_record(runs.out(name))["built"]["kernels"]["stand_ins"]
        rope = ["fused_rotary_position_embedding"] if model != "bloom" else []
        norm = ["fast_ln"] if model == "bloom" else ["fused_rms_norm_quant"]
        assert DEVICE != "cpu" or stand_ins == sorted(["flash_attn", "flash_attn_grad"] + rope + norm), (name, stand_ins)
        runs.check_stand_ins(result, name, tuple(["flash_attn", "flash_attn_grad"] + rope + norm))  # on every rank
        if "cp2" in name:  # the ring's transfers overlap its blocks, as on NCCL (gloo: the batch_isend_irecv stand-in)
            assert run_record(runs.out(name))["built"]["context_parallel"]["transfers"] == "overlapped", name
    for name in ("deepseek-sep2", "deepseek-cp2"):
        check_deepseek(runs, name)
    for name in ("sep2", "cp2"):  # ERNIE 4.5 MoE's correction bias (layer 1) moved as one process's
        assert_same_router_biases(runs.reference("ernie4_5_moe-short"), runs.out(f"ernie4_5_moe-short-{name}"),
                                  step=SHORT["max_steps"], expected=("layers.1.mlp",))
    record = run_record(runs.out("gpt3-cp2"))
    assert record["strategy"] == "cp2" and record["layout"]["context_parallel_degree"] == 2
    assert record["built"]["context_parallel"] == {"degree": 2, "tokens_per_rank": 16, "chunks_of_2cp": [0, 3],
                                                   "transfers": "blocking" if DEVICE == "cpu" else "overlapped",
                                                   "model_wrappers": ["SegmentParallel"]}
    record = run_record(runs.out("llama-sep2"))
    assert record["strategy"] == "sep2" and record["global_batch_size"] == 8
    assert record["layout"]["sep_parallel_degree"] == 2 and record["built"]["layout"]["sep_parallel_degree"] == 2
    assert record["built"]["segment_parallel"] == {"degree": 2, "tokens_per_rank": 16, "attention_heads_per_rank": 2,
                                                   "model_wrappers": ["SegmentParallel"]}
    assert run_record(runs.out("sep2-to-single"))["strategy"] == "dp1"
    for model in (*MODELS, *SEP_CP_MODELS, *MOE_MODELS):  # every family's run built the split: 16 of the 32 tokens per rank
        built = run_record(runs.out(f"{model}-sep2"))["built"]
        assert built["segment_parallel"]["degree"] == 2 and built["segment_parallel"]["tokens_per_rank"] == 16, model
        built = run_record(runs.out(f"{model}-cp2"))["built"]
        assert built["context_parallel"]["chunks_of_2cp"] == [0, 3] and built["context_parallel"]["tokens_per_rank"] == 16
    for name, granularity in (("llama-sep2-recompute", "core_attn"), ("qwen2-sep2-recompute-full_attn", "full_attn"),
                              ("llama-cp2-recompute", "core_attn"), ("bloom-cp2-recompute-full_attn", "full_attn"),
                              ("bloom-sep2-recompute", "full")):
        recomputed = run_record(runs.out(name))["built"]["recompute"]
        assert set(recomputed) == {granularity} and recomputed[granularity], (name, recomputed)


def test_sep2_with_tp2_dp2_and_sharding(runs):
    """4 processes: sep2 x tp2 (the q heads split by tp, then by sep), sep2 x dp2, sep2 x sharding 2 at
    stages 1, 2 and 3 (and the same with cp2)."""
    tp2 = {**SEP2, "tensor_parallel_degree": 2}
    cp2tp2 = {**CP2, "tensor_parallel_degree": 2}
    # the kernel runs last: once installed, the stand-ins stay in the process (and open the ring's overlap)
    sep2tp2 = run_launch(4, [runs.run("llama-sep2tp2-sp", **tp2, sequence_parallel=True),
                             runs.run("bloom-sep2tp2", "bloom", **tp2),
                             runs.run("gpt3-sep2tp2-sp", "gpt3", **tp2, sequence_parallel=True),
                             runs.run("llama-cp2tp2-sp", **cp2tp2, sequence_parallel=True),
                             runs.run("bloom-cp2tp2", "bloom", **cp2tp2),
                             runs.run("mixtral-capped-sep2tp2-sp", "mixtral-capped", **tp2, sequence_parallel=True),
                             runs.run("qwen2_moe-cp2tp2-sp", "qwen2_moe", **cp2tp2, sequence_parallel=True),
                             # q/k norms per head on tp's heads, then sep's (or the ring's chunks); SP's slices
                             *[runs.run(f"{model}-{name}-sp", f"{model}-short", **degrees, sequence_parallel=True)
                               for model in PAIR_MODELS for name, degrees in (("sep2tp2", tp2), ("cp2tp2", cp2tp2))],
                             *[runs.run(name, "deepseek-docs-short", **degrees) for name, degrees in DEEPSEEK_PAIRS],
                             *[runs.run(name, model, **degrees, sequence_parallel=True)
                               for name, model, degrees in MOE_PAIRS],
                             # sdpa's flash on the heads of tp, then of sep; the fused RMSNorm on SP's sequence slices
                             runs.kernels("llama-sep2tp2-sp-kernels", **tp2, sequence_parallel=True),
                             # the ring's FlashBlocks on tp's heads; the fused RMSNorm on SP's slices of cp's chunks
                             runs.kernels("llama-cp2tp2-sp-kernels", **cp2tp2, sequence_parallel=True)],
                         runs.work, "sep2tp2", timeout=1800)
    runs.check([("llama-sep2tp2-sp", "llama"), ("bloom-sep2tp2", "bloom"), ("gpt3-sep2tp2-sp", "gpt3"),
                ("llama-cp2tp2-sp", "llama"), ("bloom-cp2tp2", "bloom"),
                ("mixtral-capped-sep2tp2-sp", "mixtral-capped"), ("qwen2_moe-cp2tp2-sp", "qwen2_moe"),
                ("llama-sep2tp2-sp-kernels", "llama"), ("llama-cp2tp2-sp-kernels", "llama")]
               + [(f"{model}-{name}-sp", f"{model}-short") for model in PAIR_MODELS for name in ("sep2tp2", "cp2tp2")]
               + [(name, model) for name, model, _ in MOE_PAIRS])  # (MOE_MODELS: their router metrics too)
    for name, model, _ in MOE_PAIRS:  # 4 heads: tp's 2 a rank, sep's 1 of them; cp: chunks 0 and 3 of 4
        record = run_record(runs.out(name))
        built = record["built"]
        assert record["layout"]["tensor_parallel_degree"] == 2 and built["sequence_parallel"]["enabled"], name
        if "sep2" in name:
            assert built["segment_parallel"]["attention_heads_per_rank"] == 1, built["segment_parallel"]
        else:
            assert built["context_parallel"]["chunks_of_2cp"] == [0, 3], built["context_parallel"]
    # ERNIE 4.5 MoE's correction bias (layer 1) moved by the load of the whole sequences, counted once over tp
    assert_same_router_biases(runs.reference("ernie4_5_moe-short"), runs.out(MOE_PAIRS[1][0]),
                              step=SHORT["max_steps"], expected=("layers.1.mlp",))
    for name, _ in DEEPSEEK_PAIRS:  # (packed documents through MLA: test_documents.py proves its masks matter)
        check_deepseek(runs, name, "deepseek-docs-short")
        record = run_record(runs.out(name))
        assert record["layout"]["tensor_parallel_degree"] == 2 and record["documents"]["document_masks"], name
    runs.check_stand_ins(sep2tp2, "llama-sep2tp2-sp-kernels")
    runs.check_stand_ins(sep2tp2, "llama-cp2tp2-sp-kernels", micro_batches=4, ring=True)  # tp's ranks: all 4
    assert run_record(runs.out("bloom-cp2tp2"))["strategy"] == "tp2cp2"
    assert run_record(runs.out("bloom-sep2tp2"))["strategy"] == "tp2sep2"
    sep2dp2 = run_launch(4, [runs.run("llama-sep2dp2", **SEP2, gradient_accumulation_steps=2),
                             runs.run("qwen2-sep2dp2", "qwen2", **SEP2, gradient_accumulation_steps=2),
                             runs.run("llama-cp2dp2", **CP2, gradient_accumulation_steps=2),
                             # sdpa's flash after the all-to-all and the ring's FlashBlocks, the dp group's sum
                             runs.kernels("llama-sep2dp2-kernels", **SEP2, gradient_accumulation_steps=2),
                             runs.kernels("llama-cp2dp2-kernels", **CP2, gradient_accumulation_steps=2)],
                         runs.work, "sep2dp2", timeout=1800)
    runs.check([("llama-sep2dp2", "llama"), ("qwen2-sep2dp2", "qwen2"), ("llama-cp2dp2", "llama"),
                ("llama-sep2dp2-kernels", "llama"), ("llama-cp2dp2-kernels", "llama")])
    for name in ("llama-sep2dp2-kernels", "llama-cp2dp2-kernels"):
        runs.check_stand_ins(sep2dp2, name)
    record = run_record(runs.out("llama-sep2dp2"))
    assert record["strategy"] == "sep2dp2" and record["global_batch_size"] == 8
    # Sharding 2 at stages 1, 2 (cp2: every family) and 3. Under stages 2 and 3 the group-sharded wrappers
    # reduce over the sharding group only; the sum over the sep group is ours (llm_pretrain/parallel/distributed.py
    # sum_sharded_gradients_over_sep_group; without it the ranks' weights part). At these sizes every
    # gradient is in stage 2's buffer and stage 3 slices nothing: the gradients outside the buffer and
    # stage 3's slices are summed in tests/test_real_size.py (cp2sd2_stage2, sep2sd2_stage3).
    sharded = {"gradient_accumulation_steps": 2}
    stage2, stage3 = {**sharded, "sharding": "stage2"}, {**sharded, "sharding": "stage3"}
    sep2sd2 = run_launch(4, [runs.run("llama-sep2sd2", **SEP2, sharding="stage1", **sharded),
                             runs.run("llama-cp2sd2", **CP2, sharding="stage1", **sharded),
                             runs.run("llama-sep2sd2-stage2", **SEP2, **stage2),
                             *[runs.run(f"{model}-cp2sd2-stage2", model, **CP2, **stage2) for model in MODELS],
                             *[runs.run(f"{model}-{name}sd2-stage{stage}", f"{model}-short", **degrees,
                                        sharding=f"stage{stage}", per_device_train_batch_size=1)
                               for model, name, degrees, stage in PAIR_SHARDING],
                             runs.run("qwen2-sep2sd2-stage3", "qwen2", **SEP2, **stage3),
                             runs.run("bloom-cp2sd2-stage3", "bloom", **CP2, **stage3),
                             # the ring's FlashBlocks under GroupShardedStage2 (its gradient buffer, our sep-group sum)
                             runs.kernels("llama-cp2sd2-stage2-kernels", **CP2, **stage2),
                             # ... under stages 1 and 3, and sdpa's flash after sep's all-to-all under stage 1 and 3
                             runs.kernels("llama-cp2sd2-kernels", **CP2, sharding="stage1", **sharded),
                             runs.kernels("llama-cp2sd2-stage3-kernels", **CP2, **stage3),
                             runs.kernels("llama-sep2sd2-kernels", **SEP2, sharding="stage1", **sharded),
                             runs.kernels("llama-sep2sd2-stage3-kernels", **SEP2, **stage3),
                             *[runs.run(name, "deepseek", **degrees) for name, degrees in DEEPSEEK_SHARDING]],
                         runs.work, "sep2sd2", timeout=1800)
    runs.check([("llama-sep2sd2", "llama"), ("llama-cp2sd2", "llama"), ("llama-sep2sd2-stage2", "llama"),
                *[(f"{model}-cp2sd2-stage2", model) for model in MODELS],
                *[(f"{model}-{name}sd2-stage{stage}", f"{model}-short") for model, name, _, stage in PAIR_SHARDING],
                ("qwen2-sep2sd2-stage3", "qwen2"), ("bloom-cp2sd2-stage3", "bloom"),
                ("llama-cp2sd2-stage2-kernels", "llama"), ("llama-cp2sd2-kernels", "llama"),
                ("llama-cp2sd2-stage3-kernels", "llama"), ("llama-sep2sd2-kernels", "llama"),
                ("llama-sep2sd2-stage3-kernels", "llama")])
    runs.check_stand_ins(sep2sd2, "llama-cp2sd2-stage2-kernels")
    for name in ("llama-cp2sd2-kernels", "llama-cp2sd2-stage3-kernels", "llama-sep2sd2-kernels",
                 "llama-sep2sd2-stage3-kernels"):
        runs.check_stand_ins(sep2sd2, name, micro_batches=2, ring="cp2" in name)
    assert run_record(runs.out("llama-cp2sd2"))["strategy"] == "cp2sd2_stage1"
    for name, _ in DEEPSEEK_SHARDING:  # MTP, the bias rule, the sequence-wise loss
        check_deepseek(runs, name)
    for model, name, _, stage in PAIR_SHARDING:  # "-short": one sample a rank, one micro-batch of 2 a step
        record = run_record(runs.out(f"{model}-{name}sd2-stage{stage}"))
        assert record["strategy"] == f"{name}sd2_stage{stage}" and record["global_batch_size"] == 2, (model, record)
        # stage 1: fleet's sharding optimizer (DygraphShardingOptimizer) over the 2 data replicas
        assert record["built"]["sharding"]["stage"] == stage and record["built"]["sharding"]["degree"] == 2, model
    for name, strategy, stage in (("llama-sep2sd2-stage2", "sep2sd2_stage2", 2),
                                  ("llama-cp2sd2-stage2", "cp2sd2_stage2", 2),
                                  ("qwen2-sep2sd2-stage3", "sep2sd2_stage3", 3),
                                  ("bloom-cp2sd2-stage3", "cp2sd2_stage3", 3),
                                  *[(name, f"{name.split('-')[1]}_stage2", 2) for name, _ in DEEPSEEK_SHARDING],
                                  *[(f"{model}-{name}sd2-stage{stage}", f"{name}sd2_stage{stage}", stage)
                                    for model, name, _, stage in PAIR_SHARDING if stage > 1]):
        record = run_record(runs.out(name))
        batch = 2 if name.split("-")[0] in PAIR_MODELS else 8  # (PAIR_MODELS': "-short")
        assert record["strategy"] == strategy and record["global_batch_size"] == batch, (name, record["strategy"])
        built = record["built"]
        assert built["sharding"]["stage"] == stage and built["sharding"]["gradients_summed_over_sep_group"] == 2, name
        wrappers = (built["segment_parallel"] or built["context_parallel"])["model_wrappers"]
        assert wrappers == [f"GroupShardedStage{stage}", "SegmentParallel"], (name, wrappers)


def test_cp4(runs):
    """4 processes of ring attention: 8 chunks of 4 tokens, rank i holding chunks i and 7-i."""
    cp4 = {"context_parallel_degree": 4}
    result = run_launch(4, [runs.run(f"{model}-cp4", model, **cp4) for model in ("llama", "bloom", "gpt3", "qwen2")]
                        + [runs.kernels("llama-cp4-kernels", **cp4)],  # the ring of 4: 3 passes of k/v a layer
                        runs.work, "cp4", timeout=1800)
    runs.check([(f"{model}-cp4", model) for model in ("llama", "bloom", "gpt3", "qwen2")]
               + [("llama-cp4-kernels", "llama")])
    runs.check_stand_ins(result, "llama-cp4-kernels")
    assert run_record(runs.out("llama-cp4"))["strategy"] == "cp4"
    assert run_record(runs.out("llama-sep2sd2"))["strategy"] == "sep2sd2_stage1"


def test_sep2_mechanism(tmp_path, embedded_corpus):
    """Each rank holds 16 of the 32 tokens between layers; the all-to-all runs in forward (q, k, v
    to heads, the output back) and in backward (the same four, reversed); before the optimizer's
    sep reduction each rank's gradient covers only its own tokens (they differ). A mixture of experts
    routes each rank's tokens and sums the router statistics over the sep group."""
    layers = LAYERS
    # The key in the argument file itself, as a PaddleNLP file gives it (no override).
    args = write_json(tmp_path / "llama.json", base_arguments(embedded_corpus, tmp_path, max_steps=1, save_steps=0,
                                                              num_hidden_layers=layers, sep_parallel_degree=2))
    # sep2 and cp2 train 2 steps: the references of the same runs with fleet's master gradients (below).
    spec = write_json(tmp_path / "runs.json", [{"name": "sep2", "argv": argv(args, tmp_path / "sep2", max_steps=2)},
                                               {"name": "cp2", "argv": argv(args, tmp_path / "cp2", sep_parallel_degree=1,
                                                                            max_steps=2,
                                                                            **CP2)},
                                               {"name": "mixtral", "argv": argv(args, tmp_path / "mixtral",
                                                                                model_name_or_path="mixtral-tiny",
                                                                                num_hidden_layers=2,
                                                                                moe_capacity_factor=0.5)}]
                      + [{"name": f"{name}-master-grad", "argv": argv(args, tmp_path / f"{name}-master-grad",
                                                                      max_steps=2, **degrees), "fp32_master_grad": True}
                         for name, degrees in (("sep2", {}), ("cp2", {"sep_parallel_degree": 1, **CP2}))])
    result = launch(REPO_ROOT / "tests" / "workers" / "mechanism_runs.py", 2, [str(spec)], log_dir=tmp_path / "log",
                    timeout=600).check()
    ranks = result.results()
    for rank, observed in ranks.items():
        seen = observed["sep2"]
        shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
        assert shapes == {(2, 16, 64)}, f"rank {rank}: hidden states between layers {shapes}"
        calls = seen["all_to_all"]
        micro_batches = 4 * 2  # per step, 2 steps
        assert len(calls.get("forward", [])) == 4 * layers * micro_batches, calls.keys()
        assert len(calls.get("backward", [])) == 4 * layers * micro_batches, calls.keys()
        # q (4 heads) and k, v (2 kv heads) of 16 tokens to heads; the output (32 tokens, 2 heads) back.
        forward_kinds = {(tuple(shape), split, concat) for shape, split, concat in calls["forward"]}
        assert forward_kinds == {((2, 16, 4, 16), 2, 1), ((2, 16, 2, 16), 2, 1), ((2, 32, 2, 16), 1, 2)}, forward_kinds
        assert "SegmentParallel" in seen["model_classes"]
    before_step = [[value for kind, value in ranks[r]["sep2"]["grad_fingerprints"] if kind == "step"][0]
                   for r in (0, 1)]
    assert before_step[0] != pytest.approx(before_step[1], rel=1e-6), "gradients equal before the sep reduction"
    built = run_record(tmp_path / "sep2")["built"]
    assert built["segment_parallel"]["degree"] == 2
    # Ring attention: no all-to-all; per layer and micro-batch one pass of (k, v) in forward; in backward
    # one of (k, v), started before the first block's gradients, and one of (dk, dv) after each block
    # (the second brings each rank its own block's gradient); each rank 16 tokens (chunks i, 3 - i of 8).
    for rank, observed in ranks.items():
        seen = observed["cp2"]
        shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
        assert shapes == {(2, 16, 64)}, f"rank {rank}: hidden states between layers {shapes}"
        assert not seen["all_to_all"]
        ring = seen["ring"]
        kv = [[2, 16, 2, 16], [2, 16, 2, 16]]
        assert ring.get("forward") == [kv] * (layers * 4 * 2), ring.keys()  # 4 micro-batches x 2 steps
        assert ring.get("backward") == [kv, kv, kv] * (layers * 4 * 2), ring.keys()
    before_step = [[value for kind, value in ranks[r]["cp2"]["grad_fingerprints"] if kind == "step"][0] for r in (0, 1)]
    assert before_step[0] != pytest.approx(before_step[1], rel=1e-6), "gradients equal before the cp reduction"
    assert run_record(tmp_path / "cp2")["built"]["context_parallel"]["chunks_of_2cp"] == [0, 3]

    # amp_master_grad under sep2 and cp2 alone (issue 33, finding 9: no longer refused as pure data parallelism):
    # fleet's hybrid optimizer sums main_grad over the sep group; 2 steps with fleet's float32 master gradients
    # equal the same 2 steps without (losses and grad norms: the second step's loss is taken on the weights the
    # first update left, its norm on gradients zeroed in between), and every gradient was in main_grad.
    for name in ("sep2", "cp2"):
        plain, master = train_records(tmp_path / name), train_records(tmp_path / f"{name}-master-grad")
        assert [r["step"] for r in master] == [r["step"] for r in plain] == [1, 2]
        for a, b in zip(plain, master):
            assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5, (name, a, b)
        for rank, observed in ranks.items():
            seen = observed[f"{name}-master-grad"]["master_grads"]
            assert seen["params"] > 0 and seen["with_main_grad"] == seen["params"], (name, rank, seen)
            assert "master_grads" not in observed[name]

    # Mixture of experts under sep2: each rank routes its 2 x 16 tokens, but its router losses (and the
    # metrics) come from statistics of all 2 x 32 tokens of the micro-batch (k = 2 picks each), summed over
    # the sep group once per layer and micro-batch; that sum's backward carries the aux and z losses'
    # gradient to this rank's router probabilities ([8 picks, 8 probability sums, z, dropped]).
    for rank, observed in ranks.items():
        router = observed["mixtral"]["router"]
        forwards = 2 * 4  # layers x micro-batches
        assert router["routed_tokens"] == [32] * forwards, router
        assert router["stats"] == [[32, 64, 128.0]] * forwards, router
        assert router["sum_backward"] == [[18]] * forwards, router


def eval_losses(output_dir: Path) -> list[tuple]:
    with open(output_dir / "train_log.jsonl", encoding="utf-8") as f:
        return [(r["split"], r["step"], r["loss"]) for r in map(json.loads, f) if r["event"] == "eval"]


def test_pipeline_with_cp2_and_sep2(runs):
    """4 processes, pp2 x cp2 and pp2 x sep2 (fleet's 1F1B pipeline over the sep group), in one launch of
    the mechanism worker, so that each training is both compared with one process and watched:
    LLaMA (global RoPE positions; also evaluates), Bloom (ALiBi, tied embedding on both pipeline ends),
    GPT-3 (learned positions; full recompute of 2-layer segments, the ring again in backward), and
    LLaMA under sep2. The first stage splits the token ids, the last stage splits the labels and
    gathers the chunks' losses (models/decoder.py Embeddings, causal_lm_loss); between the stages
    each rank sends its own 16 of the 32 tokens (the hidden states entering every layer, stage 1's
    first layer's being what the p2p brought); the ring (cp) and the all-to-all (sep) run in
    forward and backward on every stage. Packed documents (LLaMA, 2 layers: one a stage) under both:
    the whole sequences' document ids travel with the micro-batch to stage 1, whose ring masks each
    block from them (cp) or whose attention masks the whole sequence after the all-to-all (sep)."""
    pp2 = {"pipeline_parallel_degree": 2}
    spec = [{"name": "llama-cp2pp2", "argv": runs.run("llama-cp2pp2", "llama-pp", **CP2, **pp2, **EVALUATION)},
            {"name": "bloom-cp2pp2", "argv": runs.run("bloom-cp2pp2", "bloom-pp", **CP2, **pp2)},
            {"name": "gpt3-cp2pp2-recompute", "argv": runs.run("gpt3-cp2pp2-recompute", "gpt3-pp", **CP2, **pp2,
                                                                  recompute=True, pp_recompute_interval=2)},
            {"name": "llama-sep2pp2", "argv": runs.run("llama-sep2pp2", "llama-pp", **SEP2, **pp2)},
            # packed documents: the ids passed on between the stages with the hidden states (models/pipeline.py)
            *({"name": name, "argv": runs.run(name, "llama-docs", **degrees, **pp2)} for name, degrees, _ in DOCUMENT_PP2),
            # the ring's FlashBlocks and sdpa's flash after the all-to-all on both stages of the 1F1B pipeline,
            # through the CPU stand-ins (last: once installed, the stand-ins stay in the process)
            runs.kernels("llama-cp2pp2-kernels", "llama-pp", **CP2, **pp2),
            runs.kernels("llama-sep2pp2-kernels", "llama-pp", **SEP2, **pp2)]
    result = launch(REPO_ROOT / "tests" / "workers" / "mechanism_runs.py", 4,
                    [str(write_json(runs.work / "pp2.runs.json", spec))], log_dir=runs.work / "pp2.log",
                    timeout=1800).check()
    steps, micro_batches, layers_per_stage = PIPELINE_STEPS, 4, PIPELINE_LAYERS // 2
    calls = steps * micro_batches * layers_per_stage
    ranks = result.results()
    for rank, observed in ranks.items():
        for name, seen in observed.items():
            shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
            assert shapes == {(2, 16, 64)}, f"rank {rank} {name}: hidden states entering its layers {shapes}"
            assert len(seen["decoder_input_shapes"]) == (LAYERS // 2 if "docs" in name else layers_per_stage)
            assert "PipelineParallel" in seen["model_classes"]
        first_stage = "0" in observed["bloom-cp2pp2"]["decoder_input_shapes"]  # holds decoder layer 0
        kv = [[2, 16, 4, 16]] * 2  # Bloom: k and v of 16 tokens, 4 heads of 16 (no grouped kv heads)
        ring = observed["bloom-cp2pp2"]["ring"]
        assert ring.get("forward") == [kv] * calls and ring.get("backward") == [kv, kv, kv] * calls, \
            f"rank {rank}: ring passes {[(k, len(v)) for k, v in ring.items()]}"
        # Full recompute: each layer's forward runs again in backward, but for layer 0 (in one segment
        # with the embedding, whose input needs no gradient: PipelineLayer does not recompute it).
        ring = observed["gpt3-cp2pp2-recompute"]["ring"]
        assert len(ring.get("forward", [])) == 2 * calls - (steps * micro_batches if first_stage else 0), \
            f"rank {rank}: {len(ring.get('forward', []))} forward ring passes"
        assert len(ring.get("backward", [])) == 3 * calls
        assert not observed["llama-sep2pp2"]["ring"] and not observed["llama-cp2pp2"]["all_to_all"]
        to_heads = observed["llama-sep2pp2"]["all_to_all"]
        assert len(to_heads.get("forward", [])) == 4 * calls and len(to_heads.get("backward", [])) == 4 * calls
        docs = STEPS["max_steps"] * micro_batches * LAYERS // 2  # one layer a stage, 2 steps ("llama-docs")
        ring, to_heads = observed["llama-docs-cp2pp2"]["ring"], observed["llama-docs-sep2pp2"]["all_to_all"]
        assert len(ring.get("forward", [])) == docs and len(ring.get("backward", [])) == 3 * docs, rank
        assert len(to_heads.get("forward", [])) == 4 * docs and len(to_heads.get("backward", [])) == 4 * docs, rank
    runs.check([("llama-cp2pp2", "llama-pp"), ("bloom-cp2pp2", "bloom-pp"), ("gpt3-cp2pp2-recompute", "gpt3-pp"),
                ("llama-sep2pp2", "llama-pp"), ("llama-cp2pp2-kernels", "llama-pp"), ("llama-sep2pp2-kernels", "llama-pp")]
               + [(name, "llama-docs") for name, _, _ in DOCUMENT_PP2])
    for name, _, strategy in DOCUMENT_PP2:
        record = run_record(runs.out(name))
        assert record["documents"]["document_masks"] and record["strategy"] == strategy, (name, record["strategy"])
    for name in ("llama-cp2pp2-kernels", "llama-sep2pp2-kernels"):
        assert_stand_ins_ran([observed[name] for _, observed in sorted(ranks.items())], runs.out(name), LLAMA_KERNELS)
    ref, got = eval_losses(runs.reference("llama-eval")), eval_losses(runs.out("llama-cp2pp2"))
    assert [r[:2] for r in got] == [r[:2] for r in ref] == [("valid", 1), ("valid", 2)]
    assert max(abs(a[2] - b[2]) for a, b in zip(ref, got)) <= 1e-5, (ref, got)
    record = run_record(runs.out("bloom-cp2pp2"))
    assert record["strategy"] == "pp2cp2" and record["global_batch_size"] == 8
    assert record["built"]["context_parallel"] == {"degree": 2, "tokens_per_rank": 16, "chunks_of_2cp": [0, 3],
                                                   "transfers": "blocking" if DEVICE == "cpu" else "overlapped",
                                                   "model_wrappers": ["PipelineParallel"]}
    assert run_record(runs.out("llama-sep2pp2"))["strategy"] == "pp2sep2"


def test_interleaved_pipeline_with_cp2_and_sep2(runs):
    """8 processes, pp4 x cp2 and pp4 x sep2 with 2 virtual stages (fleet's interleaved schedule needs
    pp > 2; 8 micro-batches of 1 = 2 x pp, so PipelineParallelWithInterleave runs, not its FthenB
    variant): LLaMA under cp2, Bloom (ALiBi, tied embedding) under sep2, each chunk of one layer
    receiving 16 of the 32 tokens from the previous stage. Both with the kernel options through their
    CPU stand-ins (the suite's budget: these runs, not beside them): the ring's FlashBlocks and its
    overlapped transfers, sdpa's flash with ALiBi's additive mask after the all-to-all, the fused rotary
    embedding and RMSNorm, the fast LayerNorm; each rank's calls exactly as many as its two layers (and
    the first stage's embedding LayerNorm, the last stage's final norm) make. The plain ring and sep
    paths stay proven by cp2, cp4, pp2 x cp2 and the sep runs above."""
    interleaved = {"pipeline_parallel_degree": 4, "virtual_pp_degree": 2, "per_device_train_batch_size": 1,
                   "gradient_accumulation_steps": 8}
    llama, bloom = "llama-cp2pp4vpp2-kernels", "bloom-sep2pp4vpp2-kernels"
    spec = [runs.kernels(llama, "llama-pp", **CP2, **interleaved),
            runs.kernels(bloom, "bloom-pp", **SEP2, **interleaved)]
    result = launch(REPO_ROOT / "tests" / "workers" / "mechanism_runs.py", 8,
                    [str(write_json(runs.work / "pp4vpp2.runs.json", spec))], log_dir=runs.work / "pp4vpp2.log",
                    timeout=1800).check()
    forwards, layers = PIPELINE_STEPS * 8, PIPELINE_LAYERS // 4  # steps x micro-batches; layers (chunks of one layer) per rank
    calls = forwards * layers
    ranks = result.results()
    counts = {llama: [], bloom: []}
    for rank, observed in sorted(ranks.items()):
        for name, seen in observed.items():
            shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
            assert shapes == {(1, 16, 64)}, f"rank {rank} {name}: hidden states entering its layers {shapes}"
            assert "PipelineParallelWithInterleave" in seen["model_classes"]
        ring = observed[llama]["ring"]
        assert len(ring.get("forward", [])) == calls and len(ring.get("backward", [])) == 3 * calls
        to_heads = observed[bloom]["all_to_all"]
        assert len(to_heads.get("forward", [])) == 4 * calls and len(to_heads.get("backward", [])) == 4 * calls
        held = observed[llama]["decoder_input_shapes"]  # the decoder layers this rank holds
        first, last = "0" in held, str(PIPELINE_LAYERS - 1) in held
        counts[llama].append(llama_kernel_calls(8, ring=True, layers=layers, final_norm=last, steps=PIPELINE_STEPS))
        counts[bloom].append({"flash_attn": calls, "flash_attn_grad": calls,
                              "fast_ln": forwards * (2 * layers + first + last)})  # + the embedding LayerNorm
    runs.check([(llama, "llama-pp"), (bloom, "bloom-pp")])
    for name, kernels in ((llama, LLAMA_KERNELS), (bloom, ("flash_attn", "flash_attn_grad", "fast_ln"))):
        assert_stand_ins_ran([seen[name] for _, seen in sorted(ranks.items())], runs.out(name), kernels, counts[name])
    assert run_record(runs.out(llama))["strategy"] == "pp4vpp2cp2"
    assert run_record(runs.out(llama))["built"]["context_parallel"]["transfers"] == "overlapped"
    assert run_record(runs.out(bloom))["strategy"] == "pp4vpp2sep2"
