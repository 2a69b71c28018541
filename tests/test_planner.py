"""The planner (llm_pretrain/planner): memory against real CPU trainings, hand-computed terms,
the Megatron calibration, search and scripts/plan.py."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch_utils import REPO_ROOT
from llm_pretrain.planner import memory as mem
from llm_pretrain.planner import speed
from llm_pretrain.planner.params import parameter_list, stage_parameters
from models.registry import ARCHITECTURES, parameter_count

PLAN = REPO_ROOT / "scripts" / "plan.py"
MiB = 2**20


# ----------------------------------------------------------------------------- measured on CPU
@pytest.fixture(scope="module")
def measured_runs(embedded_corpus, tmp_path_factory):
    from llm_pretrain.selfcheck.planner_runs import run_all

    return run_all(embedded_corpus, tmp_path_factory.mktemp("planner"))


def test_cpu_peak_within_10_percent_in_every_layout(measured_runs):
    """Predicted per-rank peak vs Paddle's host allocator peak (max over ranks) of real trainings."""
    from llm_pretrain.selfcheck.planner_runs import LAUNCHES, predict

    names = [name for _, runs in LAUNCHES.values() for name in runs]
    assert [r["name"] for r in measured_runs] == names
    errors = {}
    for run in measured_runs:
        predicted = predict(run)["peak_mem_allocated_mb"]
        errors[run["name"]] = (predicted, run["measured_mb"], predicted / run["measured_mb"] - 1)
    bad = {k: v for k, v in errors.items() if abs(v[2]) > 0.10}
    assert not bad, f"outside 10 %: {bad}; all: {errors}"
    # The weights dominate as intended (hidden 1024): weights + gradients + moments of 40.6M parameters.
    assert errors["single"][1] > 4 * 40_637_440 * 4 / MiB


def test_sequence_split_lowers_the_allocator_peak_when_attention_dominates(measured_runs):
    """At 2048 tokens on a small width the attention scores dominate: sep2 holds half of each layer's
    scores (heads / 2) and cp2 none (its blocks are transients), so each rank's peak is far below one
    process's (measured 276 / 140 / 77 MiB). Fails when either split is off (each rank would hold it all)."""
    peak = {run["name"]: run["measured_mb"] for run in measured_runs}
    assert peak["long, sep2"] < 0.6 * peak["long, 1 process"], peak
    assert peak["long, cp2"] < 0.45 * peak["long, 1 process"], peak


def test_trainer_reports_allocator_peak_beside_rss_and_the_prediction(measured_runs):
    from parity_utils import run_record
    from llm_pretrain.selfcheck.planner_runs import predict

    for run in measured_runs:
        assert 0 < run["measured_mb"] < run["rss_mb"], run
        prediction = run_record(Path(run["output_dir"]))["prediction"]
        assert prediction["peak_mem_allocated_mb"] == pytest.approx(predict(run)["peak_mem_allocated_mb"])
        assert prediction["top_term"]["mb"] > 0 and prediction["step_time_s"] is None  # no CPU speed model


def test_gpu_memory_warning_wiring(monkeypatch):
    """On GPU the trainer compares the estimate with the card before fleet.init (CPU build: the card is faked)."""
    from types import SimpleNamespace

    import paddle
    from llm_pretrain.run import preflight
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.layout import build_model_config, plan_layout

    monkeypatch.setattr(preflight, "device_name", lambda device: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(paddle.device.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=40 * 2**30))
    args, _ = parse_arguments([str(REPO_ROOT / "configs" / "llama" / "pretrain-llama_13b-tp2sd4_stage2.json"),
                               "--sharding", "", "--tensor_parallel_degree", "1"])
    layout = plan_layout(args, 1)
    config, _, _ = build_model_config(args, layout, "gpu")
    prediction = preflight.predict_run(args, layout, config, "gpu")
    assert prediction["fits"] is False and prediction["device_memory_mb"] == 40 * 1024
    assert prediction["top_term"]["term"] == "Adam moments (fp32)"  # 13B x 8 bytes, the largest term
    message = preflight.memory_warning(prediction)
    assert "more than the device's 40,960 MB" in message and "Adam moments (fp32)" in message


# ----------------------------------------------------------------------------- hand-computed memory terms
@pytest.mark.parametrize("name", ["llama-tiny", "qwen-tiny", "baichuan-tiny", "gpt3-tiny", "bloom-tiny", "llama-real",
                                  "facebook/llama-7b", "meta-llama/Llama-2-70b", "gpt3-175B-en", "bigscience/bloom"])
def test_parameter_list_matches_registry_count_and_model(name):
    config = ARCHITECTURES[name]
    assert sum(p.numel for p in parameter_list(config, 1)) == parameter_count(config)


def test_parameter_list_is_the_models_parameters_on_each_tp_rank():
    """Names, order and local sizes are those of the built model (single process: tp 1)."""
    from models.decoder import CausalLM

    config = ARCHITECTURES["llama-tiny"].replace(num_hidden_layers=2)
    model = CausalLM(config)
    built = [(name, int(p.numel())) for name, p in model.named_parameters()]
    assert [(p.name, p.numel) for p in parameter_list(config, 1)] == built
    # tp 2 of llama-real by hand: q 1024x512, k/v 1024x256, o 512x1024, MLP 3 x 1024x1408, norms 2 x 1024
    # per layer; final norm 1024; embedding and head 8320/2 x 1024 each.
    real = ARCHITECTURES["llama-real"]
    per_layer = 1024 * 512 + 2 * 1024 * 256 + 512 * 1024 + 3 * 1024 * 1408 + 2 * 1024
    assert sum(p.numel for p in parameter_list(real, 2)) == 2 * per_layer + 1024 + 2 * 4160 * 1024 == 20_321_280


def test_layer_activations_by_hand():
    """llama-real, 1 x 128 tokens, fp32 (4 bytes), per decoder layer, in units of tokens x hidden x 4 bytes:
    input 1, RMSNorm 2 (normalized, output), q + rotated q 2, k + rotated k 1, repeat_interleave keeps k, v 1,
    q scaled, k^T, v^T 3, o_proj input 1, residual 1, RMSNorm 2, SwiGLU 4 x 2.75 = 11 -> 25; the scores
    8 heads x 128 / 1024 = 1; the rotary tables 2 x 128 x 128 floats = 0.25 per token."""
    config = ARCHITECTURES["llama-real"].replace(seq_length=128, num_hidden_layers=2)
    setup = mem.Setup(config, micro_batch=1, accumulation=2)
    unit = 128 * 1024 * 4
    assert mem.layer_activation_bytes(config, setup, 0) == pytest.approx(26.25 * unit)
    recompute = {"full": 1, "full_attn": 1 + 14, "core_attn": 26.25 - 5 + 2}
    for granularity, units in recompute.items():
        c = config.replace(recompute=True, recompute_granularity=granularity)
        assert mem.layer_activation_bytes(c, mem.Setup(c, 1, 2), 0) == pytest.approx(units * unit), granularity
    # head: final norm input + 2 saved, softmax over the vocabulary in float32
    assert mem.head_activation_bytes(config, setup) == pytest.approx(3 * unit + 128 * 8320 * 4)


def test_sequence_parallel_splits_norms_and_keeps_gathered_inputs():
    config = ARCHITECTURES["llama-real"].replace(seq_length=128, tensor_parallel_degree=2, sequence_parallel=True)
    setup = mem.Setup(config, 1, 2, tp=2)
    # per token x hidden x 4 bytes: residual/norm parts 6 / 2 = 3, five gathered projection inputs 5,
    # q/k rotary 1.5, repeat 0.5, core 1.5 + scores 4 x 128 / 1024 = 0.5, o_proj input 0.5, SwiGLU 4 x 1.375
    units = 3 + 5 + 1.5 + 0.5 + 1.5 + 0.5 + 0.5 + 5.5
    assert mem.layer_activation_bytes(config, setup, 0) == pytest.approx(units * 128 * 1024 * 4 + 2 * 128 * 128 * 4)


def test_optimizer_state_assignment_follows_paddle():
    params = parameter_list(ARCHITECTURES["llama-real"].replace(num_hidden_layers=2), 1)
    stage1 = mem.stage1_owned(tuple(params), 2)  # sorted, largest first: embedding and head on different ranks
    assert {p.name for p in stage1[0][:1] + stage1[1][:1]} == {"embeddings.word_embeddings.weight", "lm_head.weight"}
    stage2 = mem.stage2_owned(tuple(params), 2)  # model order: rank 1 ends with 89.5 MiB, rank 0 with 65.5 MiB
    assert [sum(p.numel for p in r) * 4 / MiB for r in stage2] == pytest.approx([65.50390625, 89.515625])


def test_stage3_slices_parameters_above_2_pow_20():
    config = ARCHITECTURES["llama-real"].replace(seq_length=128, num_hidden_layers=2)
    rank = mem.rank_memory(mem.Setup(config, 1, 2, sharding_degree=2, sharding_stage=3))
    params = parameter_list(config, 1)
    sliced = sum(p.numel for p in params if p.numel > 2**20)  # embedding, head, MLP (q, o are exactly 2**20)
    whole = sum(p.numel for p in params if p.numel <= 2**20)
    assert rank.persistent["weights"] == (sliced // 2 + whole) * 4


def test_pipeline_in_flight_micro_batches():
    config = ARCHITECTURES["llama-real"].replace(num_hidden_layers=8)
    one_f_one_b = mem.Setup(config, 1, 8, pp=4)
    assert [mem.in_flight_micro_batches(one_f_one_b, s) for s in range(4)] == [4, 3, 2, 1]
    assert [mem.in_flight_micro_batches(mem.Setup(config, 1, 2, pp=4), s) for s in range(4)] == [2, 2, 2, 1]
    interleaved = mem.Setup(config, 1, 4, pp=4, vpp=2)
    assert [mem.in_flight_micro_batches(interleaved, s) for s in range(4)] == [8, 8, 8, 8]
    # the first stage holds the embedding, the last the norm and head; layers 0-1 | 2-3 | ...
    names = [p.name for p in stage_parameters(config, 1, 4, 1, 0)]
    assert names[0] == "embeddings.word_embeddings.weight" and "lm_head.weight" not in names
    assert {p.layer for p in stage_parameters(config, 1, 4, 2, 1) if p.layer is not None} == {1, 5}


def test_amp_o2_memory_terms():
    config = ARCHITECTURES["facebook/llama-7b"].replace(seq_length=2048)
    setup = mem.Setup(config, 1, 1, precision=mem.Precision("bf16", "O2", master_grad=True))
    rank = mem.rank_memory(setup)
    n = parameter_count(config)
    assert rank.persistent["weights"] == 2 * n and rank.persistent["gradients"] == 2 * n
    assert rank.persistent["master weights (fp32)"] == 4 * n and rank.persistent["master gradients (fp32)"] == 4 * n
    assert rank.persistent["Adam moments (fp32)"] == 8 * n


# ----------------------------------------------------------------------------- time terms by hand
def test_time_terms_by_hand():
    from llm_pretrain.observe.flops import training_flops_per_token

    config = ARCHITECTURES["gpt3-6.7B-en"].replace(seq_length=1024, tensor_parallel_degree=2)
    setup = mem.Setup(config, 2, 8, tp=2, pp=2, dp=2, precision=mem.Precision("bf16", "O2", True))
    cluster = speed.Cluster("A100-80G", gpus_per_node=8, intra_node_gbps=200.0, inter_node_gbps=20.0)
    result = speed.step_time(setup, cluster)
    terms = result["terms"]
    compute_mb = (training_flops_per_token(config, 1024) * 2 * 1024 / 4
                  / (312e12 * speed.matmul_efficiency(4096 / 2)))
    assert terms["compute"] == pytest.approx(8 * compute_mb)
    # 16 layers per stage x 4 all-reduces of 2 x 1024 x 4096 bf16 values over 2 ranks (ring: 2 (n-1)/n)
    tp_mb = 16 * 4 * (2 * 1 / 2) * (2 * 1024 * 4096 * 2) / 200e9
    assert terms["tensor-parallel communication"] == pytest.approx(8 * tp_mb)
    pp_mb = 2 * (2 * 1024 * 4096 * 2) / 200e9  # tp x pp = 4 GPUs: inside the node
    assert terms["pipeline send/recv"] == pytest.approx(8 * pp_mb)
    assert terms["pipeline bubble"] == pytest.approx((2 - 1) * (compute_mb + tp_mb + pp_mb))  # (p-1)/m of m mbs
    first_stage = sum(p.numel for p in stage_parameters(config, 2, 2, 1, 0))
    assert terms["data-parallel/sharding communication (exposed)"] == pytest.approx(
        2 * (1 / 2) * first_stage * 4 / 200e9)  # fp32 master gradients, not overlapped under pp
    assert result["step_time_s"] == pytest.approx(sum(terms.values()))


def test_sequence_split_terms_by_hand():
    """sep and cp (issue 22): 1/degree of the tokens per rank; sep's attention sees all 4096 tokens of
    heads / sep (scores 1/sep of one process's), cp keeps no scores; all-to-all and ring volumes."""
    config = ARCHITECTURES["llama-real"].replace(seq_length=4096, num_hidden_layers=2)
    one, sep2, cp2 = (mem.Setup(config, 1, 2, **kw) for kw in ({}, {"sep": 2}, {"cp": 2}))
    scores = 4096 * 8 * 4096 * 4  # tokens x heads x keys x 4 bytes, one process
    assert mem.layer_activation_bytes(config, sep2, 0) == pytest.approx(
        (mem.layer_activation_bytes(config, one, 0) - 2 * 4096 * 128 * 4) / 2 + 2 * 4096 * 128 * 4)  # full tables
    assert mem.attention_backward_bytes(config, sep2) == pytest.approx(2 * scores / 2)
    assert mem.attention_backward_bytes(config, cp2) == pytest.approx(4 * 2048 * 8 * 2048 * 4)
    flash = config.replace(use_flash_attention=True)  # the ring's flash blocks keep no scores either
    assert mem.attention_backward_bytes(flash, mem.Setup(flash, 1, 2, cp=2)) == 0.0
    assert mem.layer_activation_bytes(config, cp2, 0) < mem.layer_activation_bytes(config, one, 0) / 2 - scores / 2
    cluster = speed.Cluster("A100-80G", intra_node_gbps=200.0)
    bf16 = mem.Precision("bf16", "O2", True)
    sep = speed.step_time(mem.Setup(config, 1, 2, sep=2, precision=bf16), cluster)["terms"]
    # 2 layers x (forward + backward) x q, k, v, out: 2048 tokens x (2 x 1024 + 2 x 512) bf16, half of it sent
    assert sep["sep all-to-all / cp ring (exposed)"] == pytest.approx(2 * 2 * 2 * 2048 * 3072 * 2 * 0.5 / 200e9)
    # The ring hides behind the block's attention at this length: nothing exposed.
    assert speed.step_time(mem.Setup(config, 1, 2, cp=2, precision=bf16), cluster)["terms"][
        "sep all-to-all / cp ring (exposed)"] == 0.0
    assert sep["compute"] == pytest.approx(speed.step_time(mem.Setup(config, 1, 2, precision=bf16), cluster)[
        "terms"]["compute"] / 2)



def test_latent_attention_split_by_sep_and_cp_as_the_dense_families():
    """DeepSeek-V3 (issue 35) at 4096 tokens, a dense and a MoE layer: sep2 and cp2 divide its layer activations and
    attention transients as test_sequence_split_terms_by_hand's dense model's; sep's all-to-all moves latent
    attention's own widths per head (q and k of qk_nope + qk_rope = 192, v and the output of v_head_dim = 128;
    models/mla.py), not hidden_size's (7168 = 128 x 56), and the ring's k/v block is 192 + 128 wide per head."""
    config = ARCHITECTURES["deepseek-ai/DeepSeek-V3"].replace(seq_length=4096, num_hidden_layers=4)
    one, sep2, cp2 = (mem.Setup(config, 1, 2, **kw) for kw in ({}, {"sep": 2}, {"cp": 2}))
    heads = config.num_attention_heads
    # (the rope key, one for every head, is rotated after sep's all-to-all expanded to heads / sep: float32 pairs)
    k_rope = 2048 * 4 * (heads - 1) * config.qk_rope_head_dim
    for layer in (0, 3):  # first_k_dense_replace 3: layer 3 is a MoE layer
        whole = mem.layer_activation_bytes(config, one, layer)
        assert mem.layer_activation_bytes(config, sep2, layer) == pytest.approx(whole / 2 + k_rope), layer
        # the ring keeps none of the [s, heads, s] scores and half of the rest (within 1 %: its float32 log-sum-exp)
        assert mem.layer_activation_bytes(config, cp2, layer) == pytest.approx(
            (whole - 4096 * heads * 4096 * 4) / 2, rel=0.01), layer
    assert mem.attention_backward_bytes(config, sep2) == pytest.approx(mem.attention_backward_bytes(config, one) / 2)
    assert mem.attention_backward_bytes(config, cp2) == pytest.approx(4 * 2048 * heads * 2048 * 4)
    bf16 = mem.Precision("bf16", "O2", True)
    cluster = speed.Cluster("H800-80G", intra_node_gbps=200.0)
    qk, v = heads * 192, heads * 128
    sep = speed.sequence_split_time(mem.Setup(config, 1, 2, sep=2, precision=bf16), cluster, 2048, 1e15)
    # 4 layers x (forward + backward) x q, k, v, out: 2048 tokens, bf16, half of it sent
    assert sep == pytest.approx(4 * 2 * 2048 * (2 * qk + 2 * v) * 2 * 0.5 / 200e9)
    # With compute taking no time the whole ring is exposed: cp - 1 k/v blocks forward, cp of k, v and their float32
    # gradients backward
    ring = speed.sequence_split_time(mem.Setup(config, 1, 2, cp=2, precision=bf16), cluster, 2048, float("inf"))
    block = 2048 * (qk + v)
    assert ring == pytest.approx(4 * (1 * block * 2 + 2 * block * (2 + 4)) / 200e9)


def _latent_attention_block(config, **layout):
    """The attention block of a DeepSeek-V3 MoE layer minus its input norm's saved tensors, as the planner counts it:
    the layer without recompute minus the layer under full_attn recompute (which keeps the layer's input only)."""
    setup = mem.Setup(config, 1, 1, **layout)
    recomputed = config.replace(recompute=True, recompute_granularity="full_attn")
    local = setup.tokens_per_micro_batch / (setup.tp if config.sequence_parallel else 1)
    norm = local * 8 * config.hidden_size  # float32 RMSNorm: normalized input and output
    return (mem.layer_activation_bytes(config, setup, 1) - mem.layer_activation_bytes(recomputed, setup, 1)
            - norm)


def test_latent_attention_activations_by_hand():
    """models/mla.py's saved tensors counted by hand on deepseek-v3-tiny (fp32, 32 tokens): heads 4, q and k
    16 + 8 = 24 wide per head, v and the output 16 (not hidden / heads = 16 for all three), latents 32 and 16 each
    with its RMSNorm's normalized input and output, rotary float32 pairs of q_pe (every head) and k_pe (one)."""
    config = ARCHITECTURES["deepseek-v3-tiny"].replace(seq_length=32)
    latents, rotary = 8 * (32 + 16), 4 * (4 * 8 + 8)  # per token
    q_k, v, out, scores = 4 * 4 * 24, 4 * 4 * 16, 4 * 4 * 16, 4 * 4 * 32  # q, k as float32 matmul inputs
    assert _latent_attention_block(config) == 32 * (latents + rotary + 2 * q_k + v + scores + out)
    core_attn = config.replace(recompute=True, recompute_granularity="core_attn")  # keeps q, k, v only
    assert _latent_attention_block(core_attn) == 32 * (latents + rotary + 2 * q_k + v + out)
    # flash (models/mla.py flash_attention): q, k, v padded to 24, the padded output, the log-sum-exp per head
    flash = config.replace(use_flash_attention=True)
    assert _latent_attention_block(flash) == 32 * (latents + rotary + 4 * q_k + 4 * 4 + out)
    # tp2 + SP: 2 heads per rank; the latents on this rank's 16 tokens, q_b_proj / kv_b_proj each keep their gathered
    # input of every token
    sp = config.replace(sequence_parallel=True)
    assert _latent_attention_block(sp, tp=2) == 16 * latents + 32 * (4 * (32 + 16) + 4 * (2 * 8 + 8) + q_k + v / 2
                                                                     + scores / 2 + out / 2)
    # sep2: 16 tokens of every head in, k_pe expanded to the heads before the all-to-all, all 32 keys of 2 heads
    assert _latent_attention_block(config, sep=2) == 16 * (latents + 4 * (4 * 8 + 4 * 8) + 2 * q_k + v + scores + out)
    # cp2: the ring keeps q, k, v, the log-sum-exp and its output; each layer gathers its 16 tokens' rotary rows
    assert _latent_attention_block(config, cp=2) == 16 * (latents + rotary + 8 * 4 + 2 * q_k + v + 4 * 4 + out)


def test_latent_attention_activations_measured_tensor_by_tensor():
    """What a LatentAttention forward keeps on CPU (Paddle's allocator, deepseek-v3-real, fp32, 256 tokens) is what
    the planner counts for it, with and without core_attn recompute, up to the two norms' 1/rms per token (which
    _norm_saved leaves out)."""
    import paddle

    from models.mla import LatentAttention

    allocated = paddle.base.core.host_memory_stat_current_value
    for granularity in (None, "core_attn"):
        config = ARCHITECTURES["deepseek-v3-real"].replace(seq_length=256)
        if granularity:
            config = config.replace(recompute=True, recompute_granularity=granularity)
        attention = LatentAttention(config)
        x = paddle.randn([1, 256, config.hidden_size])
        x.stop_gradient = False
        with paddle.no_grad():
            attention(x)  # the pair tables, cached once per length
        before = allocated("Allocated", 0)
        out = attention(x)
        kept = allocated("Allocated", 0) - before - out.numel().item() * 4
        del out  # (its graph)
        assert kept - _latent_attention_block(config) == 256 * 2 * 4, granularity


def test_largest_block_is_this_ranks_share_under_sep_and_cp():
    """The reserve's largest short-lived block (planner.reserved_mb) is the loss's float32 softmax of this rank's
    tokens: Llama 3.1 8B at 128K with tp4, [131072 / (sep x cp), 128256 / 4] x 4 bytes on the last stage; without
    flash attention sep's scores [s / sep, heads, s] and the ring's own block [s / cp, heads, s / cp]."""
    config = ARCHITECTURES["meta-llama/Llama-3.1-8B"].replace(seq_length=131072, use_flash_attention=True)
    bf16 = mem.Precision("bf16", "O2", True)
    for split, tokens in (({}, 131072), ({"sep": 2}, 65536), ({"cp": 2}, 65536), ({"cp": 4}, 32768)):
        setup = mem.Setup(config, 1, 8, tp=4, precision=bf16, **split)
        assert mem.largest_activation_tensor(config, setup, True) == tokens * (128256 // 4) * 4, split
    plain = ARCHITECTURES["llama-real"].replace(seq_length=4096, num_hidden_layers=2)
    heads = plain.num_attention_heads
    assert mem.largest_activation_tensor(plain, mem.Setup(plain, 1, 2, sep=2), False) == 2048 * heads * 4096 * 4
    assert mem.largest_activation_tensor(plain, mem.Setup(plain, 1, 2, cp=2), False) == 2048 * heads * 2048 * 4

# ----------------------------------------------------------------------------- Megatron calibration
def test_megatron_table_reproduced_within_stated_accuracy():
    rows = speed.megatron_table1_rows()  # the table shipped in the package, not a file outside the clone
    assert speed.MEGATRON_TABLE1.is_relative_to(REPO_ROOT / "llm_pretrain") and len(rows) == 10
    for row in rows:
        predicted = speed.megatron_tflops(*speed.megatron_row_setup(row))
        error = predicted / float(row["tflops_per_gpu"]) - 1
        assert abs(error) <= speed.MEGATRON_TOLERANCE, (row["params_billion"], predicted, row["tflops_per_gpu"])


# Korthikanti et al. 2022 (llm_pretrain/planner/data/korthikanti_*.csv), a check of the recompute terms; the
# speed model is not fitted on it. Tolerances, in percentage points of overhead / throughput gain:
# full recompute per layer: the model counts one more forward (FLOPs + its 2 TP all-reduces): 32-35 % against
# the published 39 % (22B) and 36 % (530B, 1T) -> 5 points. Selective (core attention) per layer: the model
# counts its matrix FLOPs only (0.4-1.5 %); the paper's 2-7 % also holds the memory-bound softmax and dropout
# it recomputes -> 6 points (the model is low). End-to-end gain of sequence parallelism + selective recompute
# over full recompute: model 33-39 % against the published 29.0-32.1 % -> 10 points; iteration times 20 %.
KORTHIKANTI_OVERHEAD_POINTS = {"full": 5.0, "core_attn": 6.0}
KORTHIKANTI_GAIN_POINTS = 10.0
KORTHIKANTI_TIME_TOLERANCE = 0.20


def test_recompute_overheads_against_korthikanti_2022():
    layer_rows = speed.korthikanti_rows(speed.KORTHIKANTI_LAYER_OVERHEADS)
    end_to_end = {row["model_size"]: row for row in speed.korthikanti_rows(speed.KORTHIKANTI_END_TO_END)}
    assert len(layer_rows) == 9 and list(end_to_end) == ["22B", "175B", "530B", "1T"]

    def layer_seconds(size, granularity, sequence_parallel):
        granularity = None if granularity == "none" else granularity
        return speed.layer_time(*speed.korthikanti_setup(end_to_end[size], granularity, sequence_parallel))

    checked = 0
    for row in layer_rows:
        if row["recompute"] == "none":
            continue
        sp = row["sequence_parallel"] == "true"
        # the paper's baseline: no recompute, no sequence parallelism
        overhead = 100 * (layer_seconds(row["model_size"], row["recompute"], sp) /
                          layer_seconds(row["model_size"], "none", False) - 1)
        published = float(row["overhead_percent"])
        assert abs(overhead - published) <= KORTHIKANTI_OVERHEAD_POINTS[row["recompute"]], (row, overhead)
        checked += 1
    assert checked == 7

    for size, row in end_to_end.items():
        full = speed.step_time(*speed.korthikanti_setup(row, "full", False), overlap_gradient_comm=False)
        present = speed.step_time(*speed.korthikanti_setup(row, "core_attn", True), overlap_gradient_comm=False)
        gain = 100 * (full["step_time_s"] / present["step_time_s"] - 1)
        assert abs(gain - float(row["throughput_increase_percent"])) <= KORTHIKANTI_GAIN_POINTS, (size, gain)
        for predicted, column in ((full, "iteration_time_full_recompute_s"), (present, "iteration_time_present_work_s")):
            error = predicted["step_time_s"] / float(row[column]) - 1
            assert abs(error) <= KORTHIKANTI_TIME_TOLERANCE, (size, column, predicted["step_time_s"], row[column])


# ----------------------------------------------------------------------------- search and the CLI
def run_plan(capsys, *args) -> tuple[int, str, str]:
    """scripts/plan.py in this process: (exit code, stdout, stderr)."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import plan

    try:
        code = plan.main([str(a) for a in args])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_results_pass_the_trainers_validation_and_write_round_trips(tmp_path):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate
    from llm_pretrain.planner.search import search, write_arguments

    result = search("gpt3-1.3B-en", "A100-40G", gpus=8, seq=1024, global_batch=16, top=6)
    assert result["refused_by_trainer"] > 0 and result["top"]  # the trainer's rules removed some candidates
    speeds = [r["tokens_per_card_per_sec"] for r in result["top"]]
    assert speeds == sorted(speeds, reverse=True)
    for i, chosen in enumerate(result["top"]):
        path = write_arguments(chosen["arguments"], str(tmp_path / f"d{i}") + "/")
        assert Path(path).name.startswith("pretrain-gpt3_1_3b_en-")
        args, warnings = parse_arguments([path])  # the trainer's parser and validation accept it
        again = estimate(args, 8, "A100-40G")  # ... and the layout checks (raises UsageError otherwise)
        assert again["strategy"] == chosen["strategy"]
        assert again["peak_mem_reserved_mb"] == pytest.approx(chosen["peak_mem_reserved_mb"])
        assert again["peak_mem_reserved_mb"] <= 40 * 1024 * (1 - result["headroom"])


def test_cli_estimate_json_and_invalid_layouts(capsys):
    config = REPO_ROOT / "configs" / "llama" / "pretrain-llama_7b-tp2sd4_stage2.json"
    code, out, err = run_plan(capsys, "estimate", config, "--nproc", 8, "--device", "A100-80G", "--json")
    assert code == 0, err
    result = json.loads(out)
    for key in ("params", "peak_mem_allocated_mb", "peak_mem_reserved_mb", "step_time_s", "tokens_per_card_per_sec",
                "mfu", "fits", "breakdown"):
        assert key in result
    assert result["params"] == parameter_count(ARCHITECTURES["facebook/llama-7b"])
    assert {row["kind"] for row in result["breakdown"]} == {"memory", "time"}
    assert all("rank" in row for row in result["breakdown"])
    code, out, err = run_plan(capsys, "estimate", config, "--nproc", 8, "--device", "A100-80G")
    assert code == 0 and "peak memory allocated" in out and "tokens/card/s" in out
    code, out, err = run_plan(capsys, "estimate", config, "--nproc", 7, "--device", "A100-80G")
    assert code == 2 and err.startswith("error: world size 7") and err.count("\n") == 1
    code, out, err = run_plan(capsys, "estimate", config, "--nproc", 8, "--device", "Z9000")
    assert code == 2 and "--device" in err
    # The real command line: the trainer's own one-line error, exit code 2, no traceback.
    refused = subprocess.run([sys.executable, str(PLAN), "estimate", str(config), "--nproc", "8", "--device",
                              "A100-80G", "--sharding", "stage3"], capture_output=True, text=True, timeout=300,
                             cwd=REPO_ROOT)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: sharding: stage3 cannot be combined with tensor_parallel_degree")


def test_attention_flops_within_documents_closed_form(capsys):
    """With document masks and documents of mean length L in sequences of s tokens a query attends to L keys
    instead of s (llm_pretrain/observe/flops.py): per token and layer the forward's q k^T and p v cost
    4 L (a d) instead of 4 s (a d), training 3x that. llm-plan estimate --mean_document_length counts it
    (argument file with reset_attention_mask), for model and hardware FLOPs; without reset_attention_mask
    the option is refused (one line, exit 2)."""
    from llm_pretrain.observe.flops import model_flops_per_token, training_flops_per_token

    config = ARCHITECTURES["facebook/llama-7b"]
    layers, q_width, s = config.num_hidden_layers, config.num_attention_heads * config.head_dim, 4096
    whole = training_flops_per_token(config, s)
    for length in (1000, 1024, 4096):
        assert training_flops_per_token(config, s, mean_document_length=length) == pytest.approx(
            whole - 3 * layers * 4 * q_width * (s - length))
    assert training_flops_per_token(config, s, mean_document_length=10_000) == whole  # a document ends with its sequence
    assert model_flops_per_token(config, s, causal_attention=True, mean_document_length=1000) == pytest.approx(
        model_flops_per_token(config, s, causal_attention=True) - 3 * layers * 2 * q_width * (s - 1000))
    assert training_flops_per_token(config, s, "core_attn", mean_document_length=1000) == pytest.approx(
        training_flops_per_token(config, s, mean_document_length=1000) + layers * 4 * q_width * 1000)

    args_file = REPO_ROOT / "configs" / "llama" / "pretrain-llama_7b-tp2sd4_stage2.json"
    common = (args_file, "--nproc", 8, "--device", "A100-80G", "--json", "--max_seq_length", s)
    results = {}
    for length in (None, 1000):
        extra = ("--reset_attention_mask", "true") + (() if length is None else ("--mean_document_length", length))
        code, out, err = run_plan(capsys, "estimate", *common, *extra)
        assert code == 0, err
        results[length] = json.loads(out)
    assert results[1000]["mean_document_length"] == 1000
    flops_per_token = {length: r["tflops_per_card"] * 1e12 / r["tokens_per_card_per_sec"] for length, r in results.items()}
    assert flops_per_token[None] == pytest.approx(model_flops_per_token(config.replace(seq_length=s), s))
    assert flops_per_token[1000] == pytest.approx(flops_per_token[None] - 3 * layers * 4 * q_width * (s - 1000))
    assert results[1000]["tokens_per_card_per_sec"] > results[None]["tokens_per_card_per_sec"]
    code, out, err = run_plan(capsys, "estimate", *common, "--mean_document_length", 1000)
    assert code == 2 and err.startswith("error: --mean_document_length: needs reset_attention_mask") \
        and err.count("\n") == 1


def _ring_blocks_kept_by_brute_force(seq: int, degree: int, length: int, micro_batch: int) -> list[float]:
    """For each ring step, the fraction of (rank, phases) that compute their block, counted as the ring
    decides (models/ring_attention.py RingAttention.forward: the block's queries and keys, skipped when no
    query shares a document with any key in any sequence of the micro-batch), over every place the documents
    of `length` tokens can be cut (each sequence of the micro-batch cut independently)."""
    import itertools

    import numpy as np

    from models.ring_attention import chunk_ids

    chunk = seq // (2 * degree)
    positions = [np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(r, degree)])
                 for r in range(degree)]

    def ids(phase):
        starts = (np.arange(seq) + phase) % length == 0
        starts[0] = True
        return np.cumsum(starts)

    counts = [0] * degree
    phases = list(itertools.product(range(length), repeat=micro_batch))
    for cut in phases:
        sequences = [ids(phase) for phase in cut]
        for rank, step in itertools.product(range(degree), range(degree)):
            owner = (rank - step) % degree
            queries, keys = positions[rank], positions[owner]
            if step and owner < rank:
                keys = keys[:chunk]
            elif step:
                queries = queries[chunk:]
            counts[step] += any(np.isin(doc[queries], doc[keys]).any() for doc in sequences)
    return [count / (degree * len(phases)) for count in counts]


def test_ring_skips_the_blocks_document_masks_remove_closed_form_against_a_count():
    """With documents of length L the cp ring skips every block no document crosses into
    (speed.ring_steps_kept): the closed form's fraction of ranks computing each step equals a brute-force
    count of the ring's own rule over packed sequences (one sequence and a micro-batch of two). A skipped step
    still passes its (k, v) and gradients on, so its whole transfer is exposed; its plain blocks compute every
    block kept whole (the hardware FLOPs), flash attention only the keys within documents."""
    for degree, chunk, length, micro_batch in ((2, 3, 4, 1), (3, 4, 7, 1), (4, 3, 5, 1), (4, 3, 11, 1),
                                               (4, 2, 40, 1), (3, 3, 5, 2), (4, 2, 7, 2)):
        seq = 2 * degree * chunk
        assert speed.ring_steps_kept(seq, degree, micro_batch, length) == pytest.approx(
            _ring_blocks_kept_by_brute_force(seq, degree, length, micro_batch)), (degree, chunk, length, micro_batch)
    assert speed.ring_steps_kept(8192, 4, 8, None) == [1.0] * 4

    # Llama (plain attention) on cp4 at 8,192 tokens with 1,000-token documents: chunks of 1,024 tokens, so only
    # steps at distance 1 keep blocks (3 of 4 ranks at steps 1 and 3, none at step 2).
    config = ARCHITECTURES["llama-real"].replace(seq_length=8192, num_hidden_layers=2)
    bf16 = mem.Precision("bf16", "O2", True)
    cluster = speed.Cluster("A100-80G", intra_node_gbps=200.0)
    kept = speed.ring_steps_kept(8192, 4, 1, 1000)
    assert kept == pytest.approx([1, 3 / 4 * (1 - 1 / 1000), 0, 3 / 4 * (1 - 1 / 1000)])
    whole, documents = (speed.step_time(mem.Setup(config, 1, 1, cp=4, precision=bf16, mean_document_length=length),
                                        cluster)["terms"]["sep all-to-all / cp ring (exposed)"] for length in (None, 1000))
    assert whole == 0.0  # every block hides its transfer
    block = 2048 * 2 * 512  # this rank's tokens x (k, v) width
    forward, backward = block * 2 / 200e9, block * (2 + 4) / 200e9  # bf16 k, v; backward also their fp32 gradients
    assert documents == pytest.approx(2 * (sum(1 - k for k in kept[:-1]) * forward + sum(1 - k for k in kept) * backward))
    # compute: the ring's kept blocks whole; flash attention (no ring) the keys within documents; plain in one piece all
    assert speed.attention_keys_computed(mem.Setup(config, 1, 1, cp=4, mean_document_length=1000)) == pytest.approx(
        8192 * sum(kept) / 4)
    flash = config.replace(use_flash_attention=True)
    assert speed.attention_keys_computed(mem.Setup(flash, 1, 1, mean_document_length=1000)) == 1000
    assert speed.attention_keys_computed(mem.Setup(config, 1, 1, mean_document_length=1000)) is None


def test_search_with_documents_times_as_estimate_and_ranks_cp_lower(tmp_path, capsys):
    """llm-plan search --mean_document_length: every row has reset_attention_mask and the numbers `estimate
    --mean_document_length` gives its written file (the best row and the best cp row). GPT-3 1.3B, 4 A100s,
    8,192 tokens: without documents a cp layout ranks first (flash ring blocks, nothing exposed); with
    1,000-token documents the cp layouts run the ring's plain blocks and expose the transfers of the blocks they
    skip, and a layout without a sequence split ranks first. L < 1 is refused in one line."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate
    from llm_pretrain.planner.search import write_arguments

    common = ("search", "--model", "gpt3-1.3B-en", "--device", "A100-80G", "--gpus", 4, "--seq", 8192,
              "--global_batch_size", 8, "--top", 1000, "--json")
    results = {}
    for length in (None, 1000):
        code, out, err = run_plan(capsys, *common, *(() if length is None else ("--mean_document_length", length)))
        assert code == 0, err
        results[length] = json.loads(out)["top"]
    assert results[None][0]["arguments"].get("context_parallel_degree", 1) > 1
    best = results[1000][0]
    assert best["arguments"].get("context_parallel_degree", 1) == 1 and best["arguments"]["reset_attention_mask"]
    ring = next(r for r in results[1000] if r["arguments"].get("context_parallel_degree", 1) > 1)
    assert ring["tokens_per_card_per_sec"] < 0.95 * best["tokens_per_card_per_sec"]
    exposed = {row["term"]: row["s"] for row in ring["breakdown"] if row["kind"] == "time"}
    assert exposed["sep all-to-all / cp ring (exposed)"] > 0 and not ring["arguments"]["use_flash_attention"]
    for row in (best, ring):
        assert row["mean_document_length"] == 1000
        args, _ = parse_arguments([write_arguments(row["arguments"], str(tmp_path / f"{row['strategy']}.json"))])
        again = estimate(args, 4, "A100-80G", mean_document_length=1000)
        for key in ("step_time_s", "tokens_per_card_per_sec", "mfu", "peak_mem_reserved_mb"):
            assert again[key] == pytest.approx(row[key]), (row["strategy"], key)
    code, out, err = run_plan(capsys, *common, "--mean_document_length", 0)
    assert code == 2 and err.startswith("error: --mean_document_length: must be >= 1") and err.count("\n") == 1


def test_cli_search_writes_file(tmp_path, capsys):
    code, out, err = run_plan(capsys, "search", "--model", "gpt3-1.3B-en", "--device", "A100-80G", "--gpus", 4,
                              "--seq", 1024, "--global_batch_size", 8, "--top", 3, "--write", str(tmp_path) + "/")
    assert code == 0, err
    written = list(tmp_path.glob("pretrain-gpt3_1_3b_en-*.json"))
    assert len(written) == 1 and str(written[0]) in out
    assert "bottleneck" in out


# ----------------------------------------------------------------------------- one place decides validity
def test_trainer_and_planner_share_one_validity_module():
    from llm_pretrain.parallel import distributed, layout
    from llm_pretrain.run import preflight
    from llm_pretrain.planner import estimate

    # the run's preflight and the planner's estimate call the one check of layout and model (which runs
    # plan_layout, check_model_fits_layout and check_strategy); fleet's setup plans with the same plan_layout
    assert preflight.check_layout_and_model is estimate.check_layout_and_model is layout.check_layout_and_model
    assert distributed.plan_layout is layout.plan_layout
    assert distributed.parallel_config_settings is layout.parallel_config_settings
    assert "import paddle" not in Path(layout.__file__).read_text()  # the planner needs no Paddle for validity
    run = layout.Layout(world_size=32, data_parallel_degree=2, tensor_parallel_degree=2, pipeline_parallel_degree=4,
                        sharding_degree=2, sharding_stage=1, virtual_pp_degree=2)
    assert run.strategy == layout.strategy_name(2, 4, 2, 1, 2, 2) == "pp4vpp2tp2dp2sd2_stage1"


def test_perf_table_shows_prediction_beside_measured():
    from llm_pretrain.observe import perf

    run = {"model": "llama-real", "strategy": "tp2", "layout": {"world_size": 2}, "device": "cpu",
           "prediction": {"peak_mem_allocated_mb": 351.6, "peak_mem_reserved_mb": None, "tokens_per_card_per_sec": None}}
    record = {**perf.run_fields(run), "status": "ok", "tokens_per_card_per_sec": 10.0, "peak_mem_allocated_mb": 349.6,
              "peak_rss_mb": 749.0}
    assert perf.memory_cell(record) == "350 (RSS 749) (predicted 352)"
    gpu = {**perf.run_fields({**run, "prediction": {"peak_mem_reserved_mb": 70000.0, "tokens_per_card_per_sec": 3000.0}}),
           "status": "ok", "tokens_per_card_per_sec": 2900.0, "peak_mem_allocated_mb": 60000.0,
           "peak_mem_reserved_mb": 72000.0}
    row = perf.table_row(gpu)
    assert "2,900.0 (predicted 3,000.0)" in row and "60,000 / 72,000 (predicted 70,000)" in row


# ----------------------------------------------------------------------------- uneven pipeline stages (issue 24)
def test_uneven_split_sets_the_heaviest_stage_and_the_slowest_stage():
    config = ARCHITECTURES["llama-real"].replace(num_hidden_layers=8, seq_length=128)
    bf16 = mem.Precision("bf16", "O2", True)
    even = mem.Setup(config, 1, 4, pp=2, precision=bf16)
    uneven = mem.Setup(config, 1, 4, pp=2, precision=bf16, layers_per_stage=(3, 5))
    assert {p.layer for p in uneven.stage_parameters(1) if p.layer is not None} == {3, 4, 5, 6, 7}
    assert mem.rank_memory(uneven, 1).peak_bytes > mem.rank_memory(even, 1).peak_bytes
    assert mem.rank_memory(uneven, 0).peak_bytes < mem.rank_memory(even, 0).peak_bytes
    assert mem.peak_memory(uneven)[0].rank == "pipeline stage 1"
    cluster = speed.Cluster("A100-80G")
    t_even, t_uneven = speed.step_time(even, cluster), speed.step_time(uneven, cluster)
    assert t_uneven["slowest_stage"] == 1
    assert t_uneven["terms"]["compute"] == pytest.approx(t_even["terms"]["compute"] * 5 / 4)
    # interleaved: the heaviest chunk of a stage bounds its in-flight activations
    ones = mem.Setup(config, 1, 4, pp=4, vpp=2, precision=bf16, layers_per_stage=(1,) * 8)
    nine = config.replace(num_hidden_layers=9)
    heavy = mem.Setup(nine, 1, 4, pp=4, vpp=2, precision=bf16, layers_per_stage=(1,) * 7 + (2,))
    assert ones.stage_chunks(3) == [[3], [7]] and heavy.stage_chunks(3) == [[3], [7, 8]]
    activations = "activations (in-flight micro-batches)"
    one_layer = mem.layer_activation_bytes(config, ones, 0)
    assert (mem.rank_memory(heavy, 3).phases["backward start"][activations]
            - mem.rank_memory(ones, 3).phases["backward start"][activations]) == pytest.approx(
        mem.in_flight_micro_batches(ones, 3) * one_layer)


def test_bloom_176b_published_layout_validates_and_fits():
    """DP 8 x TP 4 x PP 12, ZeRO-1, 384 A100-80G, 70 layers (Le Scao et al. 2022): fleet's uniform split
    [5, 6 x 10, 5]; BigScience's training page reports ~60 GB used per GPU and about 150 TFLOP/s."""
    from llm_pretrain.arguments import Arguments, validate_arguments
    from llm_pretrain.planner.estimate import estimate
    from llm_pretrain.planner.search import base_arguments

    values = dict(base_arguments("bigscience/bloom", 2048, "A100-80G"), recompute=True, recompute_granularity="full",
                  tensor_parallel_degree=4, pipeline_parallel_degree=12, sharding="stage1",
                  sharding_parallel_degree=8, per_device_train_batch_size=2, gradient_accumulation_steps=128)
    args = Arguments(**values)
    validate_arguments(args)
    result = estimate(args, 384, "A100-80G")
    assert result["strategy"] == "pp12tp4sd8_stage1" and result["fits"]
    # stages 0 and 11 hold 5 layers and the embedding / head; stage 1 stands for the ten stages of 6 layers
    assert {rank.split(",")[0] for rank in result["ranks"]} == {f"pipeline stage {s}" for s in (0, 1, 11)}
    assert result["peak_mem_reserved_mb"] < 80 * 1024
    assert 100 < result["hardware_tflops_per_card"] < 200


# ----------------------------------------------------------------------------- PaddleNLP's published runs (issue 24)
PADDLENLP_TABLE = REPO_ROOT / "llm_pretrain" / "planner" / "data" / "paddlenlp_pretrain_memory.csv"


def paddlenlp_rows() -> list[dict]:
    with open(PADDLENLP_TABLE, encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_paddlenlp_published_runs_fit_and_allocated_agrees():
    """PaddleNLP ran these 11 layouts on 8 x A100-80G (a check, not a calibration set): each must fit with
    search's headroom; predicted allocated within 10 % of the published max_memory_allocated; reserved above
    allocated by less than the 2-3 GB the table reports for physical use (which adds the CUDA context)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate
    from llm_pretrain.planner.search import DEFAULT_HEADROOM

    rows = paddlenlp_rows()
    assert len(rows) == 11
    for row in rows:
        overrides = [f"--{key}={value}" for key, value in
                     (item.split("=") for item in row["table_overrides"].split() if item)]
        args = parse_arguments([str(REPO_ROOT / "configs" / row["our_config"]), "--max_seq_length",
                                row["seq_length"], *overrides])[0]
        result = estimate(args, 8, "A100-80G")
        published = float(row["max_memory_allocated_mb"])
        assert result["strategy"].replace("dp1", "") == row["strategy"]
        assert abs(result["peak_mem_allocated_mb"] / published - 1) < 0.10, (row["model"], result["peak_mem_allocated_mb"])
        gap = result["peak_mem_reserved_mb"] - result["peak_mem_allocated_mb"]
        assert 0 < gap < 3 * 1024, (row["model"], gap)
        assert result["fits"] and result["peak_mem_reserved_mb"] < 80 * 1024 * (1 - DEFAULT_HEADROOM), row["model"]


# Predicted speed over PaddleNLP's published tokens/card/s (issue 33 finding 5). The causal rows: flash attention
# with is_causal. Baichuan2-13B (ALiBi): flash attention reading an additive mask, whose reads are a term of their
# own (speed.additive_mask_time). What is left of its gap (~10 points over the causal rows' band) is, by the
# planner's own numbers, mostly the attention FLOPs: the planner counts the full s x s square for every model (its
# Megatron calibration computes it), a causal flash kernel skips the masked half, a masked one cannot; counting
# the causal rows' attention as half moves them to +9.5..+13.4 % and leaves the ALiBi row 3.3 points above
# them (docs/performance-and-planner.md). That accounting changes every causal prediction, so it is not taken.
PADDLENLP_SPEED_BAND = (0.0, 0.10)   # causal rows: +2.5..+7.0 %
PADDLENLP_ALIBI_SPEED_BOUND = 0.18   # Baichuan2-13B: +16.7 % with the mask reads (+20.4 % without)


def test_paddlenlp_published_speeds_and_the_alibi_mask_reads():
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.estimate import estimate

    errors = {}
    for row in paddlenlp_rows():
        overrides = [f"--{key}={value}" for key, value in
                     (item.split("=") for item in row["table_overrides"].split() if item)]
        args = parse_arguments([str(REPO_ROOT / "configs" / row["our_config"]), "--max_seq_length",
                                row["seq_length"], *overrides])[0]
        result = estimate(args, 8, "A100-80G")
        errors[row["model"]] = result["tokens_per_card_per_sec"] / float(row["tokens_per_card_per_sec"]) - 1
        mask = next(t["s"] for t in result["breakdown"] if t["term"].startswith("flash attention's additive mask"))
        if row["model"] == "baichuan-inc/Baichuan2-13B-Base":
            # 40 layers x 3 reads (forward, recomputed forward, backward) of [1, 40, 4096, 4096] bf16 at 2,039 GB/s,
            # for each of the 8 micro-batches
            assert mask == pytest.approx(8 * 40 * 3 * 40 * 4096 * 4096 * 2 / 2039e9, rel=1e-9)
        else:
            assert mask == 0.0, row["model"]
    alibi = errors.pop("baichuan-inc/Baichuan2-13B-Base")
    low, high = PADDLENLP_SPEED_BAND
    assert all(low < error < high for error in errors.values()), errors
    assert low < alibi < PADDLENLP_ALIBI_SPEED_BOUND, alibi


def test_search_explains_why_nothing_fits(capsys):
    """With nothing kept, search prints the trainer's reasons with counts and the closest misses (issue 24)."""
    from llm_pretrain.cli.plan import main
    from llm_pretrain.planner.search import search

    result = search("facebook/llama-7b", "A100-40G", 6, 4096, 6, headroom=0.9)
    assert result["top"] == [] and result["refused_by_trainer"] > 0 and result["too_large"] > 0
    assert sum(r["count"] for r in result["refusals"]) == result["refused_by_trainer"]
    assert [r["count"] for r in result["refusals"]] == sorted((r["count"] for r in result["refusals"]), reverse=True)
    misses = [c["over_mb"] for c in result["closest"]]
    assert len(misses) == 5 and misses == sorted(misses) and misses[0] > 0
    for c in result["closest"]:
        assert c["over_mb"] == pytest.approx(c["reserved_mb"] - 40 * 1024 * 0.1)
    assert main(["search", "--model", "facebook/llama-7b", "--device", "A100-40G", "--gpus", "6", "--seq", "4096",
                 "--global_batch_size", "6", "--headroom", "0.9"]) == 1
    out = capsys.readouterr().out
    top = result["refusals"][0]
    assert "no layout fits" in out and f"{top['count']:>6} x {top['example']}" in out
    assert f"by {result['closest'][0]['over_mb']:,.0f} MB" in out


def test_schedule_bubble_terms_and_dualpipev_stages():
    """Bubble (p - 1) micro-batch times for 1F1B, (p - 1) / v for the interleaved schedules, (p - 1) / 2 for
    DualPipeV's V; DualPipeV's stage 0 holds the embedding, the head and the first and last chunks."""
    config = ARCHITECTURES["llama-real"].replace(num_hidden_layers=8, seq_length=128)
    bf16 = mem.Precision("bf16", "O2", True)
    cluster = speed.Cluster("A100-80G")
    setups = {"1F1B": mem.Setup(config, 1, 8, pp=4, precision=bf16),
              "interleaved": mem.Setup(config, 1, 8, pp=4, vpp=2, precision=bf16),
              "dualpipev": mem.Setup(config, 1, 8, pp=4, precision=bf16, dualpipev=True)}
    times = {name: speed.step_time(setup, cluster) for name, setup in setups.items()}
    micro = times["1F1B"]["terms"]["pipeline bubble"] / 3
    assert times["interleaved"]["terms"]["pipeline bubble"] == pytest.approx(3 / 2 * micro)
    assert times["dualpipev"]["terms"]["pipeline bubble"] == pytest.approx(3 / 2 * micro)
    v = setups["dualpipev"]
    assert v.stage_chunks(0) == [[0], [7]] and v.stage_chunks(3) == [[3], [4]]
    parts = {p.part for p in v.stage_parameters(0)}
    assert {"embedding", "head", "norm"} <= parts and {p.part for p in v.stage_parameters(3)} == {"layer"}
    assert mem.in_flight_micro_batches(v, 0) == 5  # PP + 1 (DualPipe's table)
