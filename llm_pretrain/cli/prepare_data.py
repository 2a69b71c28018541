"""Tokenize JSON-lines text into the mmap format (prefix.bin + prefix.idx) for pretraining.

(The `llm-prepare-data` command; `python scripts/prepare_data.py` runs the same.)

    llm-prepare-data --input corpus.jsonl [--input more.jsonl] --tokenizer TOKENIZER \
        --output_prefix data/my_text_document [--json_key text] [--workers 4] [--no_append_eos]

One document per line ({"text": "..."}); EOS is appended to each. Each text is cleaned as
PaddleNLP's create_pretraining_data.py does (runs of more than --max_repeated_len equal characters
cut to one, leading and trailing whitespace stripped, texts without tokens dropped), so the output
is byte-identical to that tool's; --keep_text_as_is tokenizes the texts unchanged. TOKENIZER is a local directory
or file: sentencepiece *.model, tokenizer.json, or vocab.json + merges.txt. The output is read by
PaddleNLP's MMapIndexedDataset as well; point input_dir at the output directory to train on it.
Bad input is reported as one line `error: ...` with exit code 2.
"""

import argparse
import sys

from llm_pretrain.errors import UsageArgumentParser, UsageError, exit_with_usage_error


def parse_args(argv):
    parser = UsageArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", required=True, help="JSON-lines file (repeat for several)")
    parser.add_argument("--tokenizer", required=True, help="local tokenizer directory or file")
    parser.add_argument("--output_prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    parser.add_argument("--json_key", default="text", help="key of the text in each line (default: text)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    parser.add_argument("--chunk_bytes", type=int, default=1 << 18,
                        help="bytes of whole lines per work item (default: 262144)")
    parser.add_argument("--no_append_eos", action="store_true", help="do not end each document with EOS")
    parser.add_argument("--keep_text_as_is", action="store_true",
                        help="no PaddleNLP cleaning: keep whitespace and repeated characters, keep empty texts")
    parser.add_argument("--max_repeated_len", type=int, default=100,
                        help="longer runs of one character become one character (PaddleNLP's rule; default: 100)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        from llm_pretrain.data.prepare import prepare_jsonl

        result = prepare_jsonl(args.input, args.tokenizer, args.output_prefix, json_key=args.json_key,
                               workers=args.workers, append_eos=not args.no_append_eos,
                               chunk_bytes=args.chunk_bytes, clean_text=not args.keep_text_as_is,
                               max_repeated_len=args.max_repeated_len)
    except UsageError as error:
        exit_with_usage_error(error)
    except KeyboardInterrupt:
        print("error: interrupted; no output written", file=sys.stderr)
        return 130
    print(f"{result['prefix']}.bin/.idx: {result['documents']} documents, {result['tokens']} tokens "
          f"({result['dtype']}, vocab {result['vocab_size']}) in {result['seconds']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
