"""The documents packed into a training window: where they start, and which predictions the loss skips.

Megatron's keys (megatron/training/utils.py get_ltor_masks_and_position_ids): with reset_attention_mask a
token attends only to earlier tokens of its own document; with reset_position_ids positions restart at 0
in each document; with eod_mask_loss the prediction made *from* an end-of-document token (the next
document's first token) has no loss (`loss_mask[data == eod_token] = 0`). Without eod_mask_loss that
prediction keeps its loss, as in Megatron: the eod token belongs to the document it ends (its attention
stays inside it), and what it predicts is the next document's first token.

A document starts where a document of the .idx file starts (the sample index, doc_idx and sample_idx,
already says where each window's pieces of documents begin: GPTDataset.document_pieces) and right after
every eod token (Megatron's rule, for files whose .idx documents hold several texts). The boundaries are
a function of the cached sample index and the window's tokens, so no separate array is cached: a cached
sample index cannot lack them or disagree with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def window_document_ids(piece_lengths, tokens: np.ndarray, eod_token_id: int | None) -> np.ndarray:
    """[len(tokens)] int64: the number of each token's document within the window (0, 0, 1, 1, 1, 2, ...).

    piece_lengths: the lengths of the .idx documents' pieces that make up the window, in order."""
    starts = np.zeros(len(tokens), dtype=bool)
    starts[np.cumsum(piece_lengths)[:-1]] = True  # the first token of every piece after the first
    if eod_token_id is not None:
        starts[1:] |= tokens[:-1] == eod_token_id
    return np.cumsum(starts, dtype=np.int64)


@dataclass(frozen=True)
class DocumentRule:
    """What the run does with document boundaries (from Arguments: reset_attention_mask,
    eod_mask_loss and the end-of-document token)."""

    document_masks: bool  # the model receives each input token's document id
    eod_token_id: int | None
    eod_mask_loss: bool

    @property
    def needed(self) -> bool:
        return self.document_masks or self.eod_mask_loss

    def window_ids(self, dataset, sample: int, tokens: np.ndarray) -> np.ndarray:
        return window_document_ids(dataset.document_pieces(sample), tokens, self.eod_token_id)

    def labels(self, inputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """labels with -100 (no loss) where the input token is eod, under eod_mask_loss."""
        if not self.eod_mask_loss:
            return labels
        return np.where(inputs == self.eod_token_id, -100, labels)


def eod_token_of(eod_token_id: int | None, tokenizer_path: str) -> int | None:
    """The end-of-document token: eod_token_id, else the tokenizer's end-of-text token (None: neither)."""
    if eod_token_id is not None:
        return eod_token_id
    import os

    if not os.path.exists(tokenizer_path):
        return None
    from llm_pretrain.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path).eos_token_id


def document_rule(args) -> DocumentRule | None:
    """The run's DocumentRule (None when it uses none of the document keys)."""
    if not (args.reset_attention_mask or args.eod_mask_loss):
        return None
    return DocumentRule(args.reset_attention_mask, eod_token_of(args.eod_token_id, args.tokenizer_path),
                        args.eod_mask_loss)
