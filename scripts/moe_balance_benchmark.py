"""DeepSeek-V3's auxiliary-loss-free balancing on CPU: the expert load per MoE layer and the loss, bias rule on and off.

    PYTHONPATH=$PWD nice -n 19 python scripts/moe_balance_benchmark.py [--steps 200 --logging-steps 5 --out benchmarks/]

Trains the deepseek_v3 tiny preset (ARGS_FILE: deepseek-v3-tiny, one dense layer then one MoE layer of 8
experts in 4 groups, top 2 of 2 groups, a shared expert, the MTP block with its own router; the sequence-wise
balance loss at its default weight) on the embedded corpus twice, one run after the other in one process, with
the same seed, weights and samples: moe_bias_update_rate at the preset's value (the DeepSeek-V3 report's
bias update speed 0.001, sec. 4.2) and at 0 (no bias update). Evaluation and checkpoints are off.
Load = train_log.jsonl's `expert_load_max_mean` (models/moe.py RouterMetrics): per router, the picks of the most
picked expert over the mean picks, counted over each logging window of --logging-steps steps (1: balanced,
E / k = 4 here: every token on the same 2 experts). Writes OUT/moe_balance.json (every window of both runs),
OUT/moe_balance.md (the table, the chart, the machine, the command and the date) and OUT/moe_balance.png
(matplotlib; without it, a text chart in the markdown). A "## Findings" section of an existing file is kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARGS_FILE = REPO / "configs" / "deepseek_v3" / "pretrain-deepseek_v3_tiny-dp.json"
KEY = "expert_load_max_mean"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--logging-steps", type=int, default=5, help="steps per load window")
    parser.add_argument("--out", default=str(REPO / "benchmarks"))
    options = parser.parse_args(argv)
    if options.logging_steps < 1:
        fail(f"--logging-steps {options.logging_steps}: must be at least 1")
    if options.steps < 3 * options.logging_steps or options.steps % options.logging_steps:
        fail(f"--steps {options.steps}: must be a multiple of --logging-steps ({options.logging_steps}) with at "
             "least 3 windows (start, middle, end)")
    return options


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def preset() -> dict:
    with open(ARGS_FILE, encoding="utf-8") as f:
        return json.load(f)


def router_names(model: str) -> list[str]:
    """One name per row of expert_load_max_mean: the MoE decoder layers, then the MTP block's router."""
    from models.registry import ARCHITECTURES

    config = ARCHITECTURES[model]
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    return [f"layer {i}" if i < config.num_hidden_layers else f"MTP block {i - config.num_hidden_layers}"
            for i in range(layers) if config.is_moe_layer(i)]


def train(steps: int, logging_steps: int, rate: float, work: Path) -> dict[str, list[dict]]:
    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.selfcheck.parity import argv, run_single, train_records

    corpus = ensure_embedded_corpus(str(work / "corpus"))
    common = dict(tokenizer_name_or_path=corpus["tokenizer"], input_dir=corpus["input_dir"],
                  data_cache=str(work / "cache"), max_steps=steps, logging_steps=logging_steps, save_steps=0,
                  do_eval=False)
    rates = {"on": rate, "off": 0.0}
    run_single([argv(ARGS_FILE, work / name, **common, moe_bias_update_rate=r) for name, r in rates.items()],
               work, "balance", timeout=4 * 3600)
    return {name: [{"step": r["step"], "loss": r["loss"], "mtp_loss": r.get("mtp_loss"), KEY: r[KEY]}
                   for r in train_records(work / name)] for name in rates}


def windows(records: list[dict]) -> dict[str, dict]:
    """The first, middle and last logging windows."""
    return {"start": records[0], "middle": records[(len(records) - 1) // 2], "end": records[-1]}


def second_half_mean(records: list[dict], router: int) -> float:
    half = records[len(records) // 2:]
    return sum(r[KEY][router] for r in half) / len(half)


def render_markdown(result: dict, chart: str | None) -> str:
    """The table (per router and run: max/mean at the start, middle and end, the mean over the second half),
    the final losses, a sentence comparing the runs, and the chart (a PNG's name, or None: a text chart)."""
    runs, names, rate = result["runs"], result["routers"], result["rate"]
    label = {"on": f"bias rule on (rate {rate:g})", "off": "bias rule off (rate 0)"}
    env, logging_steps = result["environment"], result["logging_steps"]
    points = windows(runs["on"])
    span = {k: f"steps {r['step'] - logging_steps + 1}-{r['step']}" for k, r in points.items()}
    lines = [
        "# DeepSeek-V3's auxiliary-loss-free balancing on CPU: expert load with the bias rule on and off", "",
        f"`{result['command']}`, {result['time']}, on {env['cpu_model']} ({env['cpu_count']} cores, shared with "
        f"other jobs), Paddle {env['paddle_version']}, Python {env['python']}. Raw series: `moe_balance.json`.", "",
        f"`{os.path.relpath(ARGS_FILE, REPO)}` ({result['model']}: {result['experts']} routed experts, top "
        f"{result['top_k']}, one dense layer then MoE layers, the MTP block's router; batch "
        f"{result['batch']} x {result['seq']} tokens) trained twice for {result['steps']} steps with the same seed, "
        f"weights and samples, `moe_bias_update_rate` {rate:g} (the preset's, the DeepSeek-V3 report's bias update "
        f"speed) and 0. Load = `{KEY}` of train_log.jsonl: the most picked expert's picks / the mean picks of "
        f"the router over a window of {logging_steps} steps (1 = balanced, {result['experts'] / result['top_k']:g} = "
        "every token on the same experts).", "",
        f"| router | run | max/mean {span['start']} | {span['middle']} | {span['end']} | mean over the second half |",
        "|---|---|---|---|---|---|",
    ]
    for i, name in enumerate(names):
        for run in ("on", "off"):
            w = windows(runs[run])
            lines.append(f"| {name} | {label[run]} | " + " | ".join(f"{w[k][KEY][i]:.3f}" for k in w)
                         + f" | {second_half_mean(runs[run], i):.3f} |")
    lines += ["", "Loss: train_log.jsonl's, the logging step's batch.", "",
              "| run | final loss | final MTP loss | mean loss over the second half's logging steps |",
              "|---|---|---|---|"]
    for run in ("on", "off"):
        last, half = runs[run][-1], runs[run][len(runs[run]) // 2:]
        mtp = "-" if last["mtp_loss"] is None else f"{last['mtp_loss']:.4f}"
        lines.append(f"| {label[run]} | {last['loss']:.4f} | {mtp} | {sum(r['loss'] for r in half) / len(half):.4f} |")
    lines.append("")
    for i, name in enumerate(names):
        on, off = second_half_mean(runs["on"], i), second_half_mean(runs["off"], i)
        verdict = "lower" if on < off else "not lower"
        lines.append(f"- {name}: over the second half, max/mean {on:.3f} with the bias rule, {off:.3f} without "
                     f"({verdict}, {on / off:.2f}x).")
    loss_on, loss_off = runs["on"][-1]["loss"], runs["off"][-1]["loss"]
    lines += [f"- Final loss {loss_on:.4f} with the bias rule, {loss_off:.4f} without "
              f"(difference {loss_on - loss_off:+.4f}).", ""]
    if chart:
        lines += [f"![expert load max/mean and loss, bias rule on and off]({chart})", ""]
    else:
        lines += ["Text chart (matplotlib is not installed): max/mean per window, one character per window "
                  "(the ramp `" + RAMP + "` from 1 to " f"{result['experts'] / result['top_k']:g}).", "", "```"]
        for i, name in enumerate(names):
            for run in ("on", "off"):
                lines.append(f"{name:>12} {run:>3} " + sparkline([r[KEY][i] for r in runs[run]], 1.0,
                                                                 result["experts"] / result["top_k"]))
        lines += ["```", ""]
    return "\n".join(lines)


RAMP = " .:-=+*#%@"


def sparkline(values: list[float], low: float, high: float) -> str:
    top = len(RAMP) - 1
    return "".join(RAMP[min(top, max(0, round((v - low) / (high - low) * top)))] for v in values)


def render_chart(result: dict, path: Path) -> bool:
    """max/mean per router against the step, and the loss, both runs; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, names = result["runs"], result["routers"]
    figure, axes = plt.subplots(1, len(names) + 1, figsize=(4.2 * (len(names) + 1), 3.4))
    style = {"on": dict(color="tab:blue", label=f"bias rule on ({result['rate']:g})"),
             "off": dict(color="tab:red", label="bias rule off (0)")}
    for i, name in enumerate(names):
        for run, records in runs.items():
            axes[i].plot([r["step"] for r in records], [r[KEY][i] for r in records], **style[run])
        axes[i].set(title=f"{name}: max / mean expert load", xlabel="step", ylim=(1, None))
        axes[i].legend()
    for run, records in runs.items():
        axes[-1].plot([r["step"] for r in records], [r["loss"] for r in records], **style[run])
    axes[-1].set(title="loss", xlabel="step")
    axes[-1].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main(argv: list[str]) -> None:
    options = parse(argv)
    args = preset()
    rate = args["moe_bias_update_rate"]
    work = Path(tempfile.mkdtemp(prefix="moe_balance_"))
    runs = train(options.steps, options.logging_steps, rate, work)
    shutil.rmtree(work)  # the corpus, the data cache and the two runs' logs: the series are in `runs`

    from llm_pretrain.observe import perf
    from models.registry import ARCHITECTURES

    config = ARCHITECTURES[args["model_name_or_path"]]
    result = {"time": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["PYTHONPATH=$PWD nice -n 19 python scripts/moe_balance_benchmark.py", *argv]),
              "model": args["model_name_or_path"], "experts": config.num_experts, "top_k": config.num_experts_per_tok,
              "batch": args["per_device_train_batch_size"] * args["gradient_accumulation_steps"],
              "seq": args["max_seq_length"], "steps": options.steps, "logging_steps": options.logging_steps,
              "rate": rate, "routers": router_names(args["model_name_or_path"]),
              "environment": perf.collect_environment(measure_cpu_peak=False), "runs": runs}
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "moe_balance.json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    chart = "moe_balance.png" if render_chart(result, out / "moe_balance.png") else None
    text = render_markdown(result, chart)
    perf.write_keeping_findings(str(out / "moe_balance.md"), text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
