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
                        2 (cp2: every family) and 3; cp4 (LLaMA, Bloom's ALiBi, GPT-3, Qwen2 with 1 kv head)
    mechanism (sep2)    each rank holds s/2 tokens between layers; the all-to-all runs 4 times per
                        layer in forward and 4 times in backward; the ranks' gradients differ
                        before the optimizer's sep reduction
    mechanism (cp2)     each rank holds s/2 tokens between layers; per layer the ring passes k/v
                        once in forward and k/v + dk/dv once, dk/dv once more, in backward
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_utils import REPO_ROOT, launch
from models.families import FAMILIES
from parity_utils import (
    argv, assert_every_replica_matches, assert_same_training, base_arguments, run_launch, run_record, run_single,
    write_json,
)

# Every dense family record (mixture-of-experts models refuse sep and cp: llm_pretrain/layout.py
# check_mixture_of_experts) and llama3-tiny (Llama 3.1's rotary scaling).
MODELS = tuple(name for name, family in FAMILIES.items() if not family.architectures[family.tiny].is_moe) + ("llama3",)
SEP2 = {"sep_parallel_degree": 2}
CP2 = {"context_parallel_degree": 2}
STOP = 3  # resume pairs stop after this step


class Runs:
    def __init__(self, work: Path, corpus: dict):
        self.work = work
        self.files = {model: write_json(work / f"{model}.json", base_arguments(
            corpus, work, model_name_or_path=f"{model}-tiny")) for model in MODELS}

    def reference(self, model: str) -> Path:
        return self.work / "single" / model

    def out(self, name: str) -> Path:
        return self.work / "runs" / name

    def run(self, name: str, model: str = "llama", **overrides) -> list[str]:
        return argv(self.files[model], self.out(name), **overrides)

    def check(self, names_and_models) -> None:
        for name, model in names_and_models:
            diffs = assert_same_training(self.reference(model), self.out(name))
            diffs["every_replica"] = assert_every_replica_matches(self.reference(model), self.out(name))
            print(f"{name} vs single-process {model}: {diffs}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, embedded_corpus) -> Runs:
    setup = Runs(tmp_path_factory.mktemp("long_context"), embedded_corpus)
    references = [argv(setup.files[model], setup.reference(model)) for model in MODELS]
    # First half of "1 process -> sep2" (the second half runs in the sep2 launch).
    references.append(setup.run("single-to-sep2", exit_interval=STOP))
    references.append(setup.run("single-to-cp2", exit_interval=STOP))
    run_single(references, setup.work, "single")
    return setup


def test_sep2_every_family_and_resume(runs):
    run_launch(2, [runs.run(f"{model}-sep2", model, **SEP2) for model in MODELS] + [
        runs.run("llama-sep2-recompute", recompute=True, recompute_granularity="core_attn", **SEP2),
        runs.run("bloom-sep2-recompute", "bloom", recompute=True, **SEP2),
        runs.run("single-to-sep2", **SEP2),
        runs.run("sep2-to-single", exit_interval=STOP, **SEP2),
    ] + [runs.run(f"{model}-cp2", model, **CP2) for model in MODELS] + [
        runs.run("llama-cp2-recompute", recompute=True, recompute_granularity="core_attn", **CP2),
        runs.run("single-to-cp2", **CP2),
        runs.run("cp2-to-single", exit_interval=STOP, **CP2),
    ], runs.work, "sep2", timeout=1800)
    run_single([runs.run("sep2-to-single"), runs.run("cp2-to-single")], runs.work, "after-sep2")
    runs.check([(f"{model}-sep2", model) for model in MODELS] + [
        ("llama-sep2-recompute", "llama"), ("bloom-sep2-recompute", "bloom"),
        ("single-to-sep2", "llama"), ("sep2-to-single", "llama")])
    runs.check([(f"{model}-cp2", model) for model in MODELS] + [
        ("llama-cp2-recompute", "llama"), ("single-to-cp2", "llama"), ("cp2-to-single", "llama")])
    record = run_record(runs.out("gpt3-cp2"))
    assert record["strategy"] == "cp2" and record["layout"]["context_parallel_degree"] == 2
    assert record["built"]["context_parallel"] == {"degree": 2, "tokens_per_rank": 16, "chunks_of_2cp": [0, 3],
                                                   "model_wrappers": ["SegmentParallel"]}
    record = run_record(runs.out("llama-sep2"))
    assert record["strategy"] == "sep2" and record["global_batch_size"] == 8
    assert record["layout"]["sep_parallel_degree"] == 2 and record["built"]["layout"]["sep_parallel_degree"] == 2
    assert record["built"]["segment_parallel"] == {"degree": 2, "tokens_per_rank": 16, "attention_heads_per_rank": 2,
                                                   "model_wrappers": ["SegmentParallel"]}
    assert run_record(runs.out("sep2-to-single"))["strategy"] == "dp1"


def test_sep2_with_tp2_dp2_and_sharding(runs):
    """4 processes: sep2 x tp2 (the q heads split by tp, then by sep), sep2 x dp2, sep2 x sharding 2 at
    stages 1, 2 and 3 (and the same with cp2)."""
    tp2 = {**SEP2, "tensor_parallel_degree": 2}
    cp2tp2 = {**CP2, "tensor_parallel_degree": 2}
    run_launch(4, [runs.run("llama-sep2tp2-sp", **tp2, sequence_parallel=True),
                   runs.run("bloom-sep2tp2", "bloom", **tp2),
                   runs.run("gpt3-sep2tp2-sp", "gpt3", **tp2, sequence_parallel=True),
                   runs.run("llama-cp2tp2-sp", **cp2tp2, sequence_parallel=True),
                   runs.run("bloom-cp2tp2", "bloom", **cp2tp2)],
               runs.work, "sep2tp2", timeout=1800)
    runs.check([("llama-sep2tp2-sp", "llama"), ("bloom-sep2tp2", "bloom"), ("gpt3-sep2tp2-sp", "gpt3"),
                ("llama-cp2tp2-sp", "llama"), ("bloom-cp2tp2", "bloom")])
    assert run_record(runs.out("bloom-cp2tp2"))["strategy"] == "tp2cp2"
    assert run_record(runs.out("bloom-sep2tp2"))["strategy"] == "tp2sep2"
    run_launch(4, [runs.run("llama-sep2dp2", **SEP2, gradient_accumulation_steps=2),
                   runs.run("qwen2-sep2dp2", "qwen2", **SEP2, gradient_accumulation_steps=2),
                   runs.run("llama-cp2dp2", **CP2, gradient_accumulation_steps=2)],
               runs.work, "sep2dp2", timeout=1800)
    runs.check([("llama-sep2dp2", "llama"), ("qwen2-sep2dp2", "qwen2"), ("llama-cp2dp2", "llama")])
    record = run_record(runs.out("llama-sep2dp2"))
    assert record["strategy"] == "sep2dp2" and record["global_batch_size"] == 8
    # Sharding 2 at stages 1, 2 (cp2: every family) and 3. Under stages 2 and 3 the group-sharded wrappers
    # reduce over the sharding group only; the sum over the sep group is ours (llm_pretrain/distributed.py
    # sum_sharded_gradients_over_sep_group; without it the ranks' weights part). At these sizes every
    # gradient is in stage 2's buffer and stage 3 slices nothing: the gradients outside the buffer and
    # stage 3's slices are summed in tests/test_real_size.py (cp2sd2_stage2, sep2sd2_stage3).
    sharded = {"gradient_accumulation_steps": 2}
    stage2, stage3 = {**sharded, "sharding": "stage2"}, {**sharded, "sharding": "stage3"}
    run_launch(4, [runs.run("llama-sep2sd2", **SEP2, sharding="stage1", **sharded),
                   runs.run("llama-cp2sd2", **CP2, sharding="stage1", **sharded),
                   runs.run("llama-sep2sd2-stage2", **SEP2, **stage2),
                   *[runs.run(f"{model}-cp2sd2-stage2", model, **CP2, **stage2) for model in MODELS],
                   runs.run("qwen2-sep2sd2-stage3", "qwen2", **SEP2, **stage3),
                   runs.run("bloom-cp2sd2-stage3", "bloom", **CP2, **stage3)],
               runs.work, "sep2sd2", timeout=1800)
    runs.check([("llama-sep2sd2", "llama"), ("llama-cp2sd2", "llama"), ("llama-sep2sd2-stage2", "llama"),
                *[(f"{model}-cp2sd2-stage2", model) for model in MODELS],
                ("qwen2-sep2sd2-stage3", "qwen2"), ("bloom-cp2sd2-stage3", "bloom")])
    assert run_record(runs.out("llama-cp2sd2"))["strategy"] == "cp2sd2_stage1"
    for name, strategy, stage in (("llama-sep2sd2-stage2", "sep2sd2_stage2", 2),
                                  ("llama-cp2sd2-stage2", "cp2sd2_stage2", 2),
                                  ("qwen2-sep2sd2-stage3", "sep2sd2_stage3", 3),
                                  ("bloom-cp2sd2-stage3", "cp2sd2_stage3", 3)):
        record = run_record(runs.out(name))
        assert record["strategy"] == strategy and record["global_batch_size"] == 8, (name, record["strategy"])
        built = record["built"]
        assert built["sharding"]["stage"] == stage and built["sharding"]["gradients_summed_over_sep_group"] == 2, name
        wrappers = (built["segment_parallel"] or built["context_parallel"])["model_wrappers"]
        assert wrappers == [f"GroupShardedStage{stage}", "SegmentParallel"], (name, wrappers)


def test_cp4(runs):
    """4 processes of ring attention: 8 chunks of 4 tokens, rank i holding chunks i and 7-i."""
    cp4 = {"context_parallel_degree": 4}
    run_launch(4, [runs.run(f"{model}-cp4", model, **cp4) for model in ("llama", "bloom", "gpt3", "qwen2")],
               runs.work, "cp4", timeout=1800)
    runs.check([(f"{model}-cp4", model) for model in ("llama", "bloom", "gpt3", "qwen2")])
    assert run_record(runs.out("llama-cp4"))["strategy"] == "cp4"
    assert run_record(runs.out("llama-sep2sd2"))["strategy"] == "sep2sd2_stage1"


def test_sep2_mechanism(tmp_path, embedded_corpus):
    """Each rank holds 16 of the 32 tokens between layers; the all-to-all runs in forward (q, k, v
    to heads, the output back) and in backward (the same four, reversed); before the optimizer's
    sep reduction each rank's gradient covers only its own tokens (they differ)."""
    layers = 8
    # The key in the argument file itself, as a PaddleNLP file gives it (no override).
    args = write_json(tmp_path / "llama.json", base_arguments(embedded_corpus, tmp_path, max_steps=1, save_steps=0,
                                                              sep_parallel_degree=2))
    spec = write_json(tmp_path / "runs.json", [{"name": "sep2", "argv": argv(args, tmp_path / "sep2")},
                                               {"name": "cp2", "argv": argv(args, tmp_path / "cp2", sep_parallel_degree=1,
                                                                            **CP2)}])
    result = launch(REPO_ROOT / "tests" / "workers" / "mechanism_runs.py", 2, [str(spec)], log_dir=tmp_path / "log",
                    timeout=600).check()
    ranks = result.results()
    for rank, observed in ranks.items():
        seen = observed["sep2"]
        shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
        assert shapes == {(2, 16, 64)}, f"rank {rank}: hidden states between layers {shapes}"
        calls = seen["all_to_all"]
        micro_batches = 4
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
    # Ring attention: no all-to-all; per layer and micro-batch one pass of (k, v) in forward, one of
    # (k, v, dk, dv) and one of (dk, dv) in backward; each rank 16 tokens (chunks i, 3 - i of 8 tokens).
    for rank, observed in ranks.items():
        seen = observed["cp2"]
        shapes = {tuple(s) for per_layer in seen["decoder_input_shapes"].values() for s in per_layer}
        assert shapes == {(2, 16, 64)}, f"rank {rank}: hidden states between layers {shapes}"
        assert not seen["all_to_all"]
        ring = seen["ring"]
        kv = [[2, 16, 2, 16], [2, 16, 2, 16]]
        assert ring.get("forward") == [kv] * (layers * 4), ring.keys()
        assert ring.get("backward") == [kv + kv, kv] * (layers * 4), ring.keys()
    before_step = [[value for kind, value in ranks[r]["cp2"]["grad_fingerprints"] if kind == "step"][0] for r in (0, 1)]
    assert before_step[0] != pytest.approx(before_step[1], rel=1e-6), "gradients equal before the cp reduction"
    assert run_record(tmp_path / "cp2")["built"]["context_parallel"]["chunks_of_2cp"] == [0, 3]
