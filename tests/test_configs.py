"""Every argument file in configs/ parses, validates and fits its parallel layout, and is named after it.

File names are `configs/<family>/pretrain-<model>-<strategy>.json` with the strategy part
derived from the file's own degrees by llm_pretrain.parallel.layout.strategy_name. As in
PaddleNLP's table, a run uses 8 GPUs: a derived sharding degree (sharding set,
sharding_parallel_degree -1) is 8 / (tp x pp). A file whose explicit degrees need more
than 8 GPUs implies their product (16 for the two 13B pipeline files, i.e. two nodes).

Files name hub models (facebook/llama-7b, ...) that are not on this machine: their
tokenizer is not local, so the model keeps its own vocabulary; the tiny CPU files use
the embedded corpus under data/embedded/ (relative to the repository root).
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from llm_pretrain.arguments import parse_arguments, validate_arguments
from llm_pretrain.parallel.layout import check_model_fits_layout, check_strategy, plan_layout, strategy_name
from llm_pretrain.parallel.layout import PROVEN_DEGREES, build_model_config
from models.families import FAMILY_NAMES as FAMILIES
from models.registry import ARCHITECTURES

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS_PER_RUN = 8
FILES = sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "*", "*.json")))
NAME = re.compile(r"^pretrain-(?P<model>[a-z0-9_.]+)-(?P<strategy>[a-z0-9_]+)\.json$")


def _degree(value: int) -> int:
    return 1 if value == -1 else value


def world_size(args) -> int:
    """8 GPUs, or the product of the file's explicit degrees when that is more."""
    explicit = _degree(args.tensor_parallel_degree) * _degree(args.pipeline_parallel_degree)
    explicit *= _degree(args.sep_parallel_degree) * _degree(args.context_parallel_degree)
    if args.sharding:
        sharding = args.sharding_parallel_degree if args.sharding_parallel_degree != -1 else args.sharding_degree
        explicit *= _degree(sharding)
    return GPUS_PER_RUN if GPUS_PER_RUN % explicit == 0 else explicit


def test_there_are_files_for_every_family():
    families = {os.path.basename(os.path.dirname(f)) for f in FILES}
    # Families whose layouts are proven one by one and not under data parallelism have no
    # 8-GPU file: it would be data parallel, which llm_pretrain/parallel/layout.py refuses for them.
    data_parallel = {f for f in FAMILIES if "data_parallel_degree" in PROVEN_DEGREES.get(f, ("data_parallel_degree",))}
    assert families >= data_parallel
    for family in data_parallel:
        assert os.path.isfile(os.path.join(REPO_ROOT, "configs", family, f"pretrain-{family}_tiny-dp.json")) \
            or family == "llama"  # configs/llama/pretrain-llama_tiny-dp.json belongs to the CPU quick start


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(f, REPO_ROOT) for f in FILES])
def test_config_file(path, monkeypatch, embedded_corpus):
    monkeypatch.chdir(REPO_ROOT)  # tiny files use paths relative to the repository root
    overrides = []
    with open(path, encoding="utf-8") as f:
        tokenizer = json.load(f).get("tokenizer_name_or_path", "")
    if tokenizer.startswith("data/embedded"):
        # The tiny files name the embedded corpus's tokenizer, which quickstart builds; a missing
        # local tokenizer path is a startup error, so point at the one this test session built.
        overrides = ["--tokenizer_name_or_path", embedded_corpus["tokenizer"]]
    args, warnings = parse_arguments([path, *overrides])
    validate_arguments(args)
    assert all("has no effect" in w for w in warnings)  # only PaddleNLP keys we accept but do not act on
    assert args.model_name_or_path in ARCHITECTURES, "configs use built-in architectures"
    layout = plan_layout(args, world_size(args))
    config, weights_file, _ = build_model_config(args, layout, "cpu")
    assert weights_file is None
    check_model_fits_layout(config, layout)
    check_strategy(args, config, layout)

    name = os.path.basename(path)
    match = NAME.match(name)
    assert match, f"{name} is not pretrain-<model>-<strategy>.json"
    strategy = strategy_name(layout.tensor_parallel_degree, layout.pipeline_parallel_degree, layout.sharding_degree,
                             layout.sharding_stage, layout.virtual_pp_degree, None, layout.sep_parallel_degree,
                             layout.context_parallel_degree)
    assert match["strategy"] == strategy
    family = os.path.basename(os.path.dirname(path))
    # configs/industrial/ holds published layouts of any family (benchmarks/industrial_plans.md);
    # configs/long_context/ the layouts `scripts/plan.py search` chose for 32K-128K tokens (benchmarks/long_context.md)
    assert config.family == family or (family == "llama" and config.family == "baichuan") or \
        family in ("industrial", "long_context")


def test_tiny_files_run_on_cpu_with_the_embedded_corpus():
    for path in FILES:
        if "_tiny-" not in path:
            continue
        args, _ = parse_arguments([path])
        assert args.device == "cpu" and not (args.bf16 or args.fp16 or args.use_flash_attention)
        assert args.input_dir == "data/embedded/data" and args.tokenizer_name_or_path == "data/embedded/tokenizer"
        assert args.model_name_or_path.endswith("-tiny")


def test_table_files_keep_paddlenlp_recipes():
    """A few values straight from PaddleNLP 2.8's files (llm/llama, llm/baichuan, llm/qwen)."""
    def read(rel):
        return parse_arguments([os.path.join(REPO_ROOT, "configs", rel)])[0]

    llama7b = read("llama/pretrain-llama_7b-tp2sd4_stage2.json")
    assert (llama7b.per_device_train_batch_size, llama7b.gradient_accumulation_steps,
            llama7b.max_seq_length) == (2, 8, 2048)
    assert llama7b.bf16 and llama7b.use_flash_attention and llama7b.sharding == "stage2"
    baichuan13b = read("baichuan/pretrain-baichuan2_13b-sd8_stage2.json")
    assert baichuan13b.recompute and baichuan13b.warmup_steps == 1000 and baichuan13b.max_seq_length == 4096
    qwen_pp = read("qwen/pretrain-qwen_7b-pp4tp2sd1_stage1.json")
    assert (qwen_pp.pipeline_parallel_degree, qwen_pp.tensor_parallel_degree, qwen_pp.gradient_accumulation_steps) \
        == (4, 2, 16)
    llama_pp = read("llama/pretrain-llama_13b-pp4tp2sd2_stage1.json")
    assert llama_pp.sequence_parallel and llama_pp.fp16 and llama_pp.initializer_range == 0.002


def test_paddlenlp_files_that_2_8_1_runs_keep_their_values():
    """Files PaddleNLP 2.8.1 runs, with its values: Llama 3 / Qwen1.5 / Qwen2 / Qwen2.5 names, continue_training
    beyond the checkpoint's context (rotary tables extend), pipeline eval batches other than the micro-batch."""
    def read(rel):
        return parse_arguments([os.path.join(REPO_ROOT, "configs", rel)])[0]

    names = {rel: read(rel).model_name_or_path for rel in (
        "llama/pretrain-llama3_8b-tp2sd4_stage2.json", "qwen2/pretrain-qwen1.5_7b-tp2sd4_stage2.json",
        "qwen2/pretrain-qwen2_7b-tp2sd4_stage2.json", "qwen2/pretrain-qwen2_7b-sd8_stage2.json",
        "qwen2/pretrain-qwen2.5_0.5b-sd8_stage2.json")}
    assert sorted(names.values()) == sorted(["meta-llama/Meta-Llama-3-8B", "Qwen/Qwen1.5-7B", "Qwen/Qwen2-7B",
                                             "Qwen/Qwen2-7B", "Qwen/Qwen2.5-0.5B"])
    ziya = read("llama/pretrain-ziya_llama_13b-tp2sd4_stage2.json")
    assert ziya.continue_training and ziya.max_seq_length == 4096
    config, _, notes = build_model_config(ziya, plan_layout(ziya, 8), "cpu")
    assert config.max_position_embeddings == 2048 and any("extended" in note for note in notes)
    qwen_pp = read("qwen/pretrain-qwen_7b-pp4tp2sd1_stage1.json")
    assert (qwen_pp.per_device_eval_batch_size, qwen_pp.per_device_train_batch_size) == (16, 1)
    llama_pp = read("llama/pretrain-llama_13b-pp4tp2sd2_stage1.json")
    assert (llama_pp.per_device_eval_batch_size, llama_pp.per_device_train_batch_size) == (64, 2)
