"""Each parallel feature is really on: tests that fail when the feature is switched off.

The parity tests (test_parallel_parity.py) prove that a layout computes the same numbers as one
process; they cannot prove that the layout ran (a layout silently falling back to a simpler one
computes the same numbers). These tests train through the real trainer with probes
(tests/workers/mechanism_runs.py) and check what happened, one launch per layout (shared with the
parity tests' runs of the same degrees: tests/shared_launches.py):

    tp2   tensor parallelism: fleet's wrapper, half the weights per rank;
          sequence parallelism: hidden states between blocks hold 1/tp of the tokens, fleet's
          SP all-reduce hooks fire once per step per norm weight, the allocator's peak drops;
          recompute under TP + SP in every family; Mixtral's and Qwen2-MoE's routers route every token
    dp2   gradients stay local until the last micro-batch, then equal on both ranks;
          recompute in every family; the recompute peak is lower than without
    sd2   stage 1 / 2 / 3 wrappers, optimizer state per rank 1/2 of the model's; under stage 3
          the real-size preset's large parameters are sliced in two and the peak drops below
          stage 2's; recompute in every family
    pp4   1F1B and interleaved schedule classes, chunks per rank, the order in which the
          interleaved schedule runs micro-batches through the chunks, each schedule's order of
          forwards and backwards per chunk on every stage; pipeline recompute
          (PipelineLayer's recompute_interval) in every dense family

The run record ("built" in train_log.jsonl) is checked against the same facts: it is read
from the built objects (llm_pretrain/observe/run_record.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from models.families import FAMILIES as FAMILY_RECORDS

# every dense family, Qwen2 included; the mixture-of-experts ones have their own (tests/test_expert_parallel.py)
# Qwen3 (issue 34): its mechanisms under tp2 are checked by its parity runs (test_parallel_parity TP_ONLY); these
# launches do not train it yet; nor ERNIE 4.5 (its dp2 / pp2 / sd2 mechanisms: test_parallel_parity LAYOUT_SHORT)
FAMILIES = tuple(name for name, family in FAMILY_RECORDS.items()
                 if not family.architectures[family.tiny].is_moe and name not in ("qwen3", "ernie4_5"))
from parity_utils import argv, base_arguments, run_record, summary_records, write_json
from shared_launches import contribute
import schedule_orders

GRANULARITIES = ("full", "full_attn", "core_attn")
PARTS = {"full": "forward", "full_attn": "attention_block", "core_attn": "core_attention"}
LAYERS = 8
MOE_SP_LAYERS = {"mixtral": LAYERS, "qwen2-moe": 2}  # the mixtures of experts' layers under tp2 + SP


class Mechanisms:
    def __init__(self, work: Path, corpus: dict):
        self.work, self.corpus = work, corpus
        self.files = {}

    def file(self, model: str) -> Path:
        if model not in self.files:
            name = model if model.endswith("-real") else f"{model}-tiny"
            extra = {"num_hidden_layers": 2 if model.endswith("-real") else LAYERS}
            self.files[model] = write_json(self.work / f"{model}.json", base_arguments(
                self.corpus, self.work, model_name_or_path=name, max_steps=1, save_steps=0, **extra))
        return self.files[model]

    def out(self, layout: str, name: str) -> Path:
        return self.work / layout / name

    def specs(self, layout: str, runs: dict[str, tuple[str, dict]], extra: dict | None = None) -> list[dict]:
        """runs: name -> (model, argument overrides); extra: name -> more keys of its run spec (the
        worker's probes)."""
        return [{"name": name, "argv": argv(self.file(model), self.out(layout, name), **overrides),
                 **(extra or {}).get(name, {})} for name, (model, overrides) in runs.items()]

    def built(self, layout: str, name: str) -> dict:
        return run_record(self.out(layout, name))["built"]


@pytest.fixture(scope="module")
def mech(shared_launches, embedded_corpus) -> Mechanisms:
    return Mechanisms(shared_launches.work_dir("mechanisms"), embedded_corpus)


def shared(launch_name: str, nproc: int, last: bool = False):
    """Decorates the function giving a layout's runs ({name: (model, overrides)}, {name: probe keys}):
    they train in the session's shared launch of that layout (tests/shared_launches.py), beside the
    parity tests' runs of the same degrees; `last`: after every other file's runs."""
    def register(layout_runs):
        contribute(launch_name, nproc, "mechanisms",
                   lambda work, corpus: Mechanisms(work, corpus).specs(launch_name, *layout_runs()), last=last)
        return layout_runs
    return register


def summary_record(output_dir: Path) -> dict:
    return summary_records(output_dir)[-1]


def recompute_overrides(i: int) -> dict:
    """Family i's recompute settings: the granularities in turn, layer 1 left out."""
    return {"recompute": True, "recompute_granularity": GRANULARITIES[i % 3], "no_recompute_layers": [1]}


def assert_recomputed(calls: dict, granularity: str, layers: list[int], micro_batches: int, excluded=(1,)):
    """The recomputed part of each layer ran once per micro-batch forward and once more in backward."""
    part = PARTS[granularity]
    counts = {layer: calls.get(part, []).count(layer) for layer in layers}
    expected = {layer: micro_batches * (1 if layer in excluded else 2) for layer in layers}
    assert counts == expected, f"{part} calls per layer {counts}, expected {expected} (recompute {granularity})"


# ----------------------------------------------------------------------------- tensor + sequence parallel
@shared("tp2", 2, last=True)  # its last run fails on purpose
def tp2_runs():
    tp = {"tensor_parallel_degree": 2}
    runs = {f"{family}-sp": (family, {**tp, "sequence_parallel": True, **recompute_overrides(i)})
            for i, family in enumerate(FAMILIES)}
    # Peak memory with and without SP: long sequences, so that activations dominate.
    long = {**tp, "max_seq_length": 256, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    runs["llama-long-tp"] = ("llama", long)
    runs["llama-long-sp"] = ("llama", {**long, "sequence_parallel": True})
    # Replica check (llm_pretrain/checkpoint/replica_check.py): rank 1's copy of a norm weight made to differ
    # by a last bit before the end-of-training check (run last: it fails on purpose).
    runs["llama-replica-differs"] = ("llama", {**tp, "sequence_parallel": True})
    runs["mixtral-sp"] = ("mixtral", {**tp, "sequence_parallel": True})  # (before the failing run)
    # shared expert, 16 experts, top 4 (2 layers: a MoE layer costs several dense ones)
    runs["qwen2-moe-sp"] = ("qwen2-moe", {**tp, "sequence_parallel": True, "num_hidden_layers": MOE_SP_LAYERS["qwen2-moe"]})
    runs["llama-replica-differs"] = runs.pop("llama-replica-differs")
    perturbed = {"rank": 1, "parameter": "layers.3.post_attention_layernorm.weight"}
    return runs, {"llama-replica-differs": {"perturb_replica": perturbed}}


def test_sequence_parallel_and_recompute_under_tp2(mech, shared_launches):
    ranks = shared_launches.results("tp2", "mechanisms")
    for rank, observed in ranks.items():
        for i, family in enumerate(FAMILIES):
            seen = observed[f"{family}-sp"]
            # Tensor parallelism: fleet's wrapper, and each rank holds about half of the weights.
            assert "TensorParallel" in seen["model_classes"]
            assert seen["parameter_elements"] < 0.6 * seen["model_parameters"], \
                f"{family}: rank {rank} holds {seen['parameter_elements']} of {seen['model_parameters']} weights"
            # 2 x 32 tokens per micro-batch, flattened and split over 2 ranks: 32 rows per rank.
            shapes = {tuple(s) for shapes in seen["decoder_input_shapes"].values() for s in shapes}
            hidden = {tuple(s)[-1] for s in shapes}
            assert shapes == {(2 * 32 // 2, *hidden)}, f"{family} rank {rank}: hidden states {shapes}"
            # Every norm weight (and bias) is all-reduced over the TP group once per step (4 micro-batches).
            hooks = seen["sp_hooks"]
            assert hooks and all(calls == [4, 1] for calls in hooks.values()), f"{family}: SP hooks {hooks}"
            norms_per_layer = 2 * (1 if family in ("llama", "qwen", "baichuan") else 2)
            assert len(hooks) >= LAYERS * norms_per_layer, f"{family}: only {len(hooks)} SP parameters"
            assert_recomputed(seen["calls"], GRANULARITIES[i % 3], list(range(LAYERS)), micro_batches=4)
        assert observed["llama-long-sp"]["peak_allocated"] < observed["llama-long-tp"]["peak_allocated"], \
            "sequence parallelism did not lower the allocator's peak"
        # Mixture of experts under SP: 32 of the 64 tokens of a micro-batch between layers, but the router
        # routes all 64 (the MoE block gathers the chunks), in each of the 8 layers and 4 micro-batches
        # (k = 2 picks per token for Mixtral, 4 for Qwen2-MoE); the experts split over the two ranks.
        for moe, k in (("mixtral", 2), ("qwen2-moe", 4)):
            seen, layers = observed[f"{moe}-sp"], MOE_SP_LAYERS[moe]
            shapes = {tuple(s) for shapes in seen["decoder_input_shapes"].values() for s in shapes}
            assert shapes == {(32, 64)} and len(seen["decoder_input_shapes"]) == layers, f"{moe} rank {rank}: {shapes}"
            assert seen["router"]["routed_tokens"] == [64] * (layers * 4), seen["router"]
            assert seen["router"]["stats"] == [[64, 64, 64.0 * k]] * (layers * 4) and "sum_backward" not in seen["router"]
            assert "TensorParallel" in seen["model_classes"] and seen["sp_hooks"], moe
            assert seen["parameter_elements"] < 0.6 * seen["model_parameters"], (moe, seen["parameter_elements"])
    for i, family in enumerate(FAMILIES):
        built = mech.built("tp2", f"{family}-sp")
        assert built["sequence_parallel"]["enabled"] and built["layout"]["tensor_parallel_degree"] == 2
        g = GRANULARITIES[i % 3]
        assert built["recompute"] == {g: [layer for layer in range(LAYERS) if layer != 1]}
    assert not mech.built("tp2", "llama-long-tp")["sequence_parallel"]["enabled"]
    # The replica check compared the replicated norms (and every optimizer state's beta powers) of
    # both ranks, and fails when one rank's copy differs, naming the tensor and the ranks.
    for family in FAMILIES:
        check = summary_record(mech.out("tp2", f"{family}-sp"))["replica_check"]
        norms = 2 * LAYERS + 1 if family in ("llama", "qwen", "baichuan") else 2 * 2 * LAYERS + 2
        assert check["identical"] and check["replica_groups"] >= norms, f"{family}: {check}"
    for rank in (0, 1):
        failed = ranks[rank]["llama-replica-differs"]
        assert failed["exit_code"] == 1, failed
        assert failed["error"].startswith("RunError: replica check after step 1: "
                                          "layers.3.post_attention_layernorm.weight (box at offsets [0]) "
                                          "differs between its replicas: rank(s) [1] differ from rank 0"), failed


# ----------------------------------------------------------------------------- data parallel
@shared("dp2", 2)
def dp2_runs():
    dp = {"gradient_accumulation_steps": 4, "per_device_train_batch_size": 1}
    runs = {f"{family}-dp2": (family, {**dp, **recompute_overrides(i)}) for i, family in enumerate(FAMILIES)}
    long = {"max_seq_length": 256, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    runs["llama-long"] = ("llama", long)
    runs["llama-long-recompute"] = ("llama", {**long, "recompute": True})
    return runs, None


def test_data_parallel_syncs_once_per_step_and_recompute_under_dp2(mech, shared_launches):
    ranks = shared_launches.results("dp2", "mechanisms")
    for i, family in enumerate(FAMILIES):
        seen = [ranks[rank][f"{family}-dp2"] for rank in (0, 1)]
        for observed in seen:
            assert_recomputed(observed["calls"], GRANULARITIES[i % 3], list(range(LAYERS)), micro_batches=4)
        # One gradient's sum on each rank before micro-batches 2..4 (local: the ranks read different
        # samples) and at the optimizer step (all-reduced: equal).
        prints = [[value for kind, value in observed["grad_fingerprints"]] for observed in seen]
        kinds = [kind for kind, _ in seen[0]["grad_fingerprints"]]
        assert kinds == ["micro_batch"] * 4 + ["step"], kinds
        for k in (1, 2, 3):
            assert prints[0][k] != pytest.approx(prints[1][k], rel=1e-6), \
                f"{family}: gradients already equal on both ranks after micro-batch {k} (synced per micro-batch)"
        assert prints[0][4] == pytest.approx(prints[1][4], rel=1e-6), f"{family}: gradients not all-reduced"
        built = mech.built("dp2", f"{family}-dp2")
        assert built["layout"]["data_parallel_degree"] == 2 and built["sharding"] is None
        assert built["recompute"] == {GRANULARITIES[i % 3]: [layer for layer in range(LAYERS) if layer != 1]}
    for rank in (0, 1):
        with_recompute, without = ranks[rank]["llama-long-recompute"], ranks[rank]["llama-long"]
        assert_recomputed(with_recompute["calls"], "full", list(range(LAYERS)), micro_batches=1, excluded=())
        assert with_recompute["peak_allocated"] < without["peak_allocated"], "recompute did not lower the peak"


# ----------------------------------------------------------------------------- sharding
@shared("sd2", 2)
def sd2_runs():
    sd = {"gradient_accumulation_steps": 2}
    runs = {f"{family}-stage{i % 3 + 1}": (family, {**sd, "sharding": f"stage{i % 3 + 1}", **recompute_overrides(i)})
            for i, family in enumerate(FAMILIES)}
    # The real-size preset: stage 3 slices its parameters above 2**20 elements.
    for stage in (1, 2, 3):
        runs[f"real-stage{stage}"] = ("llama-real", {**sd, "sharding": f"stage{stage}"})
    return runs, None


def test_sharding_stages_and_recompute_under_sd2(mech, shared_launches):
    runs, _ = sd2_runs()
    ranks = shared_launches.results("sd2", "mechanisms")
    wrappers = {1: ("DygraphShardingOptimizer", "optimizer_classes"), 2: ("GroupShardedStage2", "model_classes"),
                3: ("GroupShardedStage3", "model_classes")}
    for name in runs:
        stage = int(name[-1])
        seen = [ranks[rank][name] for rank in (0, 1)]
        wrapper, chain = wrappers[stage]
        assert wrapper in seen[0][chain], f"{name}: {seen[0][chain]} has no {wrapper}"
        if stage == 2:
            assert "GroupShardedOptimizerStage2" in seen[0]["optimizer_classes"]
        if stage != 3:
            assert "GroupShardedStage3" not in seen[0]["model_classes"]
        # Optimizer state: in stages 1 and 2 each rank holds the moments of its parameters, together
        # exactly the model's; in stage 3 a rank holds its slice of each parameter above 2**20
        # elements and the whole of the smaller ones (a tiny model has no large ones).
        total = seen[0]["model_parameters"]
        held = [s["optimizer_state_elements"] for s in seen]
        if stage == 3:
            expected = [sum(p["elements"] if p["unslice"] else p["slice_elements"] for p in s["stage3"]) for s in seen]
            assert held == expected, f"{name}: moments per rank {held}, expected {expected}"
        else:
            assert sum(held) == total and max(held) < total, f"{name}: moments per rank {held} of {total}"
        if name.startswith("real"):
            assert max(held) < 0.6 * total, f"{name}: optimizer state per rank {held} is not about half of {total}"
        built = mech.built("sd2", name)
        assert built["sharding"]["stage"] == stage and built["sharding"]["degree"] == 2
        assert run_record(mech.out("sd2", name))["strategy"] == f"sd2_stage{stage}"
    for i, family in enumerate(FAMILIES):
        for rank in (0, 1):
            assert_recomputed(ranks[rank][f"{family}-stage{i % 3 + 1}"]["calls"], GRANULARITIES[i % 3],
                              list(range(LAYERS)), micro_batches=2)
    for rank in (0, 1):
        slices = ranks[rank]["real-stage3"]["stage3"]
        large = [p for p in slices if p["elements"] > 2 ** 20]
        assert len(large) == 2 * 3 + 2, f"stage 3 manages only {len(large)} parameters above 2**20"
        for p in large:  # sliced: this rank keeps half (rounded up to the sharding degree)
            assert not p["unslice"] and p["slice_elements"] in (p["elements"] // 2, p["elements"] // 2 + 1), p
        assert mech.built("sd2", "real-stage3")["sharding"]["sliced_parameters"] == len(large)
    # The peak over the ranks (what sizes a job): stage 3 keeps half of the large weights, gradients
    # and moments (measured: ~360 MB vs ~465 MB for stages 1 and 2). Stage 2 frees the gradients
    # a rank does not own, but at this size that does not move the peak (the rank owning the
    # 8.5M-element head peaks as in stage 1), so no ordering of stages 1 and 2 is asserted.
    peaks = {stage: max(ranks[rank][f"real-stage{stage}"]["peak_allocated"] for rank in (0, 1)) for stage in (1, 2, 3)}
    assert peaks[3] < 0.9 * peaks[2] and peaks[3] < 0.9 * peaks[1], f"peak allocated by stage: {peaks}"


# ----------------------------------------------------------------------------- pipeline
PIPELINE_GRANULARITY = {"llama": "full", "qwen": "full_attn", "baichuan": "core_attn", "gpt3": "full", "bloom": "full",
                        "qwen2": "full_attn"}


@shared("pp4", 4)
def pp4_runs():
    order = {"pipeline_parallel_degree": 4, "gradient_accumulation_steps": 8, "per_device_train_batch_size": 1}
    runs = {"llama-1f1b": ("llama", order), "llama-interleaved": ("llama", {**order, "virtual_pp_degree": 2}),
            # 1F1B with segments of 2 functions, tied embedding. Stage 0's first segment is the
            # embedding and layer 0: its input, the token ids, needs no gradient, so PipelineLayer
            # does not recompute it (pp_layers.py _need_recompute), as in PaddleNLP.
            "gpt3-1f1b-recompute": ("gpt3", {"pipeline_parallel_degree": 4, "recompute": True,
                                             "pp_recompute_interval": 2})}
    for family, granularity in PIPELINE_GRANULARITY.items():  # GPT-3 and Bloom: tied embeddings
        runs[f"{family}-pp4vpp2-recompute"] = (family, {
            "pipeline_parallel_degree": 4, "virtual_pp_degree": 2, "recompute": True,
            "recompute_granularity": granularity, "pp_recompute_interval": 1})
    return runs, None


def test_pipeline_schedules_and_recompute_under_pp4(mech, shared_launches):
    pipeline_granularity = PIPELINE_GRANULARITY
    ranks = shared_launches.results("pp4", "mechanisms")
    for stage in range(4):
        # The schedule's order of forwards and backwards (fleet's _forward_step / _backward_step, per chunk):
        # 1F1B warms up with 3 - stage forwards then alternates; interleaved goes through the chunks in
        # groups of 4 micro-batches, backwards in reverse chunk order.
        order = schedule_orders.first_step(ranks[stage]["llama-1f1b"]["schedule_order"], 8)
        assert order == schedule_orders.one_f_one_b(stage, 4, 8), f"1F1B stage {stage}: {order}"
        order = schedule_orders.first_step(ranks[stage]["llama-interleaved"]["schedule_order"], 8, 2)
        assert order == schedule_orders.interleaved(stage, 4, 2, 8), f"interleaved stage {stage}: {order}"
        forward = ranks[stage]["llama-1f1b"]["calls"]["forward"]
        assert forward == [2 * stage, 2 * stage + 1] * 8, f"1F1B stage {stage}: {forward}"
        assert_recomputed(ranks[stage]["gpt3-1f1b-recompute"]["calls"], "full", [2 * stage, 2 * stage + 1],
                          micro_batches=4, excluded=(0,))
        # Interleaved: micro-batches go through the chunks in groups of pp_degree (Megatron's order).
        forward = ranks[stage]["llama-interleaved"]["calls"]["forward"]
        chunks = [stage, stage + 4]
        assert forward == [chunks[(k // 4) % 2] for k in range(16)], f"interleaved stage {stage}: {forward}"
        for family, granularity in pipeline_granularity.items():
            assert_recomputed(ranks[stage][f"{family}-pp4vpp2-recompute"]["calls"], granularity, chunks,
                              micro_batches=4, excluded=())
    one_f_one_b, interleaved = mech.built("pp4", "llama-1f1b"), mech.built("pp4", "llama-interleaved")
    assert one_f_one_b["schedule"] == {"class": "PipelineParallel", "kind": "1F1B", "virtual_stages": 1,
                                       "chunk_layers": [[[2 * s, 2 * s + 1]] for s in range(4)]}
    assert interleaved["schedule"] == {"class": "PipelineParallelWithInterleave", "kind": "interleaved",
                                       "virtual_stages": 2, "chunk_layers": [[[s], [s + 4]] for s in range(4)]}
    assert run_record(mech.out("pp4", "llama-interleaved"))["strategy"] == "pp4vpp2"
    assert mech.built("pp4", "gpt3-1f1b-recompute")["recompute"] == {"full": list(range(1, LAYERS)),
                                                                      "pipeline_recompute_interval": 2}
    for family, granularity in pipeline_granularity.items():
        recompute = mech.built("pp4", f"{family}-pp4vpp2-recompute")["recompute"]
        assert recompute[granularity] == list(range(LAYERS))
        assert recompute["pipeline_recompute_interval"] == (1 if granularity == "full" else 0)


# ----------------------------------------------------------------------------- one process
def test_run_record_of_one_process_reads_the_model():
    import dataclasses

    import paddle

    from llm_pretrain.observe.run_record import built_strategy_name, describe_built_run
    from models.decoder import CausalLM
    from models.registry import make_config

    config = make_config("llama", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)
    model = CausalLM(dataclasses.replace(config, recompute=True, recompute_granularity="full_attn",
                                         no_recompute_layers=[1]))
    model.layers[2].config = dataclasses.replace(model.layers[2].config, recompute=False)  # what the layer runs
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
    built = describe_built_run(model, optimizer)
    assert built["layout"]["world_size"] == 1 and built["schedule"] is None and built["sharding"] is None
    assert built["recompute"] == {"full_attn": [0]} and not built["sequence_parallel"]["enabled"]
    assert built["precision"]["parameter_dtypes"] == ["float32"] and not built["precision"]["master_weights"]
    assert built_strategy_name(built) == "dp1"
