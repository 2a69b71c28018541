"""ERNIE 4.5 (issue 34): the published sizes and counts, the interleaved rotary layout of its weights, bad input,
the refused layouts, and a short training run of the tiny preset through run_pretrain."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from llm_pretrain.errors import UsageError as RunUsageError
from llm_pretrain.planner.params import parameter_list
from models.decoder import CausalLM, apply_rotary, rotary_cos_sin
from models.errors import UsageError
from models.families.ernie4_5 import ernie4_5_config_json, ernie4_5_table
from models.families.ernie4_5_moe import PUBLISHED, moe_layers, parameter_counts
from models.paddlenlp_interop import _join, _split
from models.registry import ARCHITECTURES, config_from_dict, parameter_count
from parity_utils import RUN_PRETRAIN, base_arguments, train_records, write_json

# baidu/ERNIE-4.5-0.3B-Base-PT's config.json values (models/families/ernie4_5.py gives the source)
ERNIE_03B_CONFIG_JSON = dict(
    architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", vocab_size=103424, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000, use_bias=False,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=False,
    torch_dtype="bfloat16")


def test_03b_is_the_cards_036b_and_the_planner_counts_it():
    config = ARCHITECTURES["baidu/ERNIE-4.5-0.3B-Base-PT"]
    assert parameter_count(config) == 360_748_032  # "0.36B" on the model card
    assert sum(p.numel for p in parameter_list(config, 1)) == parameter_count(config)
    assert config.head_dim == 128 and config.q_size == 2048 != config.hidden_size and config.tie_word_embeddings


def test_published_config_json_is_the_built_in_architecture():
    config = config_from_dict(dict(ERNIE_03B_CONFIG_JSON), source="ERNIE-4.5-0.3B-Base-PT/config.json")
    assert config == ARCHITECTURES["baidu/ERNIE-4.5-0.3B-Base-PT"]
    for name in ("baidu/ERNIE-4.5-0.3B-Base-PT", "ernie4_5-tiny"):  # our export's config.json reads back the same
        assert config_from_dict(ernie4_5_config_json(ARCHITECTURES[name]), source=name) == ARCHITECTURES[name]


@pytest.mark.parametrize("change, key", [
    ({"use_bias": True}, "use_bias true"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling"),
    ({"model_type": "ernie4_5_moe_vl"}, "model_type 'ernie4_5_moe_vl'"),
])
def test_what_it_cannot_compute_is_refused_in_one_line(change, key):
    with pytest.raises(UsageError) as error:
        config_from_dict({**ERNIE_03B_CONFIG_JSON, **change}, source="ERNIE/config.json")
    message = str(error.value)
    assert "\n" not in message and key in message and "ERNIE/config.json" in message


@pytest.mark.parametrize("name", ["ernie4_5-tiny", "ernie4_5-real"])
def test_presets_hold_the_counted_parameters(name):
    config = ARCHITECTURES[name]
    shapes = {n: list(p.shape) for n, p in CausalLM(config).named_parameters()}
    assert sum(int(np.prod(s)) for s in shapes.values()) == parameter_count(config)
    assert shapes["layers.0.self_attn.q_proj.weight"] == [config.hidden_size, config.num_attention_heads * config.head_dim]
    assert not any(n.endswith(".bias") for n in shapes) and "lm_head.weight" not in shapes  # no biases, tied
    if name == "ernie4_5-real":  # stage 3 slices > 2**20 elements, stage 2 keeps > 2**23 out of its buffer
        assert int(np.prod(shapes["layers.0.mlp.gate_proj.weight"])) > 2**20
        assert int(np.prod(shapes["embeddings.word_embeddings.weight"])) > 2**23


def _interleaved_rope(x, cos, sin):
    """PaddleFormers 0.4.1's ERNIE 4.5 rotation (transformers/ernie4_5/modeling.py apply_rotary_pos_emb), numpy:
    the tables' first halves repeated pairwise, pairs (2j, 2j + 1) rotated."""
    cos = np.repeat(cos[..., : cos.shape[-1] // 2], 2, axis=-1)
    sin = np.repeat(sin[..., : sin.shape[-1] // 2], 2, axis=-1)
    rotated = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    return x * cos + rotated * sin


@pytest.mark.parametrize("transpose", [False, True])
def test_exported_q_and_k_give_their_interleaved_rope_our_attention_scores(transpose):
    """Our q.k with our rotation and weights == theirs with their rotation and the exported (reordered) weights."""
    config = ARCHITECTURES["ernie4_5-tiny"]
    rules = {r.theirs: r for r in ernie4_5_table(config, transpose=transpose)}
    rng = np.random.default_rng(0)
    seq, d, h, kv = 6, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    x = rng.standard_normal([seq, config.hidden_size]).astype("float32")
    wq = rng.standard_normal([config.hidden_size, h * d]).astype("float32")
    wk = rng.standard_normal([config.hidden_size, kv * d]).astype("float32")
    cos, sin = (t.numpy()[0, :, 0] for t in rotary_cos_sin(seq, d, config.rope_theta))
    theirs_q = _join(rules["model.layers.{i}.self_attn.q_proj.weight"].join, [wq], config)
    theirs_k = _join(rules["model.layers.{i}.self_attn.k_proj.weight"].join, [wk], config)
    if transpose:  # PyTorch's [out, in]
        theirs_q, theirs_k = theirs_q.T, theirs_k.T

    def scores(q, k, rope):
        q, k = q.reshape(seq, h, d), k.reshape(seq, kv, d)
        q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
        k = np.repeat(k, h // kv, axis=1)
        return np.einsum("shd,thd->hst", q, k)

    ours_rope = lambda x, c, s: apply_rotary(paddle.to_tensor(x[None]), paddle.to_tensor(c[None]),  # noqa: E731
                                             paddle.to_tensor(s[None])).numpy()[0]
    ours = scores(x @ wq, x @ wk, ours_rope)
    theirs = scores(x @ theirs_q, x @ theirs_k, _interleaved_rope)
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-3)
    # the reordering is a permutation, and import undoes it
    back = _split(rules["model.layers.{i}.self_attn.q_proj.weight"].join,
                  theirs_q.T if transpose else theirs_q, [h * d], config)[0]
    np.testing.assert_array_equal(back, wq)
    assert not np.array_equal(theirs_q if not transpose else theirs_q.T, wq)


def test_moe_published_counts_are_the_model_cards():
    total, activated = parameter_counts(PUBLISHED["baidu/ERNIE-4.5-21B-A3B-Base-PT"])
    assert (total, activated) == (21_825_437_888, 3_352_150_208)  # "21B total, 3B activated" (cut)
    assert moe_layers(PUBLISHED["baidu/ERNIE-4.5-21B-A3B-Base-PT"]) == list(range(1, 28))  # layer 0 dense
    total, activated = parameter_counts(PUBLISHED["baidu/ERNIE-4.5-300B-A47B-Base-PT"])
    assert (total, activated) == (298_636_913_856, 47_079_337_152)  # "300B", "47B"
    assert round(total / 1e9, -2) == 300 and round(activated / 1e9) == 47
    assert moe_layers(PUBLISHED["baidu/ERNIE-4.5-300B-A47B-Base-PT"]) == list(range(3, 54))


DP, PP, SD1 = {"data_parallel_degree": 2}, {"pipeline_parallel_degree": 2}, {"sharding_degree": 2, "sharding_stage": 1}
SD2, SD3 = {**SD1, "sharding_stage": 2}, {**SD1, "sharding_stage": 3}
TP, SEP, CP = {"tensor_parallel_degree": 2}, {"sep_parallel_degree": 2}, {"context_parallel_degree": 2}
# ep2 over dp2, over sd2 stages 1 and 2 (test_expert_parallel: qwen3-global-ep2*, ernie-moe-ep2*)
EP = [{**DP, "ep": 2}, {**SD1, "ep": 2}, {**SD2, "ep": 2}]
# preset -> (layouts proven against one process, each alone, the refused ones with the key their one line names):
# tp2 (+ SP): test_parallel_parity TP_ONLY (Qwen3-MoE: QWEN3_MOE_TP); dp2, the 1F1B pp2, sharding stages 1-3: LAYOUT_SHORT; sep2, cp2:
# test_long_context (all four; Qwen3, ERNIE 4.5 also sep2 / cp2 x tp2 and x sharding stages 2, 3 (Qwen3) or 1, 2 (ERNIE 4.5), checked below); EP:
# test_expert_parallel (Qwen3-MoE, ERNIE 4.5 MoE)
PROVEN_AND_REFUSED = {
    "ernie4_5-tiny": ([TP, DP, PP, SD1, SD2, SD3, SEP, CP], []),
    "ernie4_5_moe-tiny": ([TP, DP, PP, SD1, SD2, SD3, SEP, CP, *EP], []),
    "qwen3-tiny": ([TP, DP, PP, SD1, SD2, SD3, SEP, CP], []),
    "qwen3-moe-tiny": ([TP, DP, PP, SD1, SD2, SD3, SEP, CP, *EP], []),
}
# every one with pp2 proven: DualPipeV is not; the pipeline's virtual stages for all four, the pipeline alone
# (test_parallel_parity test_pp4_interleaved: INTERLEAVED_SHORT; the mixtures of experts in test_uneven_pipeline's pp3
# launch: qwen3-moe-pp3vpp2, ernie-moe-pp3vpp2), not beside another degree
INTERLEAVED = {"pipeline_parallel_degree": 4, "virtual_pp_degree": 2, "world_size": 4}
NOT_PROVEN_ANYWHERE = [({"pipeline_parallel_degree": 2, "dualpipev": True, "world_size": 2},
                        "pipeline_parallel_config: use_dualpipev")]


@pytest.mark.parametrize("preset", PROVEN_AND_REFUSED)
def test_layouts_not_proven_are_refused_in_one_line(preset):
    """Issue 34's families: the layouts a test trains against one process are accepted, every other is refused
    in one line naming the key (llm_pretrain/parallel/layout.py PROVEN_DEGREES)."""
    from llm_pretrain.parallel.layout import Layout, check_proven_layout

    config = ARCHITECTURES[preset]
    proven, refused = PROVEN_AND_REFUSED[preset]
    for degrees in proven:
        degrees = dict(degrees)
        ep = degrees.pop("ep", 1)
        check_proven_layout(config, Layout(world_size=2, **degrees), ep)
    beyond = [(d, key) for d, key in NOT_PROVEN_ANYWHERE  # (else refused by the degree already)
              if (SD1 if key.startswith("sharding") else PP) in proven]
    for degrees, key in [(d, f"{key}: 2") for d, key in refused] + beyond:
        degrees = dict(degrees)
        ep = degrees.pop("ep", 1)
        with pytest.raises(RunUsageError) as error:
            check_proven_layout(config, Layout(**{"world_size": 2, **degrees}), ep)
        message = str(error.value)
        assert message.startswith(f"{key} is not proven for {config.family}") and "\n" not in message, message
    check_proven_layout(ARCHITECTURES["llama-tiny"], Layout(world_size=2, sharding_degree=2, sharding_stage=3))
    check_proven_layout(config, Layout(**INTERLEAVED))
    with pytest.raises(RunUsageError, match=f"^pipeline_parallel_degree 4 with data_parallel_degree 2 together is not "
                                            f"proven for {config.family}"):
        check_proven_layout(config, Layout(**{**INTERLEAVED, "world_size": 8, "data_parallel_degree": 2}))
    if config.is_moe:  # pp x dp x ep is proven under 1F1B only
        with pytest.raises(RunUsageError, match=f"^virtual_pp_degree: 2 is not proven for {config.family} in this layout"):
            check_proven_layout(config, Layout(**{**INTERLEAVED, "world_size": 8, "data_parallel_degree": 2}), 2)
    if len(proven) > 1:  # each degree alone: two together are refused
        with pytest.raises(RunUsageError, match=f"^pipeline_parallel_degree 2 with data_parallel_degree 2 together is "
                                                f"not proven for {config.family}"):
            check_proven_layout(config, Layout(world_size=4, data_parallel_degree=2, pipeline_parallel_degree=2))
    if preset in ("qwen3-tiny", "ernie4_5-tiny"):  # pairs proven (test_long_context PAIR_MODELS): sep2 or cp2 with
        trained, untrained = ((2, 3), 1) if config.family == "qwen3" else ((1, 2), 3)  # its own PAIR_SHARDING runs
        for split in (SEP, CP):                     # tp2 (+ SP), and with sharding 2 at the stages its runs train
            check_proven_layout(config, Layout(world_size=4, **split, **TP))
            for stage in trained:
                check_proven_layout(config, Layout(world_size=4, **split, sharding_degree=2, sharding_stage=stage))
            with pytest.raises(RunUsageError, match=f"^sharding: stage{untrained} is not proven for {config.family}"):
                check_proven_layout(config, Layout(world_size=4, **split, sharding_degree=2, sharding_stage=untrained))
            with pytest.raises(RunUsageError, match=f"^data_parallel_degree 2 with {next(iter(split))} 2 together is "
                                                    f"not proven for {config.family}"):
                check_proven_layout(config, Layout(world_size=4, data_parallel_degree=2, **split))
        with pytest.raises(RunUsageError, match="^tensor_parallel_degree 2 with sharding_parallel_degree 2 with "
                                                f"sep_parallel_degree 2 together is not proven for {config.family}"):
            check_proven_layout(config, Layout(world_size=8, **TP, **SEP, sharding_degree=2, sharding_stage=2))
    if preset in ("qwen3-moe-tiny", "ernie4_5_moe-tiny"):  # one pair each with tp2 (test_long_context MOE_PAIRS):
        proven_split, refused_split = (SEP, CP) if config.family == "qwen3_moe" else (CP, SEP)  # Qwen3-MoE sep2, ERNIE cp2
        check_proven_layout(config, Layout(world_size=4, **proven_split, **TP))
        with pytest.raises(RunUsageError, match=f"^tensor_parallel_degree 2 with {next(iter(refused_split))} 2 together "
                                                f"is not proven for {config.family}"):
            check_proven_layout(config, Layout(world_size=4, **refused_split, **TP))
        for split in (SEP, CP):  # nor with sharding
            with pytest.raises(RunUsageError, match=f"^sharding_parallel_degree 2 with {next(iter(split))} 2 together "
                                                    f"is not proven for {config.family}"):
                check_proven_layout(config, Layout(world_size=4, **split, sharding_degree=2, sharding_stage=2))
    if {**DP, "ep": 2} in proven:  # expert parallelism over the data-parallel or sharding ranks, not the stages
        with pytest.raises(RunUsageError, match="^expert_parallel_degree: 2 with the pipeline is not proven"):
            check_proven_layout(config, Layout(world_size=2, **PP), 2)
        # pp2 x dp2 with ep2 over dp (test_expert_parallel pp2dp2ep2-qwen3-global, pp2dp2ep2-ernie) and pp2 x sd2
        # stage 1 with ep2 over the sharding ranks (pp2sd2ep2-qwen3-global, pp2sd2ep2-ernie); not with tp2, not at
        # sharding stage 2, not pp x sharding without the experts split
        check_proven_layout(config, Layout(world_size=4, **PP, **DP), 2)
        check_proven_layout(config, Layout(world_size=4, **PP, **SD1), 2)
        with pytest.raises(RunUsageError, match=f"^sharding: stage2 is not proven for {config.family} .* allowed: "
                                                "stage1$"):
            check_proven_layout(config, Layout(world_size=4, **PP, **SD2), 2)
        tp = [({"world_size": 8, **TP, **DP}, "tensor_parallel_degree 2 with pipeline_parallel_degree 2 with "
                                              "data_parallel_degree 2")] if TP in proven else []
        for more, ep, key in [(m, 2, k) for m, k in tp] + [
                ({"world_size": 4, **SD1}, 1, "pipeline_parallel_degree 2 with sharding_parallel_degree 2")]:
            with pytest.raises(RunUsageError, match=f"^{key} together is not proven for {config.family}"):
                check_proven_layout(config, Layout(**PP, **more), ep)


def test_tiny_trains_through_run_pretrain(embedded_corpus, tmp_path):
    import os
    import subprocess
    import sys

    args_file = write_json(tmp_path / "ernie.json", base_arguments(
        embedded_corpus, tmp_path, model_name_or_path="ernie4_5-tiny", max_seq_length=32,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=12, warmup_steps=2,
        logging_steps=4, save_steps=0, learning_rate=0.005, device="cpu"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PADDLE_TRAINERS_NUM", None)
    result = subprocess.run([sys.executable, str(RUN_PRETRAIN), str(args_file), "--output_dir", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in train_records(tmp_path / "out")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
