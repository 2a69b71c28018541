"""Reference parity: our one decoder against PaddleNLP 2.8's own model classes.

For each family a tiny PaddleNLP model (fp32, CPU, dropout 0) gets random weights --
every parameter, norms and biases included, large enough that attention is far from
uniform -- which are converted to our names by models/paddlenlp_interop.py and loaded
into our CausalLM. Logits and loss must agree within 1e-5 on the same input ids and
(unshifted) labels, some of them -100.

Loss conventions: PaddleNLP's LLaMA/Qwen/Bloom criteria, like ours, take labels aligned
with the logits (no shift inside the model) and skip -100; PaddleNLP's GPT skips its
config.ignore_index, 0 by default, so the GPT cases set ignore_index=-100.

Mixture of experts: PaddleNLP 2.8.1's MixtralForCausalLM with output_router_logits, so that its loss
includes the load-balancing loss (router_aux_loss_coef 0.02, large enough to matter at 1e-5). It has
no Qwen2-MoE class; Qwen2-MoE is checked against MixtralForCausalLM given, in this file, what
Qwen2-MoE adds: q/k/v biases, a shared expert behind a sigmoid gate and top-k weights that are not
renormalized (the block's forward written after Hugging Face's Qwen2MoeSparseMoeBlock).

PaddleNLP 2.8.1 has no class with Baichuan2's NormHead (its Baichuan checkpoints run as
LlamaForCausalLM, without head normalization), so `norm_head` is checked against
PaddleNLP's LLaMA(alibi) body with a head we L2-normalize in numpy.
"""

from __future__ import annotations

import json
import os

import numpy as np
import paddle
import pytest

from models.decoder import CausalLM
from models.families import FAMILIES, get_family, reference_cases
from models.paddlenlp_interop import from_paddlenlp_state, paddlenlp_config
from models.rope import llama3_scaled_inv_freq
from models.weights import init_weights, load_full_weights

paddlenlp_transformers = pytest.importorskip("paddlenlp.transformers")

TOLERANCE = 1e-5
BATCH, SEQ, VOCAB = 2, 16, 256

# name -> ReferenceCase (the reference class, its config, our ModelConfig): every family record's cases
RECORD_CASES = reference_cases()
CASES = {name: (case.class_name, case.config_class, case.kwargs, case.config) for name, case in RECORD_CASES.items()}


def build_paddlenlp_model(case: str, seed: int = 0):
    """(reference model in eval mode with random weights, its config.json as a dict, our ModelConfig).

    The config.json and the weights' names are those of the family's reference format: for a case
    whose reference is PaddleNLP's LLaMA given q/k/v biases (Qwen2), use `reference_state` /
    `save_reference` to get them in Qwen2's names.
    """
    record = RECORD_CASES[case]
    config = getattr(paddlenlp_transformers, record.config_class)(**record.kwargs)
    paddle.seed(seed)
    model = getattr(paddlenlp_transformers, record.class_name)(config)
    runnable_moe_blocks(model)
    if record.qkv_bias:
        give_qkv_biases(model)
    runnable_moe_blocks(model)
    if record.config.shared_expert_intermediate_size:
        make_qwen2_moe(model, record.config.shared_expert_intermediate_size)
    if record.rope_scaling:
        scale_rotary_tables(model, record.rope_scaling)
    randomize(model, seed)
    if record.config.tie_word_embeddings and record.class_name == "LlamaForCausalLM":
        with paddle.no_grad():  # PaddleNLP 2.8.1's LLaMA cannot tie its [hidden, vocab] head: set it equal
            model.lm_head.weight.set_value(model.llama.embed_tokens.weight.numpy().T)
    model.eval()
    return model, reference_config_json(case, config.to_dict()), record.config


def body(model):
    """The decoder stack of a PaddleNLP causal LM (LlamaForCausalLM.llama, MixtralForCausalLM.mixtral)."""
    return model.mixtral if hasattr(model, "mixtral") else model.llama


# The reference's parameter-name prefix -> the family's, for the references given q/k/v biases
QWEN_PREFIXES = {"llama.": "qwen2.", "mixtral.": "qwen2_moe."}
# Mixtral's expert matrices -> Qwen2-MoE's (and ours)
EXPERT_NAMES = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def to_qwen_names(name: str) -> str:
    for theirs, ours in QWEN_PREFIXES.items():
        if name.startswith(theirs):
            name = ours + name[len(theirs):]
            if ours == "qwen2_moe.":
                name = name.replace("block_sparse_moe.", "mlp.")
                for mixtral, qwen in EXPERT_NAMES:
                    name = name.replace(mixtral, qwen) if ".experts." in name else name
    return name


def from_qwen_names(name: str) -> str:
    for theirs, ours in QWEN_PREFIXES.items():
        if name.startswith(ours):
            name = theirs + name[len(ours):]
            if theirs == "mixtral.":
                name = name.replace(".mlp.", ".block_sparse_moe.")
                for mixtral, qwen in EXPERT_NAMES:
                    name = name.replace(qwen, mixtral) if ".experts." in name else name
    return name


class SharedExpert(paddle.nn.Layer):
    """Qwen2-MoE's shared expert: a SwiGLU MLP (HF Qwen2MoeMLP)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = paddle.nn.Linear(hidden, inner, bias_attr=False)
        self.up_proj = paddle.nn.Linear(hidden, inner, bias_attr=False)
        self.down_proj = paddle.nn.Linear(inner, hidden, bias_attr=False)

    def forward(self, x):
        return self.down_proj(paddle.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def moe_block_forward(block, hidden_states):
    """PaddleNLP 2.8.1's MixtralSparseMoeBlock.forward (mixtral/modeling.py), line for line but for one
    shape: under Paddle 3.3.1 `routing_weights[top_x, idx]` has shape [n] (it had [n, 1]) and the
    original fails to broadcast it; here it is unsqueezed. For Qwen2-MoE (block.qwen2_moe, as Hugging
    Face's Qwen2MoeSparseMoeBlock) the top-k weights are not renormalized and the gated shared expert
    is added."""
    F = paddle.nn.functional
    batch_size, seq_len, hidden_dim = hidden_states.shape
    hidden_states = hidden_states.reshape([-1, hidden_dim])
    router_logits = block.gate(hidden_states)
    with paddle.amp.auto_cast(False):
        routing_weights = F.softmax(router_logits.astype("float32"), axis=1)
    routing_weights, selected_experts = paddle.topk(routing_weights, block.top_k, axis=-1)
    if not getattr(block, "qwen2_moe", False):
        routing_weights /= routing_weights.sum(axis=-1, keepdim=True)
    routing_weights = routing_weights.astype(hidden_states.dtype)
    final_hidden_states = paddle.zeros([batch_size * seq_len, hidden_dim], dtype=hidden_states.dtype)
    expert_mask = F.one_hot(selected_experts, num_classes=block.num_experts).transpose([2, 1, 0])
    for expert_id in range(block.num_experts):
        expert_layer = block.experts[expert_id]
        idx, top_x = paddle.where(expert_mask[expert_id])
        if top_x.shape[0] == 0:
            continue
        current_state = paddle.gather(hidden_states, top_x.squeeze())
        current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx].reshape([-1, 1])
        top_x = top_x.squeeze()
        if top_x.shape == []:
            top_x = paddle.to_tensor([top_x.item()])
        final_hidden_states.index_add_(top_x, 0, current_hidden_states.astype(hidden_states.dtype))
    if getattr(block, "qwen2_moe", False):
        final_hidden_states = final_hidden_states + (F.sigmoid(block.shared_expert_gate(hidden_states))
                                                     * block.shared_expert(hidden_states))
    return final_hidden_states.reshape([batch_size, seq_len, hidden_dim]), router_logits


def runnable_moe_blocks(model) -> None:
    """PaddleNLP 2.8.1's Mixtral blocks runnable under Paddle 3.3.1 (see moe_block_forward)."""
    import types

    if not hasattr(model, "mixtral"):
        return
    for layer in model.mixtral.layers:
        if hasattr(layer, "block_sparse_moe"):
            layer.block_sparse_moe.forward = types.MethodType(moe_block_forward, layer.block_sparse_moe)


def make_qwen2_moe(model, shared_width: int) -> None:
    """PaddleNLP's Mixtral blocks with Qwen2-MoE's shared expert, its gate and unnormalized top-k weights."""
    for layer in model.mixtral.layers:
        block = layer.block_sparse_moe
        block.shared_expert = SharedExpert(block.hidden_dim, shared_width)
        block.shared_expert_gate = paddle.nn.Linear(block.hidden_dim, 1, bias_attr=False)
        block.qwen2_moe = True


def give_qkv_biases(model) -> None:
    """PaddleNLP's LLaMA (or Mixtral) attention with biases on q/k/v: Qwen2's attention (HF's
    Qwen2Attention is LlamaAttention with bias=True on q_proj, k_proj, v_proj)."""
    for layer in body(model).layers:
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attention, name)
            setattr(attention, name, paddle.nn.Linear(old.weight.shape[0], old.weight.shape[1]))


def scale_rotary_tables(model, scaling: dict) -> None:
    """Llama 3.1's rotary tables in PaddleNLP's LLaMA, written independently in numpy (Meta's apply_scaling)."""
    for layer in model.llama.layers:
        rotary = layer.self_attn.rotary_emb
        inv_freq = _meta_apply_scaling(rotary.inv_freq.numpy(), scaling)
        freqs = np.outer(np.arange(rotary.max_seq_len_cached, dtype=np.float32), inv_freq)
        angles = np.concatenate([freqs, freqs], axis=-1)
        rotary.cos_cached = paddle.to_tensor(np.cos(angles)[None, :, None, :].astype("float32"))
        rotary.sin_cached = paddle.to_tensor(np.sin(angles)[None, :, None, :].astype("float32"))


def _meta_apply_scaling(freqs: np.ndarray, scaling: dict) -> np.ndarray:
    """Meta's llama3 reference `apply_scaling` (llama/model.py), a loop over the frequencies."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs.astype(np.float64):
        wavelength = 2 * np.pi / freq
        if wavelength < old_context / high:
            out.append(freq)
        elif wavelength > old_context / low:
            out.append(freq / factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out, dtype=np.float32)


def reference_config_json(case: str, raw: dict) -> dict:
    """The config.json a checkpoint of this case carries in its family's format."""
    record = RECORD_CASES[case]
    if record.qkv_bias:  # Qwen2: the family's own config.json (PaddleNLP 3 / Hugging Face Qwen2ForCausalLM)
        return paddlenlp_config(record.config)
    if record.rope_scaling:  # as Llama 3.1's config.json
        return {**raw, "rope_scaling": dict(record.rope_scaling)}
    return raw


def reference_state(case: str, model) -> dict:
    """The reference's weights in its family's format: Qwen2's names for the LLaMA-with-biases reference."""
    state = model.state_dict()
    if RECORD_CASES[case].qkv_bias:
        tied = RECORD_CASES[case].config.tie_word_embeddings
        state = {to_qwen_names(name): value for name, value in state.items()
                 if not (tied and name == "lm_head.weight")}
    return state


def load_reference(case: str, directory: str):
    """The reference model from a directory in its family's format (PaddleNLP's from_pretrained where
    PaddleNLP 2.8.1 has the class; Qwen2's layout into the LLaMA-with-biases reference)."""
    record = RECORD_CASES[case]
    if not record.qkv_bias:
        model = paddlenlp_transformers.AutoModelForCausalLM.from_pretrained(directory)
        runnable_moe_blocks(model)
        model.eval()
        return model
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert (raw["model_type"], raw["architectures"]) in (("qwen2", ["Qwen2ForCausalLM"]),
                                                         ("qwen2_moe", ["Qwen2MoeForCausalLM"]))
    model = getattr(paddlenlp_transformers, record.class_name)(
        getattr(paddlenlp_transformers, record.config_class)(**record.kwargs))
    give_qkv_biases(model)
    runnable_moe_blocks(model)
    if record.config.shared_expert_intermediate_size:
        make_qwen2_moe(model, record.config.shared_expert_intermediate_size)
    state = {from_qwen_names(name): value
             for name, value in paddle.load(os.path.join(directory, "model_state.pdparams")).items()}
    if raw["tie_word_embeddings"]:
        assert "lm_head.weight" not in state
        state["lm_head.weight"] = paddle.to_tensor(state["llama.embed_tokens.weight"].numpy().T)
    missing, unexpected = model.set_state_dict(state)
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()
    return model


def save_reference(case: str, model, directory: str) -> None:
    """A checkpoint directory in the reference's format (PaddleNLP's save_pretrained, or Qwen2's layout)."""
    model.save_pretrained(directory)
    if RECORD_CASES[case].qkv_bias or RECORD_CASES[case].rope_scaling:
        paddle.save(reference_state(case, model), os.path.join(directory, "model_state.pdparams"))
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(reference_config_json(case, raw), f)


def randomize(model, seed: int) -> None:
    """Every parameter random: matrices ~ N(0, 1/fan_in) so that attention is peaked, embeddings
    ~ N(0, 0.25), norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, param in model.named_parameters():
            shape = list(param.shape)
            if len(shape) == 1:
                base = 1.0 if "norm" in name or name.split(".")[-2].startswith("ln") else 0.0
                value = base + 0.1 * rng.standard_normal(shape)
            elif any(key in name for key in ("embed", "wte", "wpe")):
                value = 0.25 * rng.standard_normal(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[0])
            param.set_value(value.astype("float32"))


def build_ours(config, state: dict):
    paddle.seed(0)
    model = CausalLM(config)
    load_full_weights(model, config, state, "converted PaddleNLP weights")
    model.eval()
    return model


def inputs(seed: int = 1):
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    labels = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return paddle.to_tensor(input_ids, dtype="int64"), paddle.to_tensor(labels, dtype="int64")


@paddle.no_grad()
def paddlenlp_outputs(model, input_ids, labels):
    logits = model(input_ids=input_ids, return_dict=True).logits
    loss = model(input_ids=input_ids, labels=labels, return_dict=True).loss
    return logits.numpy(), float(loss)


@paddle.no_grad()
def our_outputs(model, input_ids, labels):
    return model(input_ids).numpy(), float(model(input_ids, labels))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_loss_match_paddlenlp(case):
    reference, raw_config, config = build_paddlenlp_model(case)
    ours = build_ours(config, from_paddlenlp_state(config, raw_config, reference_state(case, reference)))
    input_ids, labels = inputs()
    ref_logits, ref_loss = paddlenlp_outputs(reference, input_ids, labels)
    logits, loss = our_outputs(ours, input_ids, labels)
    assert logits.shape == ref_logits.shape == (BATCH, SEQ, VOCAB)
    logit_diff, loss_diff = float(np.abs(logits - ref_logits).max()), abs(loss - ref_loss)
    print(f"\n{case}: max |logits diff| {logit_diff:.2e}, |loss diff| {loss_diff:.2e} (loss {ref_loss:.4f})")
    # The weights are far from a no-op: a wrong mapping would move the logits by O(1).
    assert np.abs(ref_logits).std() > 0.5
    assert logit_diff < TOLERANCE and loss_diff < TOLERANCE


def test_loss_conventions_match_on_the_same_pairs():
    """Our loss is PaddleNLP's on (input, label) pairs as given: no shift, -100 skipped, mean over the rest."""
    reference, raw_config, config = build_paddlenlp_model("llama_gqa")
    ours = build_ours(config, from_paddlenlp_state(config, raw_config, reference.state_dict()))
    input_ids, labels = inputs()
    logits, loss = our_outputs(ours, input_ids, labels)
    lab = labels.numpy()
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    mask = lab != -100
    expected = -np.take_along_axis(log_probs, np.where(mask, lab, 0)[..., None], -1)[..., 0][mask].mean()
    assert abs(loss - expected) < TOLERANCE
    assert abs(loss - paddlenlp_outputs(reference, input_ids, labels)[1]) < TOLERANCE


def test_baichuan2_norm_head_against_normalized_head():
    """NormHead = PaddleNLP's LLaMA(alibi) (Baichuan2-13B) with each vocab column of the head L2-normalized."""
    reference, raw_config, config = build_paddlenlp_model("baichuan13b_alibi", seed=3)
    config = config.replace(norm_head=True)
    state = from_paddlenlp_state(config, raw_config, reference.state_dict())
    ours = build_ours(config, state)
    head = reference.lm_head.weight.numpy()  # [hidden, vocab]
    assert np.abs(np.linalg.norm(head, axis=0) - 1).max() > 0.1  # the raw head is far from normalized
    with paddle.no_grad():
        reference.lm_head.weight.set_value(head / np.linalg.norm(head, axis=0, keepdims=True))
    input_ids, labels = inputs(seed=4)
    ref_logits, ref_loss = paddlenlp_outputs(reference, input_ids, labels)
    logits, loss = our_outputs(ours, input_ids, labels)
    logit_diff, loss_diff = float(np.abs(logits - ref_logits).max()), abs(loss - ref_loss)
    print(f"\nbaichuan2_norm_head: max |logits diff| {logit_diff:.2e}, |loss diff| {loss_diff:.2e}")
    assert logit_diff < TOLERANCE and loss_diff < TOLERANCE
    # and the head really is normalized in our model: the same weights without norm_head differ
    plain = build_ours(config.replace(norm_head=False), state)
    assert np.abs(our_outputs(plain, input_ids, labels)[0] - logits).max() > 0.1


@pytest.mark.parametrize("case", [family.export_case[0] for family in FAMILIES.values() if family.export_case])
def test_initial_weights_are_drawn_like_paddlenlp(case):
    """Each of our initial weight matrices has the spread PaddleNLP's own initialization gives it:
    N(0, initializer_range), the residual output projections (o_proj, down_proj) scaled by
    1/sqrt(2 * layers) in every family whose record says scaled_output_init (all but Bloom).
    Qwen2's reference is PaddleNLP's LLaMA initialization (Qwen2PretrainedModel._init_weights in
    PaddleNLP 3 is LLaMA's)."""
    class_name, config_name, kwargs, config = CASES[case]
    paddle.seed(0)
    reference = getattr(paddlenlp_transformers, class_name)(getattr(paddlenlp_transformers, config_name)(**kwargs))
    # the reference's matrices in our names (its own class's layout: no q/k/v biases, untied head)
    plain = (config.replace(qkv_bias=False, tie_word_embeddings=False, shared_expert_intermediate_size=0)
             if RECORD_CASES[case].qkv_bias else config)
    theirs = from_paddlenlp_state(plain, reference.config.to_dict(), reference.state_dict())
    model = CausalLM(config)
    init_weights(model, config, seed=0)
    ours = {name: param.numpy() for name, param in model.canonical_named_parameters()}
    scaled = []
    for name, value in theirs.items():
        value = value.numpy() if isinstance(value, paddle.Tensor) else np.asarray(value)
        if value.ndim != 2 or name not in ours:  # a tied head is the embedding
            continue
        expected_std = value.std()
        if case == "bloom" and expected_std == 0:
            # PaddleNLP 2.8.1's BloomPretrainedModel._init_weights zeroes the *weight* of every Linear
            # that has a bias (bloom/modeling.py: `layer.weight.set_value(paddle.zeros(...))` under
            # `if bias is not None`); Hugging Face's Bloom zeroes the bias. We draw the weight.
            expected_std = config.initializer_range
        assert ours[name].std() == pytest.approx(expected_std, rel=0.1), name
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            scaled.append(ours[name].std() / config.initializer_range)
    expected = 0.5 if get_family(config.family).scaled_output_init else 1.0  # 2 layers: 1/sqrt(4)
    assert scaled and np.allclose(scaled, expected, rtol=0.1), scaled


def test_llama31_rope_scaling_is_what_makes_the_difference():
    """The Llama 3.1 case matches only with the scaling: the same weights without it give other logits,
    and our frequencies are Meta's apply_scaling ones (here computed by the loop above)."""
    reference, raw_config, config = build_paddlenlp_model("llama31")
    state = from_paddlenlp_state(config, raw_config, reference_state("llama31", reference))
    input_ids, labels = inputs()
    scaled = our_outputs(build_ours(config, state), input_ids, labels)[0]
    plain = our_outputs(build_ours(config.replace(rope_scaling=None), state), input_ids, labels)[0]
    assert np.abs(scaled - plain).max() > 1e-2
    inv_freq = (1.0 / 500000.0 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)).astype(np.float32)
    np.testing.assert_allclose(llama3_scaled_inv_freq(inv_freq, config.rope_scaling),
                               _meta_apply_scaling(inv_freq, config.rope_scaling), rtol=1e-6)


def test_rms_norm_gradients_match_paddlenlp():
    """Our CPU RMSNorm writes its backward out (models/parallel_layers.py RMSNormCPU); its gradients for
    the input and the weight equal autograd's through PaddleNLP's LlamaRMSNorm (the forward is checked
    by the cases above; the parity tests cannot see a wrong gradient, both sides use the same one)."""
    from paddlenlp.transformers.llama.modeling import LlamaRMSNorm

    from models.parallel_layers import RMSNorm

    rng = np.random.default_rng(0)
    x_value = rng.standard_normal((2, 8, 64)).astype("float32")
    weight_value = (1.0 + 0.1 * rng.standard_normal(64)).astype("float32")
    upstream = paddle.to_tensor(rng.standard_normal((2, 8, 64)).astype("float32"))
    grads = []
    reference = LlamaRMSNorm(paddlenlp_transformers.LlamaConfig(hidden_size=64, rms_norm_eps=1e-6))
    for norm in (RMSNorm(64, 1e-6), reference):
        norm.weight.set_value(weight_value)
        x = paddle.to_tensor(x_value, stop_gradient=False)
        (norm(x) * upstream).sum().backward()
        grads.append((x.grad.numpy(), norm.weight.grad.numpy()))
    (ours_x, ours_w), (ref_x, ref_w) = grads
    assert np.abs(ref_x).max() > 0.1 and np.abs(ref_w).max() > 0.1
    np.testing.assert_allclose(ours_x, ref_x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours_w, ref_w, rtol=1e-5, atol=1e-5)
