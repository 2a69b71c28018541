"""The decoder as a fleet `PipelineLayer`: the same blocks as `CausalLM`, cut into stages.

    [Embeddings] [DecoderLayer 0] ... [DecoderLayer N-1] [FinalNorm] [LMHead]   loss: CausalLMLoss

fleet assigns the decoder layers evenly to pipeline_parallel_degree stages
(times virtual_pp_degree chunks for the interleaved schedule); the embedding
goes with the first chunk, the norm and head with the last. A head tied to
the word embedding is a `SharedLayerDesc`: the first and last stage each hold
a copy of the embedding, fleet keeps the copies equal by summing their
gradients.

Full recompute under the pipeline uses PipelineLayer's recompute_interval
(pp_recompute_interval consecutive decoder layers per recomputed segment), as
PaddleNLP does; "full_attn" and "core_attn" happen inside the decoder layer.
"""

from __future__ import annotations

import paddle.nn as nn
from paddle.distributed import fleet
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

from models import parallel_layers as pl
from models.config import ModelConfig
from models.decoder import DecoderLayer, Embeddings, LMHead, causal_lm_loss, output_logits

TIED_EMBEDDING = "tied_embedding"


class FinalNorm(nn.Layer):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = pl.norm(config, config.hidden_size)

    def forward(self, hidden):
        return self.norm(hidden)


class CausalLMLoss(nn.Layer):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config

    def forward(self, logits, labels):
        return causal_lm_loss(self.config, logits, labels)


def _tied_head(embeddings: Embeddings, hidden):
    return output_logits(embeddings.config, hidden, embeddings.word_embeddings.weight, tied=True)


class CausalLMPipeline(PipelineLayer):
    def __init__(self, config: ModelConfig, virtual_pp_degree: int = 1, pp_recompute_interval: int = 1):
        hcg = fleet.get_hybrid_communicate_group()
        tied = config.tie_word_embeddings
        if tied:
            first = SharedLayerDesc(TIED_EMBEDDING, Embeddings, shared_weight_attr="tied_weight", config=config)
            last = SharedLayerDesc(TIED_EMBEDDING, Embeddings, forward_func=_tied_head,
                                   shared_weight_attr="tied_weight", config=config)
        else:
            first, last = LayerDesc(Embeddings, config), LayerDesc(LMHead, config)
        descs = [first] + [LayerDesc(DecoderLayer, config, i) for i in range(config.num_hidden_layers)]
        descs += [LayerDesc(FinalNorm, config), last]
        full_recompute = config.recompute and config.recompute_granularity == "full"
        super().__init__(
            layers=descs,
            topology=hcg.topology(),
            loss_fn=CausalLMLoss(config),
            seg_method="layer:DecoderLayer",
            recompute_interval=pp_recompute_interval if full_recompute else 0,
            recompute_ctx={"mp_group": hcg.get_model_parallel_group(), "offload": False, "partition": False},
            num_virtual_pipeline_stages=virtual_pp_degree if virtual_pp_degree > 1 else None,
        )
        self.config = config
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

    def canonical_named_parameters(self):
        """(name in the single-process CausalLM, parameter) for the parameters of this stage.

        The last stage's copy of a tied embedding is listed too (it is initialized, trained and
        saved like the original); `is_replica` tells merging code to take the first stage's."""
        named = []
        for layer in self.sublayers():
            if isinstance(layer, Embeddings):
                prefix = "embeddings."
            elif isinstance(layer, DecoderLayer):
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
