"""Packed documents that do not attend across their boundaries (reset_attention_mask), positions that
restart in each document (reset_position_ids) and no loss on the end-of-document token's prediction
(eod_mask_loss): Megatron's keys.

The parity here is in one process, for every family: a packed batch with document ids gives, for every
token, the logits (so the per-token losses) of its document run on its own, and the gradient of the
summed per-token losses is the sum of the documents' gradients (within 1e-5, fp32).
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from models.decoder import CausalLM, document_positions
from models.registry import ARCHITECTURES
from models.weights import init_weights

FAMILIES = ["llama-tiny", "llama3-tiny", "baichuan-tiny", "qwen-tiny", "qwen2-tiny", "gpt3-tiny", "bloom-tiny",
            "mixtral-tiny", "qwen2-moe-tiny"]
SEQ = 24
# Two samples: three documents of 7, 10 and 7 tokens, and two of 5 and 19.
DOCUMENT_LENGTHS = [[7, 10, 7], [5, 19]]
TOLERANCE = 1e-5


def document_ids_of(lengths_per_sample) -> np.ndarray:
    return np.stack([np.repeat(np.arange(len(lengths)), lengths) for lengths in lengths_per_sample]).astype("int64")


def spans(lengths):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [(int(a), int(a + n)) for a, n in zip(starts, lengths)]


def tiny_model(name: str, **changes):
    config = ARCHITECTURES[name].replace(seq_length=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         **changes)
    paddle.seed(1)
    model = CausalLM(config)
    init_weights(model, config, seed=3)
    return model, config


def summed_token_losses(logits, labels):
    return F.cross_entropy(logits.astype("float32"), labels.unsqueeze(-1), reduction="none").sum()


def gradients(model) -> dict[str, np.ndarray]:
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    return grads


def packed_and_alone(name: str, **changes):
    """(packed logits, packed gradients, per-document logits, summed per-document gradients)."""
    model, config = tiny_model(name, **changes)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, config.vocab_size, size=(len(DOCUMENT_LENGTHS), SEQ + 1)).astype("int64")
    inputs, labels = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])
    logits = model(inputs, document_ids=paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS)))
    summed_token_losses(logits, labels).backward()
    packed_grads = gradients(model)
    alone_logits, alone_grads = np.zeros(logits.shape, "float32"), {}
    for sample, lengths in enumerate(DOCUMENT_LENGTHS):
        for start, end in spans(lengths):
            one = model(inputs[sample:sample + 1, start:end])
            alone_logits[sample, start:end] = one[0].numpy()
            summed_token_losses(one, labels[sample:sample + 1, start:end]).backward()
            for key, value in gradients(model).items():
                alone_grads[key] = alone_grads.get(key, 0) + value
    return logits.numpy(), packed_grads, alone_logits, alone_grads


def assert_close_gradients(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    worst = max(float(np.abs(got[k] - expected[k]).max()) for k in got)
    assert worst <= TOLERANCE, worst


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_compute_each_document_on_its_own(name):
    """Every family (rotary, ALiBi, learned positions; MoE): same logits per token, same gradients."""
    logits, grads, alone_logits, alone_grads = packed_and_alone(name, reset_position_ids=True)
    assert float(np.abs(logits - alone_logits).max()) <= TOLERANCE
    assert_close_gradients(grads, alone_grads)


def test_without_the_document_mask_later_documents_see_earlier_ones():
    """The mechanism: the same batch without document ids attends across the boundaries (the first
    document of each sample is still its own, the later ones are not)."""
    model, config = tiny_model("llama-tiny")
    tokens = paddle.to_tensor(np.random.default_rng(5).integers(0, config.vocab_size, (2, SEQ)).astype("int64"))
    masked = model(tokens, document_ids=paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS))).numpy()
    unmasked = model(tokens).numpy()
    assert np.abs(masked[0, :7] - unmasked[0, :7]).max() <= TOLERANCE  # the first document: nothing before it
    assert np.abs(masked[0, 7:] - unmasked[0, 7:]).max() > 1e-3
    assert np.abs(masked[1, 5:] - unmasked[1, 5:]).max() > 1e-3


def test_learned_positions_need_the_reset():
    """GPT-3's learned positions: without reset_position_ids a later document is seen at its offset in
    the sample, so its logits are not those of the document on its own; rotary (relative) are."""
    logits, _, alone_logits, _ = packed_and_alone("gpt3-tiny", reset_position_ids=False)
    assert np.abs(logits[0, :7] - alone_logits[0, :7]).max() <= TOLERANCE
    assert np.abs(logits[0, 7:] - alone_logits[0, 7:]).max() > 1e-3


def test_document_positions_restart_at_every_document():
    positions = document_positions(paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS))).numpy()
    assert positions[0].tolist() == list(range(7)) + list(range(10)) + list(range(7))
    assert positions[1].tolist() == list(range(5)) + list(range(19))
