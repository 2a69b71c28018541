"""The parameters of this toolkit's decoder, tensor by tensor, as each rank holds them.

`parameter_list` mirrors models/decoder.py (and models/parallel_layers.py for what tensor
parallelism splits): the same names, in the same registration order as
`CausalLM.named_parameters()` (the order Paddle's sharding optimizers assign parameters to
ranks in), with the full shape and the size on one tensor-parallel rank. `stage_parameters`
cuts the list into pipeline stages as models/pipeline.py's PipelineLayer does.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig


@dataclass(frozen=True)
class Param:
    name: str  # canonical name (as CausalLM.named_parameters())
    full_numel: int  # elements of the whole tensor
    numel: int  # elements on one tensor-parallel rank
    layer: int | None  # decoder layer index; None for the embedding, final norm and head
    part: str  # "embedding" | "layer" | "norm" | "head" | "mtp" (DeepSeek-V3's module, after the head)
    trainable: bool = True  # False: DeepSeek-V3's / ERNIE 4.5's router correction bias (moved by its rule, not the optimizer)

    def __hash__(self) -> int:
        """The fields' hash, computed once: memory.py's lru_caches hash tuples of a stage's parameters on every
        call (DeepSeek-V3: 20,000 and more), and search calls them for every candidate it estimates."""
        try:
            return self._hash
        except AttributeError:
            value = hash((self.name, self.full_numel, self.numel, self.layer, self.part, self.trainable))
            object.__setattr__(self, "_hash", value)
            return value


def _linear(prefix: str, n_in: int, n_out: int, bias: bool, tp: int, split: str | None, layer: int) -> list[Param]:
    """nn.Linear / fleet's Column/RowParallelLinear (parallel_layers.column_linear / row_linear):
    the weight [in, out] is split on out (column) or in (row); a column bias is split, a row bias is not."""
    weight = n_in * n_out
    out = [Param(prefix + ".weight", weight, weight // tp if split else weight, layer, "layer")]
    if bias:
        out.append(Param(prefix + ".bias", n_out, n_out // tp if split == "column" else n_out, layer, "layer"))
    return out


def _norm(prefix: str, config: ModelConfig, layer: int | None, part: str) -> list[Param]:
    """RMSNorm (weight) or LayerNorm (weight, bias), replicated (parallel_layers.norm)."""
    h = config.hidden_size
    names = ["weight"] if config.norm_type == "rmsnorm" else ["weight", "bias"]
    return [Param(f"{prefix}.{n}", h, h, layer, part) for n in names]


def parameter_list(config: ModelConfig, tp: int) -> list[Param]:
    h, v = config.hidden_size, config.vocab_size
    params = [Param("embeddings.word_embeddings.weight", v * h, v * h // tp, None, "embedding")]
    if config.position_embedding == "learned":
        n = config.max_position_embeddings * h
        params.append(Param("embeddings.position_embeddings.weight", n, n, None, "embedding"))
    if config.embedding_layernorm:
        params += _norm("embeddings.word_embeddings_layernorm", config, None, "embedding")
    for i in range(config.num_hidden_layers):
        params += layer_parameters(f"layers.{i}.", config, tp, i)
    params += _norm("norm", config, None, "norm")
    if not config.tie_word_embeddings:
        params.append(Param("lm_head.weight", h * v, h * v // tp, None, "head"))
    if config.num_nextn_predict_layers:  # DeepSeek-V3's MTP module (models/decoder.py MTPLayer), after the head
        n = config.num_hidden_layers
        mtp = [Param(f"mtp.{name}.weight", h, h, n, "mtp") for name in ("enorm", "hnorm")]
        mtp += _linear("mtp.eh_proj", 2 * h, h, False, tp, None, n)
        mtp += layer_parameters("mtp.block.", config, tp, n)
        mtp += _norm("mtp.norm", config, n, "layer")
        params += [Param(x.name, x.full_numel, x.numel, n, "mtp", x.trainable) for x in mtp]
    return params


def latent_attention_parameters(p: str, config: ModelConfig, layer: int) -> list[Param]:
    """models/mla.py LatentAttention (one process: every projection whole)."""
    h, heads = config.hidden_size, config.num_attention_heads
    q_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    out = _linear(p + "q_a_proj", h, config.q_lora_rank, False, 1, None, layer)
    out.append(Param(p + "q_a_layernorm.weight", config.q_lora_rank, config.q_lora_rank, layer, "layer"))
    out += _linear(p + "q_b_proj", config.q_lora_rank, heads * q_head, False, 1, None, layer)
    out += _linear(p + "kv_a_proj_with_mqa", h, config.kv_lora_rank + config.qk_rope_head_dim, False, 1, None, layer)
    out.append(Param(p + "kv_a_layernorm.weight", config.kv_lora_rank, config.kv_lora_rank, layer, "layer"))
    out += _linear(p + "kv_b_proj", config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim),
                   False, 1, None, layer)
    return out + _linear(p + "o_proj", heads * config.v_head_dim, h, False, 1, None, layer)


def layer_parameters(p: str, config: ModelConfig, tp: int, i: int) -> list[Param]:
    """One decoder layer (models/decoder.py DecoderLayer), `p` its name prefix."""
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
    qkv_bias = config.qkv_bias or config.linear_bias
    replicated_kv = config.num_key_value_heads < tp  # decoder.Attention: k/v projections replicated
    params = _norm(p + "input_layernorm", config, i, "layer")
    if config.uses_mla:
        params += latent_attention_parameters(p + "self_attn.", config, i)
    else:
        if config.fuse_attention_qkv:
            params += _linear(p + "self_attn.qkv_proj", h, q_size + 2 * kv_size, qkv_bias, tp, "column", i)
        else:
            params += _linear(p + "self_attn.q_proj", h, q_size, qkv_bias, tp, "column", i)
            kv_split = None if replicated_kv else "column"
            params += _linear(p + "self_attn.k_proj", h, kv_size, qkv_bias, tp, kv_split, i)
            params += _linear(p + "self_attn.v_proj", h, kv_size, qkv_bias, tp, kv_split, i)
        params += _linear(p + "self_attn.o_proj", q_size, h, config.linear_bias, tp, "row", i)
        if config.qk_norm:  # Qwen3: one [head_dim] RMSNorm weight each for q and k, replicated (pl.head_norm)
            params += [Param(p + f"self_attn.{n}_norm.weight", d, d, i, "layer") for n in "qk"]
    params += _norm(p + "post_attention_layernorm", config, i, "layer")
    if config.is_moe_layer(i):
        return params + moe_parameters(p + "mlp.", config, tp, i)
    if config.uses_swiglu:
        if config.fuse_attention_ffn:
            params += _linear(p + "mlp.gate_up_proj", h, 2 * f, config.linear_bias, tp, "column", i)
        else:
            params += _linear(p + "mlp.gate_proj", h, f, config.linear_bias, tp, "column", i)
            params += _linear(p + "mlp.up_proj", h, f, config.linear_bias, tp, "column", i)
    else:
        params += _linear(p + "mlp.up_proj", h, f, config.linear_bias, tp, "column", i)
    return params + _linear(p + "mlp.down_proj", f, h, config.linear_bias, tp, "row", i)


def moe_parameters(prefix: str, config: ModelConfig, tp: int, layer: int) -> list[Param]:
    """models/moe.py MoE on expert-parallel rank 0: the router, this rank's E/ep experts (SwiGLU, split like
    the dense MLP under tensor parallelism), the shared expert and its gate."""
    h, f = config.hidden_size, config.expert_intermediate_size
    out = []
    if config.has_correction_bias:  # models/deepseek_moe.py: the correction bias, registered first
        out.append(Param(prefix + "e_score_correction_bias", config.num_experts, config.num_experts, layer, "layer",
                         trainable=False))
    out += _linear(prefix + "gate", h, config.num_experts, False, tp, None, layer)

    def swiglu(name, width):
        return (_linear(f"{name}.gate_proj", h, width, False, tp, "column", layer)
                + _linear(f"{name}.up_proj", h, width, False, tp, "column", layer)
                + _linear(f"{name}.down_proj", width, h, False, tp, "row", layer))

    for e in range(config.num_experts // max(1, config.expert_parallel_degree)):
        out += swiglu(f"{prefix}experts.{e}", f)
    if config.shared_expert_intermediate_size:
        out += swiglu(f"{prefix}shared_expert", config.shared_expert_intermediate_size)
        if config.shared_expert_gate:
            out += _linear(prefix + "shared_expert_gate", h, 1, False, tp, None, layer)
    return out


def stage_layers(config: ModelConfig, pp: int, vpp: int, stage: int, layers_per_stage=None) -> list[int]:
    """Decoder layers on pipeline stage `stage`, as models/pipeline.py's PipelineLayer cuts them: chunk c of
    llm_pretrain.parallel.layout.pipeline_split (even, PaddleNLP's uniform fallback, or explicit) goes to stage c % pp."""
    return [layer for chunk in stage_chunks(config, pp, vpp, stage, layers_per_stage) for layer in chunk]


def stage_chunks(config: ModelConfig, pp: int, vpp: int, stage: int, layers_per_stage=None,
                 dualpipev: bool = False) -> list[list[int]]:
    """The decoder layers of each of this stage's chunks (one chunk without interleaving, two in DualPipeV's V)."""
    from llm_pretrain.parallel.layout import pipeline_split, stage_layer_indices

    split = pipeline_split(config.num_hidden_layers, pp, 2 if dualpipev else vpp, layers_per_stage)
    return stage_layer_indices(split, pp, stage, dualpipev)


def stage_parameters(config: ModelConfig, tp: int, pp: int, vpp: int, stage: int, layers_per_stage=None,
                     params: list[Param] | None = None) -> list[Param]:
    """This stage's parameters: its layers, the embedding on the first stage, norm and head on the last;
    a tied head is a second copy of the word embedding on the last stage (SharedLayerDesc). params: the
    model's `parameter_list(config, tp)` when the caller has it already (search builds it once per model)."""
    params = parameter_list(config, tp) if params is None else params
    if pp == 1:
        return params
    layers = set(stage_layers(config, pp, vpp, stage, layers_per_stage))
    first, last = stage == 0, stage == pp - 1
    out = [p for p in params if (p.part == "layer" and p.layer in layers) or (p.part == "embedding" and first)
           or (p.part in ("norm", "head") and last)]
    if last and config.tie_word_embeddings:
        out += [p for p in params if p.part == "embedding"]  # the tied copy (Embeddings built again)
    return out
