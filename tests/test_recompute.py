"""Recompute really recomputes: the chosen part of a decoder layer runs again in the backward pass.

(The parity tests show that recompute leaves losses and weights unchanged; this shows it is on.)
"""

import dataclasses

import paddle
import pytest

from models.decoder import Attention, CausalLM, DecoderLayer
from models.registry import make_config
from models.weights import init_weights

PARTS = {"full": (DecoderLayer, "forward"), "full_attn": (DecoderLayer, "attention_block"),
         "core_attn": (Attention, "core_attention")}


@pytest.mark.parametrize("granularity", sorted(PARTS))
def test_recomputed_part_runs_twice_except_in_no_recompute_layers(granularity, monkeypatch):
    config = make_config("llama", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)
    config = dataclasses.replace(config, seq_length=16, recompute=True, recompute_granularity=granularity,
                                 no_recompute_layers=[1])
    paddle.seed(0)
    model = CausalLM(config)
    init_weights(model, config, seed=0)
    owner, method = PARTS[granularity]
    calls = []
    original = getattr(owner, method)

    def counted(self, *args, **kwargs):
        calls.append(self.layer_index)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, counted)
    tokens = paddle.randint(0, 64, [2, 16])
    loss = model(tokens, tokens)
    forward_calls = sorted(calls)
    loss.backward()
    assert forward_calls == [0, 1, 2]
    assert sorted(calls) == [0, 0, 1, 2, 2]  # layers 0 and 2 again in backward; layer 1 is excluded
