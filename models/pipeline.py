"""The decoder as a fleet `PipelineLayer`: the same blocks as `CausalLM`, cut into stages.

    [Embeddings] [DecoderLayer 0] ... [DecoderLayer N-1] [FinalNorm] [LMHead]   loss: CausalLMLoss

fleet assigns the decoder layers evenly to pipeline_parallel_degree stages
(times virtual_pp_degree chunks for the interleaved schedule), or as many to each
chunk as `layers_per_chunk` says (uneven stages); the embedding goes with the
first chunk, the norm and head with the last. A head tied to
the word embedding is a `SharedLayerDesc`: the first and last stage each hold
a copy of the embedding, fleet keeps the copies equal by summing their
gradients.

Full recompute under the pipeline uses PipelineLayer's recompute_interval
(pp_recompute_interval consecutive decoder layers per recomputed segment), as
PaddleNLP does; "full_attn" and "core_attn" happen inside the decoder layer.

Mixture of experts: the load-balancing loss is taken over the layers concatenated (models/moe.py,
Hugging Face's / PaddleNLP's Mixtral form), E x sum_e f_e P_e with f_e and P_e counted over every layer,
so the gradient reaching one layer's router probabilities (coef x E x f_e / tokens) depends on the
routing of every other layer of the micro-batch, the later stages' too. It is not a sum of per-layer
losses, so Megatron-LM's MoEAuxLossAutoScaler (megatron/core/transformer/moe/moe_utils.py: each
layer's own aux loss attached to its hidden states, its gradient injected in backward) would give each
stage a gradient built from its own layers' f only. Instead each layer's router statistics ride
along the hidden states from stage to stage (`RouterCarry`: one row per layer, [L, E + 1] with
gradient and [L, E + 3] without), the last stage's loss takes them apart into the layers'
RouterStats and adds the same auxiliary losses as one process (decoder.add_router_losses), and
autograd sends d loss / d (router sums) back to each stage through fleet's p2p with the hidden
states' gradients (pipeline_parallel.py _backward_step: every output without stop_gradient). One
process keeps its list of RouterStats: the same values, the same sums.

DeepSeek-V3's multi-token prediction (MTP) runs on the last stage, after the last decoder layer, as PaddleFormers
0.4.1 pipelines it (paddleformers/transformers/deepseek_v2/modeling.py DeepseekV2EmbeddingPipe: the first stage
embeds the next tokens and concatenates them to the hidden states, [hidden; next embeddings] on the last axis;
DeepseekV2MTPLayerPipe splits them on the last stage): the first stage gets the labels beside the input ids
(llm_pretrain/run/trainer.py pipeline_data), embeds them with the one word embedding, and the embeddings ride with
the hidden states to `PipelineMTP` (every decoder layer splits them off and puts them back); their gradient
returns to the first stage's embedding through fleet's p2p like the hidden states'. The MTP block's hidden
states then ride beside the main ones ([hidden; MTP hidden]) through the final norm to the head, which gives both
logits; the loss adds the MTP loss as one process (models/decoder.py CausalLM.forward). The router carry has a row
for the MTP block's router (decoder layer num_hidden_layers), and a column for DeepSeek-V3's sequence-wise
balance loss.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

from models import parallel_layers as pl
from models.config import ModelConfig
from models.decoder import (DecoderLayer, Documents, Embeddings, LMHead, MTPLayer, add_router_losses, causal_lm_loss,
                            mtp_labels, output_logits)
from models.moe import MoE, RouterMetrics, RouterStats

TIED_EMBEDDING = "tied_embedding"


# ----------------------------------------------------------------------------- router statistics
class RouterCarry:
    """The router statistics of a micro-batch's layers so far, as the two tensors fleet's p2p sends
    between stages: `sums` [L, E + 1] (layer l's router probabilities summed over tokens, and its
    z-loss sum; with gradient) and `counts` [L, E + 3] (its picks per expert, pairs dropped, tokens, and the
    tokens the picks were counted over: more under global-batch balancing, models/moe.py global_batch_stats;
    no gradient). Row l is filled by decoder layer l, the others stay 0."""

    @staticmethod
    def start(config: ModelConfig):
        layers, experts = config.num_hidden_layers + config.num_nextn_predict_layers, config.num_experts
        sums = paddle.zeros([layers, experts + 2], dtype="float32")
        # `sums` has a gradient also when a chunk's layers are all dense (DeepSeek-V3's, ERNIE 4.5 MoE's first ones)
        # and leaves the carry untouched: fleet's p2p describes a stage's sends once, by its tensors without
        # stop_gradient (pp_utils/p2p_communication.py SendRecvMeta._obtain_send_message), and asserts every later
        # send matches, so under the interleaved schedule a stage's dense chunk and its MoE chunk must send alike
        # (in evaluation, without gradients, neither has one)
        sums.stop_gradient = not paddle.is_grad_enabled()
        return sums, paddle.zeros([layers, experts + 3], dtype="float32")

    @staticmethod
    def add(sums, counts, layer_index: int, stats: RouterStats):
        """Row layer_index of both from the layer's stats: x + 1 * row and 0 * row keep every value exact
        (in float32 also under O2 autocast, which would round counts above 256 to bfloat16)."""
        row = paddle.to_tensor(np.eye(sums.shape[0], dtype="float32")[:, layer_index:layer_index + 1])  # [L, 1]
        with paddle.amp.auto_cast(False):
            seq_balance = stats.seq_balance if stats.seq_balance is not None else paddle.zeros([])
            sums = sums + row * paddle.concat([stats.prob_sum, stats.z_sum.reshape([1]),
                                               seq_balance.reshape([1])]).astype("float32")
            counts = counts + row * paddle.concat([stats.picks.astype("float32"),
                                                   stats.dropped.astype("float32").reshape([1]),
                                                   paddle.full([1], stats.tokens, dtype="float32"),
                                                   paddle.full([1], stats.pick_tokens or stats.tokens, dtype="float32")])
        return sums, counts

    @staticmethod
    def stats(config: ModelConfig, sums, counts) -> list[RouterStats]:
        """Every MoE layer's RouterStats again (the single-process model's list, the MTP block's last), on the last
        stage."""
        experts = config.num_experts
        tokens = counts[:, experts + 1:].numpy().astype("int64")  # [L, 2]: tokens, pick tokens
        return [RouterStats(picks=counts[l, :experts], prob_sum=sums[l, :experts], z_sum=sums[l, experts],
                            dropped=counts[l, experts].astype("int64"), tokens=int(tokens[l, 0]),
                            pick_tokens=int(tokens[l, 1]), seq_balance=sums[l, experts + 1])
                for l in range(config.num_hidden_layers + config.num_nextn_predict_layers) if config.is_moe_layer(l)]


def split_carry(inputs):
    """(hidden states, the router carry riding along them or ())."""
    return (inputs[0], inputs[1:]) if isinstance(inputs, tuple) else (inputs, ())


# ----------------------------------------------------------------------------- packed documents
# With document masks the micro-batch's document ids [batch, seq] (int64, the one integer tensor of the
# tuple) travel from stage to stage right after the hidden states, as PaddleNLP 2.8.1 passes
# attention_mask and position_ids through its stages (paddlenlp/transformers/llama/modeling_pp.py:
# LlamaEmbeddingPipe / LlamaDecoderLayerPipe take and return (hidden_states, attention_mask,
# position_ids) via parse_args / return_args). Ids rather than the [batch, 1, seq, seq] mask: s x less to
# send; fleet's p2p sends them with stop_gradient (pp_utils/p2p_communication.py SendRecvMeta), so no
# gradient goes back for them. The final norm drops them (the head and the loss need none).
def split_documents(inputs):
    """(hidden states, document ids or None, the router carry or ())."""
    hidden, rest = split_carry(inputs)
    if rest and not paddle.is_floating_point(rest[0]):
        return hidden, rest[0], rest[1:]
    return hidden, None, rest


def join(hidden, document_ids, carry=()):
    """What a stage passes on: the hidden states alone, or the tuple (hidden, [document ids], *carry)."""
    extra = ((document_ids,) if document_ids is not None else ()) + tuple(carry)
    return (hidden, *extra) if extra else hidden


def split_next_embeddings(config: ModelConfig, hidden):
    """With MTP: ([hidden; next embeddings] on the last axis) -> (hidden, next embeddings); else (hidden, None)."""
    if not config.num_nextn_predict_layers:
        return hidden, None
    return tuple(paddle.split(hidden, 2, axis=-1))


def with_next_embeddings(hidden, next_embeddings):
    return hidden if next_embeddings is None else paddle.concat([hidden, next_embeddings], axis=-1)


class PipelineEmbeddings(Embeddings):
    """The first stage's embedding: input_ids, or (input_ids, document_ids) with document masks; with MTP the
    labels last (input_ids, [document_ids], labels), their embeddings joined to the hidden states."""

    def forward(self, inputs):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        labels = None
        if self.config.num_nextn_predict_layers:
            inputs, labels = inputs[:-1], inputs[-1]
        input_ids, document_ids = inputs if len(inputs) == 2 else (inputs[0], None)
        documents = Documents(self.config, document_ids) if document_ids is not None else None
        hidden = super().forward(input_ids, documents)
        if labels is not None:  # as CausalLM.mtp_logits (-100 read as token 0)
            hidden = with_next_embeddings(hidden, pl.split_sequence(self.config, self.word_embeddings(labels.clip(min=0))))
        return join(hidden, document_ids)


class PipelineDecoderLayer(DecoderLayer):
    """A decoder layer under the pipeline: hidden or (hidden, document ids) in and out. Each layer builds
    the documents' mask (and positions) from the ids again: a [batch, seq, seq] comparison, small beside the
    attention's own [batch, heads, seq, seq] scores."""

    def forward(self, inputs):
        hidden, document_ids, carry = split_documents(inputs)
        documents = Documents(self.config, document_ids) if document_ids is not None else None
        hidden, next_embeddings = split_next_embeddings(self.config, hidden)
        return join(with_next_embeddings(super().forward(hidden, documents), next_embeddings), document_ids, carry)


class MoEDecoderLayer(PipelineDecoderLayer):
    """A mixture-of-experts decoder layer under the pipeline: (hidden, [document ids], sums, counts) in and
    out, its router's statistics added to the carry (the first layer starts it)."""

    def forward(self, inputs):
        hidden, document_ids, carry = split_documents(inputs)
        sums, counts = carry or RouterCarry.start(self.config)
        hidden = split_carry(super().forward(join(hidden, document_ids)))[0]
        if isinstance(self.mlp, MoE):  # (DeepSeek-V3's first layers are dense)
            sums, counts = RouterCarry.add(sums, counts, self.layer_index, self.mlp.last_stats)
        return join(hidden, document_ids, (sums, counts))


class PipelineMTP(MTPLayer):
    """DeepSeek-V3's MTP module on the last stage, after the last decoder layer: ([hidden; next embeddings],
    [document ids], [router carry]) in, ([hidden; MTP hidden], [document ids], [carry]) out, its router's
    statistics in the carry's row num_hidden_layers (the MTP hidden states are normed: MTPLayer's own norm)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, config.num_hidden_layers)
        self.config = config

    def forward(self, inputs):
        hidden, document_ids, carry = split_documents(inputs)
        documents = Documents(self.config, document_ids) if document_ids is not None else None
        hidden, next_embeddings = split_next_embeddings(self.config, hidden)
        mtp_hidden = super().forward(hidden, next_embeddings, documents)
        if isinstance(self.block.mlp, MoE):
            carry = RouterCarry.add(*carry, self.config.num_hidden_layers, self.block.mlp.last_stats)
        return join(with_next_embeddings(hidden, mtp_hidden), document_ids, carry)


class FinalNorm(nn.Layer):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.norm = pl.norm(config, config.hidden_size)

    def forward(self, inputs):
        hidden, _, carry = split_documents(inputs)  # the document ids end here
        hidden, mtp_hidden = split_next_embeddings(self.config, hidden)  # (with MTP: its hidden states, normed)
        hidden = with_next_embeddings(self.norm(hidden), mtp_hidden)
        return (hidden, *carry) if carry else hidden


class PipelineLMHead(LMHead):
    """The output head, passing the router carry on to the loss."""

    def forward(self, inputs):
        hidden, carry = split_carry(inputs)
        logits = both_heads(self.config, hidden, super().forward)
        return (*logits, *carry) if carry or len(logits) > 1 else logits[0]


def both_heads(config: ModelConfig, hidden, head) -> tuple:
    """(logits,), or with MTP (logits, MTP logits) of [hidden; MTP hidden]: the one head for both."""
    hidden, mtp_hidden = split_next_embeddings(config, hidden)
    return (head(hidden),) if mtp_hidden is None else (head(hidden), head(mtp_hidden))


class CausalLMLoss(nn.Layer):
    """The language-model loss on the last stage; with experts, plus the routers' auxiliary losses over
    every stage's layers (the carry), their statistics of a training forward kept for train_log.jsonl."""

    def __init__(self, config: ModelConfig, router_metrics: RouterMetrics | None = None):
        super().__init__()
        self.config = config
        self.router_metrics = router_metrics

    def forward(self, outputs, labels):
        logits, carry = split_carry(outputs)
        loss = causal_lm_loss(self.config, logits, labels)
        if self.config.num_nextn_predict_layers:  # as CausalLM.forward
            mtp_logits, carry = carry[0], carry[1:]
            mtp_loss = causal_lm_loss(self.config, mtp_logits, mtp_labels(labels))
            if self.training and self.router_metrics is not None:
                self.router_metrics.add_mtp(mtp_loss)
            loss = loss + self.config.mtp_loss_weight * mtp_loss
        if not carry:
            return loss
        metrics = self.router_metrics if self.training else None
        return add_router_losses(self.config, loss, RouterCarry.stats(self.config, *carry), metrics)


def _tied_head(embeddings: Embeddings, inputs):
    hidden, carry = split_carry(inputs)
    logits = both_heads(embeddings.config, hidden, lambda h: output_logits(
        embeddings.config, h, embeddings.word_embeddings.weight, tied=True))
    return (*logits, *carry) if carry or len(logits) > 1 else logits[0]


class ChunkBoundaries(str):
    """An explicit segmentation in the form fleet's PipelineLayer accepts under interleaving: there
    seg_method must be a "layer:" string (pp_layers.py:432-437), and SegmentLayers' "layer:" method needs
    the layers to divide evenly (pp_layers.py:218). The string keeps that form; `parts` holds the first
    layer description of every chunk (and the end), read by `_segment_network_for_interleave` below."""

    def __new__(cls, parts: list[int]):
        boundaries = super().__new__(cls, "layer:DecoderLayer")
        boundaries.parts = list(parts)
        return boundaries


def chunk_boundaries(layers_per_chunk: list[int], num_descs: int) -> list[int]:
    """Layer-description indices where each chunk starts (and the end): the embedding (description 0)
    joins chunk 0, the final norm and head the last chunk."""
    starts = [1 + sum(layers_per_chunk[:c]) for c in range(1, len(layers_per_chunk))]
    return [0] + starts + [num_descs]


class CausalLMPipeline(PipelineLayer):
    def __init__(self, config: ModelConfig, virtual_pp_degree: int = 1, pp_recompute_interval: int = 1,
                 layers_per_chunk: list[int] | None = None, use_dualpipev: bool = False):
        """layers_per_chunk: decoder layers of each chunk in fleet's order (stage s holds chunks s, s + pp, ...;
        under DualPipeV's V, 2 x pp chunks: stage s holds chunks s and 2 pp - 1 - s)."""
        hcg = fleet.get_hybrid_communicate_group()
        tied = config.tie_word_embeddings
        if tied:
            first = SharedLayerDesc(TIED_EMBEDDING, PipelineEmbeddings, shared_weight_attr="tied_weight", config=config)
            last = SharedLayerDesc(TIED_EMBEDDING, PipelineEmbeddings, forward_func=_tied_head,
                                   shared_weight_attr="tied_weight", config=config)
        else:
            first, last = LayerDesc(PipelineEmbeddings, config), LayerDesc(PipelineLMHead, config)
        decoder_layer = MoEDecoderLayer if config.is_moe else PipelineDecoderLayer
        descs = [first] + [LayerDesc(decoder_layer, config, i) for i in range(config.num_hidden_layers)]
        descs += [LayerDesc(PipelineMTP, config)] if config.num_nextn_predict_layers else []
        descs += [LayerDesc(FinalNorm, config), last]
        full_recompute = config.recompute and config.recompute_granularity == "full"
        seg_method = "layer:DecoderLayer"  # even: fleet's own segmentation
        if layers_per_chunk is not None and len(set(layers_per_chunk)) > 1:
            parts = chunk_boundaries(layers_per_chunk, len(descs))
            # 1F1B takes a list of boundaries (SegmentLayers.do_segment, pp_layers.py:176-195)
            seg_method = ChunkBoundaries(parts) if virtual_pp_degree > 1 else parts
        # Filled on the last stage (by the loss); MetricsLogger gathers it over the stages at logging steps.
        router_metrics = RouterMetrics(config) if config.is_moe else None
        loss = CausalLMLoss(config, router_metrics)
        super().__init__(
            layers=descs,
            topology=hcg.topology(),
            loss_fn=loss,
            seg_method=seg_method,
            recompute_interval=pp_recompute_interval if full_recompute else 0,
            recompute_ctx={"mp_group": hcg.get_model_parallel_group(), "offload": False, "partition": False},
            num_virtual_pipeline_stages=virtual_pp_degree if virtual_pp_degree > 1 else None,
            use_dualpipev=use_dualpipev,
        )
        self.config = config
        self.router_metrics = router_metrics
        # A sublayer, so that train() / eval() reach it (fleet keeps loss_fn in a plain list).
        self.causal_lm_loss = loss
        self.is_first_stage = hcg.get_stage_id() == 0
        if tied and not self.is_first_stage and TIED_EMBEDDING in self.shared_layers:
            # The last stage's copy of the tied embedding (middle stages hold none) is a replica:
            # fleet's global-norm clip must count its gradient once (PipelineLayer's own marking
            # compares parameter names with the attribute name and never matches).
            copy = self.shared_layers[TIED_EMBEDDING]
            # That copy only computes the output head: the learned positions (GPT-3) and the
            # embedding LayerNorm (Bloom) would never run or train there, and would stay stale
            # copies of the first stage's (tests/parity_utils.assert_every_replica_matches).
            for unused in ("position_embeddings", "word_embeddings_layernorm"):
                if hasattr(copy, unused):
                    delattr(copy, unused)
            for param in copy.parameters():
                param.is_firstly_shared = False

    def update_router_biases(self) -> None:
        """After an optimizer step: DeepSeek-V3's bias update in this stage's MoE layers (and the MTP block's on the
        last stage), as CausalLM.update_router_biases (rate 0: off)."""
        if not self.config.moe_bias_update_rate:
            return
        for layer in self.sublayers():
            if hasattr(layer, "update_correction_bias"):
                layer.update_correction_bias(self.config.moe_bias_update_rate)

    def _segment_network_for_interleave(self, seg_method):
        if not isinstance(seg_method, ChunkBoundaries):
            return super()._segment_network_for_interleave(seg_method)
        # As fleet's own (pp_layers.py:813-842), from the given boundaries: chunk
        # stage_id + v * num_stages is this stage's virtual stage v.
        self.segment_parts = seg_method.parts
        for chunk in range(self._stage_id, self._total_stages_with_virtual_stages, self._num_stages):
            self._start_poss.append(self.segment_parts[chunk])
            self._end_poss.append(self.segment_parts[chunk + 1])

    def canonical_named_parameters(self):
        """(name in the single-process CausalLM, parameter) for the parameters of this stage.

        The last stage's copy of a tied embedding is listed too (it is initialized, trained and
        saved like the original); `is_replica` tells merging code to take the first stage's."""
        named = []
        for layer in self.sublayers():
            if isinstance(layer, Embeddings):
                prefix = "embeddings."
            elif isinstance(layer, MTPLayer):  # (its block, a DecoderLayer, is named under it)
                prefix = "mtp."
            elif isinstance(layer, DecoderLayer) and layer.layer_index < self.config.num_hidden_layers:
                prefix = f"layers.{layer.layer_index}."
            elif isinstance(layer, FinalNorm):
                prefix = ""
            elif isinstance(layer, LMHead):
                prefix = "lm_head."
            else:
                continue
            named += [(prefix + name, param) for name, param in layer.named_parameters()]
        return named


def is_replica(param) -> bool:
    """A pipeline stage's copy of a weight owned by another stage (the tied embedding)."""
    return getattr(param, "is_firstly_shared", True) is False
