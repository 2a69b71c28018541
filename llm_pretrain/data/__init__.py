"""Data: the mmap token format, GPT sample indices with a disk cache, blending, the embedded corpus.

    check_data_inputs(input_dir, split)                       cheap checks, UsageError naming the key
    build_pretraining_datasets(input_dir, split, seq_length, seed, num_samples, data_cache=None, skip_warmup=True)
        -> (train, valid, test), each None or a dataset: len(), dataset[i] -> int64[seq_length + 1]
    ensure_embedded_corpus(out_dir)                           the offline default corpus and tokenizer
    prepare_jsonl(inputs, tokenizer, output_prefix, ...)      JSON lines -> prefix.bin/.idx (scripts/prepare_data.py)
    IndexedDataset(prefix), IndexedWriter(prefix, dtype)      the mmap format itself
    tokenizer.load_tokenizer(path)                            local tokenizers, offline

May import: llm_pretrain.arguments, llm_pretrain.errors, models. Nothing else of llm_pretrain.
"""

from llm_pretrain.data.embedded import ensure_embedded_corpus
from llm_pretrain.data.indexed import IndexedDataset, IndexedWriter, best_fitting_dtype, write_documents
from llm_pretrain.data.inputs import check_data_inputs, parse_split, resolve_sources, split_document_ranges
from llm_pretrain.data.prepare import prepare_jsonl
from llm_pretrain.data.samples import BlendedDataset, GPTDataset, build_pretraining_datasets

__all__ = [
    "BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedWriter", "best_fitting_dtype",
    "build_pretraining_datasets", "check_data_inputs", "ensure_embedded_corpus", "parse_split",
    "prepare_jsonl", "resolve_sources", "split_document_ranges", "write_documents",
]
