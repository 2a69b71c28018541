"""The planner's estimate of an argument file: the preflight's own checks of the layout and model
(llm_pretrain/parallel/layout.py check_layout_and_model, as a run of nproc processes makes them), then
the memory and speed of the checked Setup (llm_pretrain/planner/__init__.py estimate_setup).

A separate module so that the planner package itself needs no model building: the preflight records
`estimate_setup` of every run, and this module runs the same checks as the preflight; neither imports
the trainer.
"""

from __future__ import annotations

import dataclasses

from llm_pretrain.arguments import Arguments
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.layout import build_model_config, check_layout_and_model, plan_layout, with_moe_options
from llm_pretrain.planner import check_device, device_kind, estimate_setup, setup_from


def validated_setup(args: Arguments, nproc: int, device: str):
    """(Setup, layout, config) after the preflight's checks (UsageError for an invalid layout)."""
    kind = device_kind(device)
    layout, config, _, _ = check_layout_and_model(args, nproc, kind)
    return setup_from(args, layout, config, kind), layout, config


def unchecked_setup(args: Arguments, nproc: int, device: str):
    """The Setup `validated_setup` builds, without the checks that refuse a layout (the preflight's
    plan_layout, build_model_config and with_moe_options only; UsageError when even those fail): what search
    needs for a floor of memory before it validates a layout."""
    kind = device_kind(device)
    layout = plan_layout(args, nproc)
    config, _, _ = build_model_config(args, layout, kind)
    return setup_from(args, layout, with_moe_options(args, config), kind)


def estimate(args: Arguments, nproc: int, device: str, cluster_options: dict | None = None,
             mean_document_length: int | None = None) -> dict:
    """Predicted per-rank peak memory and speed of `args` on `nproc` processes of `device`.

    device: "cpu" or a GPU name of llm_pretrain/observe/flops.py's table ("A100-80G", "H100-80G", ...). Raises the
    preflight's UsageError for a layout a run would refuse. Speed is predicted for GPUs only (None on CPU).
    mean_document_length: with reset_attention_mask, the packed documents' mean length (the attention FLOPs
    counted are those within documents); a UsageError without reset_attention_mask (nothing would be masked).
    """
    check_device(device)
    if mean_document_length is not None:
        if mean_document_length < 1:
            raise UsageError(f"--mean_document_length: must be >= 1, got {mean_document_length}")
        if not args.reset_attention_mask:
            raise UsageError("--mean_document_length: needs reset_attention_mask: true in the argument file (without "
                             "document masks every token attends to the whole sequence)")
    setup, layout, config = validated_setup(args, nproc, device)
    setup = dataclasses.replace(setup, mean_document_length=mean_document_length)
    result = estimate_setup(setup, device, cluster_options)
    result["mean_document_length"] = mean_document_length
    result["strategy"] = layout.strategy
    return result
