"""Argument files chosen by `plan.py search` are what search chooses today (planner only: no launch).

Each file's name tags the device it was searched for (`_a100` / `_h100` / `_h800`, llm_pretrain/planner/planned_files.py);
the file states the rest of the search (model, sequence length, global batch on 8 GPUs, or on the
number after the tag: `_a100x16`). The search is run
again with those arguments, and the file must be its first pick: same name (model part and strategy) and the
same text as `write_arguments` writes. After a planner change, `python scripts/planned_configs.py --write`
rewrites the files that differ (then update the files' mentions in docs/ and benchmarks/).
"""

from __future__ import annotations

import pytest

from launch_utils import REPO_ROOT
from llm_pretrain.planner.planned_files import planned_files, rerun, search_command

CONFIGS = REPO_ROOT / "configs"
PLANNED = planned_files(CONFIGS)


def test_planned_files_are_the_long_context_and_moe_presets():
    """Every configs/long_context/ file is planner-chosen (so none escapes the check below), and so are the
    mixture-of-experts files of real models (issue 23): Qwen1.5-MoE on 8 x A100-80G, and Mixtral-8x7B on 16
    (it fits no layout of 8: test_moe::test_planner_finds_no_layout_for_mixtral_8x7b_on_eight_a100)."""
    long_context = sorted((CONFIGS / "long_context").glob("*.json"))
    assert long_context and set(long_context) <= set(PLANNED)
    assert any(p.parent.name == "qwen2_moe" for p in PLANNED)
    assert [p.name.split("-")[1] for p in PLANNED if p.parent.name == "mixtral"] == ["mixtral_8x7b_a100x16"]
    # DeepSeek-V3 on the smallest H800-80G cluster that fits at 4K (issue 35 item 5; `--gpus 8-512` finds 256:
    # test_planner_search::test_smallest_h800_cluster_for_deepseek_v3_at_4k_is_the_planned_file)
    assert [p.name.split("-")[1] for p in PLANNED if p.parent.name == "deepseek_v3"] == ["deepseek_v3_h800x256"]


@pytest.mark.parametrize("path", PLANNED, ids=[p.name for p in PLANNED])
def test_file_is_the_first_pick_of_its_search(path):
    chosen = rerun(path)
    command = search_command(chosen["request"])
    picks = ", ".join(f"{p['strategy']} (recompute {p['arguments']['recompute_granularity'] if p['arguments']['recompute'] else 'none'}, "
                      f"micro-batch {p['arguments']['per_device_train_batch_size']}, "
                      f"{p['tokens_per_card_per_sec']:,.0f} tokens/card/s, {p['reserved_mb']:,.0f} MiB reserved)"
                      for p in chosen["picks"])
    hint = f"`{command}` picks: {picks or 'nothing fits'}; regenerate with `python scripts/planned_configs.py --write`"
    assert chosen["name"] == path.name, f"{path.name}: {hint}"
    with open(path, encoding="utf-8") as f:
        assert f.read() == chosen["text"], f"{path.name} differs from what write_arguments writes: {hint}"
