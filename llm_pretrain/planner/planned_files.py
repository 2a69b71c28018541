"""Argument files in configs/ that `plan.py search` chose: the search each one states, and its rerun.

A planner-chosen file names the GPU it was searched for at the end of its model part, and only such files do:
`pretrain-<model>_<device tag>[x<gpus>]-<strategy>.json`, the tag one of DEVICE_TAGS (`..._128k_a100-tp8.json`),
followed by the number of GPUs when it is not GPUS_PER_RUN (`mixtral_8x7b_a100x16-...`: 16 GPUs).
That tag is the one record of the device and the GPU count. The file itself states the rest of the search: the
model (`model_name_or_path`), the sequence length (`max_seq_length`) and the global batch (micro-batch x
accumulation x data replicas of its layout on those GPUs). Search's other options are its defaults
(8 GPUs per node, DEFAULT_HEADROOM, the device's default link speeds).

`rerun(path)` searches again with those arguments and returns search's first pick as the file it would be:
its name (the file's model part, the pick's strategy) and the text `write_arguments` writes.
`tests/test_planned_configs.py` checks every such file against it; `scripts/planned_configs.py --write`
rewrites the files that differ.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from llm_pretrain.arguments import parse_arguments
from llm_pretrain.planner.estimate import validated_setup
from llm_pretrain.planner.search import file_strategy_name, search, write_arguments

DEVICE_TAGS = {"a100": "A100-80G", "h100": "H100-80G", "h800": "H800-80G"}
GPUS_PER_RUN = 8  # configs/README.md: as in PaddleNLP's table, a run uses 8 GPUs
PLANNED_NAME = re.compile(r"^pretrain-(?P<model>[a-z0-9_.]+_(?P<tag>" + "|".join(DEVICE_TAGS) +
                          r")(?:x(?P<gpus>[0-9]+))?)-(?P<strategy>[a-z0-9_]+)\.json$")


def planned_device(path) -> str | None:
    """The device a file was searched for (its name's tag), None for a file the planner did not choose."""
    match = PLANNED_NAME.match(os.path.basename(str(path)))
    return DEVICE_TAGS[match["tag"]] if match else None


def planned_gpus(path) -> int:
    """The number of GPUs a planner-chosen file was searched for (its name's `x<gpus>`, else GPUS_PER_RUN)."""
    match = PLANNED_NAME.match(os.path.basename(str(path)))
    return int(match["gpus"]) if match and match["gpus"] else GPUS_PER_RUN


def planned_files(configs_dir) -> list[Path]:
    """Every planner-chosen file under configs/<directory>/."""
    return sorted(p for p in Path(configs_dir).glob("*/*.json") if planned_device(p))


def search_request(path) -> dict:
    """The arguments of `search` that the file states: model, device, gpus, seq, global batch."""
    device, gpus = planned_device(path), planned_gpus(path)
    args, _ = parse_arguments([str(path)])
    _, layout, _ = validated_setup(args, gpus, device)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * layout.data_replicas
    return {"model": args.model_name_or_path, "device": device, "gpus": gpus,
            "seq": args.max_seq_length, "global_batch_size": global_batch}


def rerun(path, top: int = 3) -> dict:
    """Search again with the file's request. Returns the request, search's `top` picks (strategy, tokens/card/s,
    reserved MiB), and the first pick as a file: `name` (the file's model part, the pick's strategy) and `text`
    (what write_arguments writes); name and text are None when nothing fits."""
    request = search_request(path)
    result = search(request["model"], request["device"], request["gpus"], request["seq"],
                    request["global_batch_size"], top=top)
    picks = [{"strategy": r["strategy"], "tokens_per_card_per_sec": r["tokens_per_card_per_sec"],
              "reserved_mb": r["peak_mem_reserved_mb"], "arguments": r["arguments"]} for r in result["top"]]
    name = text = None
    if picks:
        best = picks[0]["arguments"]
        name = f"pretrain-{PLANNED_NAME.match(os.path.basename(str(path)))['model']}-{file_strategy_name(best)}.json"
        with tempfile.TemporaryDirectory() as tmp:
            with open(write_arguments(best, os.path.join(tmp, name)), encoding="utf-8") as f:
                text = f.read()
    return {"request": request, "picks": picks, "name": name, "text": text}


def search_command(request: dict) -> str:
    return (f"python scripts/plan.py search --model {request['model']} --device {request['device']} "
            f"--gpus {request['gpus']} --seq {request['seq']} --global_batch_size {request['global_batch_size']}")
