"""Local tokenizers behind one small interface, fully offline.

    tok = load_tokenizer(path)
    tok.vocab_size, tok.eos_token_id, tok.encode(text) -> list[int], tok.decode(ids) -> str,
    tok.encode_batch(texts) -> list[list[int]]
    tok.encode_batch_flat(texts, num_threads, append_eos) -> (ids back to back, ids per text), NumPy

`path` is a directory or a file; in a directory the first of these wins:
  1. tokenizer.model, or the only *.model         sentencepiece
  2. tokenizer.json                               Hugging Face `tokenizers`
  3. vocab.json + merges.txt                      byte-level BPE (GPT-2 style)
encode() adds no special tokens (no BOS): the data preparation appends EOS itself.
The end-of-text token comes from the model (sentencepiece), or from eos_token in
tokenizer_config.json / special_tokens_map.json next to the files, or is the first
of EOS_CANDIDATES in the vocabulary; eos_token_id is None when there is none.
"""

from __future__ import annotations

import glob
import json
import os

from llm_pretrain.errors import UsageError

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
LOOKED_FOR = "tokenizer.model or *.model (sentencepiece), tokenizer.json, or vocab.json + merges.txt"


class SentencePieceTokenizer:
    def __init__(self, model_file: str):
        import sentencepiece as spm

        self.source = model_file
        self._sp = spm.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.eos_token_id = eos if eos >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def encode_batch_flat(self, texts: list[str], num_threads: int = -1, append_eos: bool = False):
        """(int32 ids of all texts back to back, ids per text), EOS after each text if append_eos.

        The data preparation's path. sentencepiece's batch call that returns one buffer of C ints a
        text (what its public encode(out_type="numpy") calls before making an array of each), joined
        in one copy: Python ints per id cost a fifth of the tokenizer's time, an array per text 5 %.
        A sentencepiece without that call takes the public list path. num_threads: sentencepiece's
        threads for the batch (-1: all cores; 1 when the caller runs one process per core).
        """
        import numpy as np

        texts = list(texts)
        batch = getattr(self._sp._processor, "_EncodeAsBufferBatch", None)  # sentencepiece 0.2.1+
        if batch is None:
            return flatten(self._sp.encode(texts, num_threads=num_threads), self.eos_token_id if append_eos else None)
        # Arguments as SentencePieceProcessor.Encode passes them (sentencepiece/__init__.py, is_batch):
        # input, num_threads, thread_pool, enable_sampling, nbest_size, alpha, add_bos, add_eos, reverse.
        buffers = batch(texts, num_threads, None, False, -1, 0.1, False, append_eos, False)
        sizes = np.fromiter(map(len, map(memoryview, buffers)), dtype=np.int64, count=len(buffers))
        return np.frombuffer(b"".join(buffers), dtype=np.int32), sizes

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from tokenizer.json, or built from vocab.json + merges.txt)."""

    def __init__(self, tokenizer, source: str):
        self.source = source
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = _configured_eos_token(os.path.dirname(source))
        candidates = ([eos] if eos else []) + list(EOS_CANDIDATES)
        ids = [tokenizer.token_to_id(token) for token in candidates]
        self.eos_token_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_batch_flat(self, texts: list[str], num_threads: int = -1, append_eos: bool = False):
        """As SentencePieceTokenizer's; threads are the library's own (TOKENIZERS_PARALLELISM): num_threads unused."""
        return flatten(self.encode_batch(texts), self.eos_token_id if append_eos else None)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def flatten(documents: list[list[int]], eos_id: int | None = None):
    """(int32 ids back to back, ids per document) of id lists, eos_id after each document unless None."""
    import itertools

    import numpy as np

    sizes = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
    ids = np.fromiter(itertools.chain.from_iterable(documents), dtype=np.int32, count=int(sizes.sum()))
    if eos_id is not None:
        ids = np.insert(ids, np.cumsum(sizes), eos_id)  # several at one place (empty documents) stay in order
        sizes += 1
    return ids, sizes


def _configured_eos_token(directory: str) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):  # {"content": "</s>", ...} in newer files
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def _find_files(path: str, key: str) -> tuple[str, list[str]]:
    """(kind, files) for a directory or a file; kind is 'sentencepiece', 'tokenizer.json' or 'bpe'."""
    if os.path.isfile(path):
        directory, name = os.path.split(path)
        if name.endswith(".model"):
            return "sentencepiece", [path]
        if name in ("vocab.json", "merges.txt"):
            vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
            if not (os.path.isfile(vocab) and os.path.isfile(merges)):
                raise UsageError(f"{key}: {path} needs both vocab.json and merges.txt in {directory or '.'}")
            return "bpe", [vocab, merges]
        if name.endswith(".json"):
            return "tokenizer.json", [path]
        raise UsageError(f"{key}: {path} is not a tokenizer file; expected {LOOKED_FOR}")
    if not os.path.isdir(path):
        raise UsageError(f"{key}: {path} does not exist; expected a local directory or file with {LOOKED_FOR}")
    sentencepiece = os.path.join(path, "tokenizer.model")
    if os.path.isfile(sentencepiece):
        return "sentencepiece", [sentencepiece]
    models = sorted(glob.glob(os.path.join(glob.escape(path), "*.model")))
    if len(models) > 1:
        names = ", ".join(os.path.basename(model) for model in models)
        raise UsageError(f"{key}: {path} holds several sentencepiece models ({names}); name one file directly")
    if models:
        return "sentencepiece", models
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "tokenizer.json", [os.path.join(path, "tokenizer.json")]
    vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return "bpe", [vocab, merges]
    raise UsageError(f"{key}: no tokenizer in {path}; looked for {LOOKED_FOR}")


def load_tokenizer(path: str, key: str = "tokenizer_name_or_path"):
    """A tokenizer from local files; UsageError('<key>: ...') naming what was looked for if none is usable."""
    if not path:
        raise UsageError(f"{key}: not set; give a local directory or file with {LOOKED_FOR}")
    path = str(path)
    kind, files = _find_files(path, key)
    try:
        if kind == "sentencepiece":
            return SentencePieceTokenizer(files[0])
        from tokenizers import Tokenizer
        from tokenizers.implementations import ByteLevelBPETokenizer

        if kind == "tokenizer.json":
            return HFTokenizer(Tokenizer.from_file(files[0]), files[0])
        return HFTokenizer(ByteLevelBPETokenizer(files[0], files[1]), files[0])
    except UsageError:
        raise
    except Exception as error:  # the libraries raise various types for corrupt files
        detail = " ".join(str(error).split())[:200] or type(error).__name__
        raise UsageError(f"{key}: cannot load {kind} tokenizer {', '.join(files)}: {detail}") from None
