"""Lose a node, keep training (issue 38): the layout a job continues with on the ranks it has left.

`llm-plan elastic` (the planner's view before it happens, GPUs) and `elastic: true` (the preflight's
choice at start, llm_pretrain/planner/elastic.py continue_on), with the global batch kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity_utils import write_json
from test_planner import run_plan

# Llama-2-7B at sequence 512 on 40 GB cards, 2 per node: 8, 6 and 4 GPUs hold it, 2 do not (its AdamW
# states alone are 108 GB). Small enough to search in seconds.
SEVEN_B = {"model_name_or_path": "meta-llama/Llama-2-7b", "max_seq_length": 512, "per_device_train_batch_size": 1,
           "gradient_accumulation_steps": 1, "sharding": "stage3", "input_dir": "./data", "max_steps": 100}


def test_llm_plan_elastic_lists_each_node_lost_with_the_searchs_pick_and_the_smallest_count_that_fits(
        tmp_path, capsys):
    from llm_pretrain.arguments import Arguments
    from llm_pretrain.planner.search import search

    args_file = write_json(tmp_path / "seven_b.json", SEVEN_B)
    code, out, err = run_plan(capsys, "elastic", args_file, "--gpus", "8", "--gpus_per_node", "2", "--device",
                              "A100-40G", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert table["global_batch_size"] == 8  # 1 x 1 x 8 sharding replicas on the 8 GPUs
    assert [row["gpus"] for row in table["rows"]] == [8, 6, 4, 2]
    assert [row["nodes_lost"] for row in table["rows"]] == [0, 1, 2, 3]
    assert table["smallest_fitting"] == 4
    for row in table["rows"][:3]:
        best = row["best"]
        a = Arguments(**best["arguments"])
        layout_replicas = row["gpus"] // (max(a.tensor_parallel_degree, 1) * max(a.pipeline_parallel_degree, 1)
                                          * max(a.sep_parallel_degree, 1) * max(a.context_parallel_degree, 1))
        assert a.per_device_train_batch_size * a.gradient_accumulation_steps * layout_replicas == 8, best
        assert a.tensor_parallel_degree <= 2 and a.max_seq_length == 512  # tp inside a node
        assert best["peak_mem_reserved_mb"] <= 0.9 * 40 * 1024 and best["tokens_per_card_per_sec"] > 0
    # the row of 6 GPUs is the search's own first pick for 6 GPUs, same model, length and global batch
    first = search("meta-llama/Llama-2-7b", "A100-40G", 6, 512, 8, 2, top=1)["top"][0]
    assert table["rows"][1]["best"]["arguments"] == first["arguments"]
    assert table["rows"][3]["best"] is None and table["rows"][3]["why"] == "no valid layout fits in memory"

    code, out, _ = run_plan(capsys, "elastic", args_file, "--gpus", "8", "--gpus_per_node", "2", "--device",
                            "A100-40G")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("meta-llama/Llama-2-7b, sequence 512, global batch 8 on A100-40G")
    assert lines[-1].startswith("| 2 | 3 | no valid layout fits in memory; the smallest count that fits is 4 GPUs")
    assert lines[3].startswith(f"| 8 | 0 | {table['rows'][0]['best']['strategy']} |")


def test_elastic_keep_holds_the_pinned_key_in_every_row(tmp_path):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.planner.elastic import elastic_table

    args_file = write_json(tmp_path / "kept.json", {**SEVEN_B, "tensor_parallel_degree": 2, "sharding": "",
                                                      "elastic": True, "elastic_keep": ["tensor_parallel_degree"]})
    args, _ = parse_arguments([str(args_file)])
    table = elastic_table(args, "A100-40G", 8, 2, 0.10)
    assert table["kept"] == {"tensor_parallel_degree": 2} and table["global_batch_size"] == 4
    assert all(row["best"]["arguments"]["tensor_parallel_degree"] == 2 for row in table["rows"] if row["best"])
    assert any(row["best"] for row in table["rows"])


@pytest.mark.parametrize("argv, fragments", [
    (["--gpus", "12", "--gpus_per_node", "8"], ("--gpus: 12 is not a positive multiple of --gpus_per_node 8",)),
    (["--gpus", "8", "--device", "cpu"], ("--device: elastic needs a GPU",)),
])
def test_llm_plan_elastic_bad_input_is_one_line(tmp_path, capsys, argv, fragments):
    args_file = write_json(tmp_path / "seven_b.json", SEVEN_B)
    argv = argv if "--device" in argv else argv + ["--device", "A100-40G"]
    code, out, err = run_plan(capsys, "elastic", args_file, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert err.startswith("error: ") and all(f in err for f in fragments), err


# ----------------------------------------------------------------------------- the rule on the ranks present
def _args(**overrides):
    from llm_pretrain.arguments import Arguments

    base = {"model_name_or_path": "llama-tiny", "num_hidden_layers": 2, "max_seq_length": 32, "max_steps": 5,
            "input_dir": "./data", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            "elastic": True}
    return Arguments(**{**base, **overrides})


def test_continue_on_keeps_the_global_batch_and_the_degrees_that_still_fit():
    from llm_pretrain.planner.elastic import continue_on

    # dp2 x tp2 (global batch 2 x 2 x 2 = 8) on 2 ranks: tp2 still fits, dp 1: micro 2 x accumulation 4
    args, changes = continue_on(_args(tensor_parallel_degree=2), 2, 8, "cpu")
    assert (args.tensor_parallel_degree, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 2, 4)
    assert changes == {"gradient_accumulation_steps": [2, 4]}
    # on 3 ranks tp2 cannot form a layout: tp 1, dp 3 cannot split 8 samples; the nearest that can: 6 or 9
    with pytest.raises(Exception, match=r"^elastic: the global batch 8 cannot be split over the 3 ranks left "
                                        r"\(3 data replicas\); the nearest global batches they can split: 6 or 9$"):
        continue_on(_args(tensor_parallel_degree=2), 3, 8, "cpu")
    # a global batch of 12 on 3 ranks: tp 1, dp 3, micro 2 x accumulation 2
    args, changes = continue_on(_args(tensor_parallel_degree=2), 3, 12, "cpu")
    assert (args.tensor_parallel_degree, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 2, 2)
    assert changes["tensor_parallel_degree"] == [2, 1]
    # pinned: tensor_parallel_degree 2 on 3 ranks is one line naming the key
    with pytest.raises(Exception, match=r"^elastic_keep: tensor_parallel_degree 2 cannot be kept on 3 ranks"):
        continue_on(_args(tensor_parallel_degree=2, elastic_keep=["tensor_parallel_degree"]), 3, 12, "cpu")
    # a micro-batch that no longer divides the per-replica batch: the largest divisor below it
    args, _ = continue_on(_args(per_device_train_batch_size=4, gradient_accumulation_steps=1), 4, 12, "cpu")
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (3, 1)


def test_bad_elastic_keys_are_one_line():
    from llm_pretrain.arguments import validate_arguments
    from llm_pretrain.errors import UsageError

    with pytest.raises(UsageError, match=r"^elastic_keep: 'tensor_parallel' is not a key elastic changes; did you "
                                         r"mean 'tensor_parallel_degree'\?"):
        validate_arguments(_args(elastic_keep=["tensor_parallel"]))
    with pytest.raises(UsageError, match=r"^elastic_keep: set elastic true too"):
        validate_arguments(_args(elastic=False, elastic_keep=["sharding"]))
