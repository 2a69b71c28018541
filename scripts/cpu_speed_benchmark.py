"""Honest speed on CPU: this toolkit vs PaddleNLP's Trainer on the same tiny LLaMA, and MFU by model width.

    python scripts/cpu_speed_benchmark.py [--steps 16 --warmup 4 --rounds 2 --sweep-steps 8 --out benchmarks/]

Run it on an otherwise idle machine; every measurement is its own process, one at a time:

1. The fp32 matmul peak (llm_pretrain.observe.flops.cpu_matmul_benchmark: 2048 x 2048, Paddle and NumPy on
   every core, the better one is the peak), once per ENVIRONMENTS entry.
2. The same LLaMA (COMPARE_MODEL), batch, sequence length, AdamW (lr, betas, eps, weight decay,
   clip 1.0, constant lr), fp32, steps, initial weights and token samples (our mmap dataset, same
   order), trained by (a) llm_pretrain/run_pretrain.py and (b) paddlenlp.trainer.Trainer with
   paddlenlp.transformers.LlamaForCausalLM on its plain fp32 path (no flash attention, no fused
   ops, tensor_parallel_output off), in each environment, --rounds times each, alternating (this
   machine's speed drifts by 10-20% over minutes; alternating lets both sides see the same drift).
   Speed, both sides alike: tokens of a step / that step's wall time, median over the steps after
   each run's --warmup steps, the runs of a side pooled. Ours: train_log.jsonl's
   step_time_s (batch assembly, forward, backward, grad norm, clip, AdamW); PaddleNLP's: a
   TrainerCallback, on_step_begin -> on_step_end (forward, backward, clip, AdamW; its data
   loader runs before on_step_begin). "Loop" speed uses the time between the ends of
   consecutive steps instead: everything, logging and metric files included.
3. MFU of our training for growing widths (SWEEP_WIDTHS, fixed layers, sequence and batch): the
   TFLOPs/card of train_log.jsonl (model FLOPs of llm_pretrain.observe.flops) / the peak of step 1.
4. OUT/cpu_speed.json (every raw figure, the environment) and OUT/cpu_speed.md (the tables; a
   hand-written "## Findings" section already at the end of that file is kept).

About 9 minutes on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ORIGINAL_ENV = dict(os.environ)  # before anything imports Paddle (it sets OMP_NUM_THREADS=1 when unset)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from llm_pretrain.cli.benchmark import forced_arguments  # (every step logged, nothing saved)
from llm_pretrain.observe import flops, perf  # (none of these imports Paddle)
from llm_pretrain.errors import UsageArgumentParser
from models.registry import make_config, parameter_count

RUN_PRETRAIN = os.path.join(REPO_ROOT, "llm_pretrain", "run_pretrain.py")
ARGS_FILE = os.path.join(REPO_ROOT, "configs", "llama", "pretrain-llama_tiny-dp.json")  # every path overridden
VOCAB = 512  # the embedded corpus' tokenizer (llm_pretrain/data/embedded.py)
COMPARE_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=688, vocab_size=VOCAB)  # llama-small's shape
SEQ, COMPARE_BATCH = 256, 8  # sequence length of every run
SWEEP_WIDTHS, SWEEP_LAYERS, SWEEP_BATCH = (128, 256, 512, 1024), 2, 4
OPTIM = dict(learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.01,
             max_grad_norm=1.0)
SEED = 42
# What the training processes are started with. "as is": no thread or MKL variable, i.e. what typing the
# command gives: our run_pretrain.py then sets its CPU defaults (llm_pretrain/cpu/threads.py), PaddleNLP's
# Trainer runs as Paddle leaves it (OMP_NUM_THREADS pinned to 1, on AMD MKL's generic SSE path). "tuned":
# every core for Paddle's threads, and on AMD CPUs MKL's AVX2 kernels, for both sides. What each side
# actually ran with is recorded per run ("effective_environment").
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_DEBUG_CPU_TYPE")
ENVIRONMENTS = {"as is": {}, "tuned": {"OMP_NUM_THREADS": str(flops.cpu_count()),
                                       **({"MKL_DEBUG_CPU_TYPE": "5"} if flops.cpu_vendor() == "AuthenticAMD" else {})}}


def run(command: list[str], env_name: str, log_path: str, timeout: float = 1800) -> None:
    """One measurement in its own process with exactly the environment `env_name`; output to log_path."""
    env = {k: v for k, v in ORIGINAL_ENV.items() if k not in THREAD_VARIABLES and not k.startswith("PADDLE_")}
    env.update(ENVIRONMENTS[env_name], PYTHONUNBUFFERED="1", PYTHONPATH=REPO_ROOT)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                              timeout=timeout).returncode
    if code:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            raise SystemExit(f"failed ({code}): {' '.join(command)}\n" + "".join(f.readlines()[-25:]))


def effective_environment(environ) -> dict:
    """The thread/MKL variables a training process ran with (read after Paddle was imported)."""
    return {k: environ[k] for k in THREAD_VARIABLES if k in environ}


def ours_effective_environment(env_name: str, log_path: str) -> dict:
    """The started environment plus what run_pretrain.py's one "cpu defaults: A=1 (...), B=2 (...)" line set."""
    env = {"OMP_NUM_THREADS": "1", **ENVIRONMENTS[env_name]}  # Paddle's own default when nothing else is set
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("cpu defaults:"):
                env.update(re.findall(r"(\w+)=(\S+) \(", line.split(";")[0]))
    return {k: env[k] for k in THREAD_VARIABLES if k in env}


def slug(name: str) -> str:
    return name.replace(" ", "_")


# ----------------------------------------------------------------------------- workers (own processes)
def peak_worker(out_path: str) -> None:
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(flops.cpu_matmul_benchmark(2048), f)


def paddlenlp_worker(spec_path: str) -> None:
    """PaddleNLP's Trainer + LlamaForCausalLM on our samples from our initial weights; per-step times, losses."""
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    from models.decoder import CausalLM
    from models.paddlenlp_interop import to_paddlenlp_state
    from models.weights import init_weights

    seq, sizes = spec["seq"], spec["model"]
    # The plain fp32 eager path: every switch that could make it compute something else, spelled out.
    config = LlamaConfig(**sizes, max_position_embeddings=seq, seq_length=seq, rms_norm_eps=1e-6, use_cache=False,
                         use_flash_attention=False, use_fused_rms_norm=False, use_fused_rope=False,
                         fuse_attention_qkv=False, fuse_attention_ffn=False, tensor_parallel_output=False,
                         use_recompute=False, sequence_parallel=False, tie_word_embeddings=False, dtype="float32")
    model = LlamaForCausalLM(config)
    # Our trainer's initial weights (models/weights.py, same seed) in PaddleNLP's names: both runs then
    # log the same losses, which shows that they compute the same thing.
    ours_config = make_config("llama", **sizes, max_position_embeddings=seq, seq_length=seq, norm_eps=1e-6)
    ours = CausalLM(ours_config)
    init_weights(ours, ours_config, SEED)
    state = to_paddlenlp_state(ours_config, {k: v.numpy() for k, v in ours.state_dict().items()})
    missing, unexpected = model.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
    assert not missing and not unexpected, (missing, unexpected)
    del ours
    train_with_paddlenlp_trainer(model, spec)


def train_with_paddlenlp_trainer(model, spec: dict) -> None:
    """PaddleNLP's Trainer on `model` with our samples in our order (spec: steps, batch, seq, input_dir,
    data_cache, output_dir); writes output_dir/steps.json: per-step begin/end times, losses."""
    import numpy as np
    import paddle
    from paddlenlp.trainer import Trainer, TrainerCallback, TrainingArguments

    from llm_pretrain.data import build_pretraining_datasets

    steps, batch, seq = spec["steps"], spec["batch"], spec["seq"]
    # What our trainer reads: the same dataset (split, seed, index cache); step k gets samples k*batch...
    train, _, _ = build_pretraining_datasets(spec["input_dir"], "949,50,1", seq, SEED, (steps * batch, 0, 0),
                                             data_cache=spec["data_cache"])
    samples = np.stack([train[i] for i in range(steps * batch)]).astype("int64")

    class Samples(paddle.io.Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return {"input_ids": samples[i, :-1], "labels": samples[i, 1:]}

    class InOrder(Trainer):  # PaddleNLP shuffles a single process' batches; keep our order
        def _get_train_sampler(self):
            return paddle.io.BatchSampler(dataset=self.train_dataset, shuffle=False, batch_size=batch)

    timed, losses = [], []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timed.append({"step": state.global_step, "begin": self.start, "end": time.perf_counter()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    args = TrainingArguments(output_dir=spec["output_dir"], max_steps=steps, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=1, lr_scheduler_type="constant", warmup_steps=0,
                             logging_steps=1, save_strategy="no", evaluation_strategy="no", do_train=True,
                             disable_tqdm=True, seed=SEED, dataloader_num_workers=0, fp16=False, bf16=False, **OPTIM)
    InOrder(model=model, args=args, train_dataset=Samples(), callbacks=[StepTimer()]).train()
    with open(os.path.join(spec["output_dir"], "steps.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": timed, "losses": losses, "effective_environment": effective_environment(os.environ),
                   "params": sum(int(np.prod(p.shape)) for p in model.parameters())}, f)


# ----------------------------------------------------------------------------- runs (from the parent)
def train_ours(root: str, corpus: dict, name: str, sizes: dict, batch: int, steps: int, env_name: str) -> dict:
    out = os.path.join(root, "runs", name)
    model_dir = os.path.join(root, "models", name)  # a local model: our config.json of exactly this shape
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"family": "llama", **sizes, "max_position_embeddings": SEQ, "norm_eps": 1e-6}, f)
    command = [sys.executable, RUN_PRETRAIN, ARGS_FILE, *forced_arguments(steps, out), "--model_name_or_path",
               model_dir, "--tokenizer_name_or_path", corpus["tokenizer"], "--input_dir", corpus["input_dir"],
               "--data_cache", os.path.join(root, "cache"), "--max_seq_length", str(SEQ),
               "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1",
               "--lr_scheduler_type", "constant", "--warmup_steps", "0",
               "--min_learning_rate", str(OPTIM["learning_rate"]), "--seed", str(SEED), "--device", "cpu"]
    for key, value in OPTIM.items():
        command += [f"--{key}", str(value)]
    run(command, env_name, out + ".log")
    events = perf.last_run(perf.read_jsonl(os.path.join(out, perf.TRAIN_LOG)))
    run_event = next(r for r in events if r["event"] == "run")
    train = [r for r in events if r["event"] == "train"]
    # A record's "time" is taken after its step's logging: the gaps are whole loop iterations.
    loop = [{"step": b["step"], "tokens_per_card_per_sec": b["global_tokens_per_step"] / (b["time"] - a["time"])}
            for a, b in zip(train, train[1:])]
    architecture = {k: v for k, v in run_event["model_config"].items() if k != "family"}
    return {"step_records": train, "loop_records": loop, "losses": [r["loss"] for r in train],
            "effective_environment": ours_effective_environment(env_name, out + ".log"),
            "flops_per_token": run_event["flops_per_token"], "params": parameter_count(make_config("llama", **architecture))}


def train_paddlenlp(root: str, corpus: dict, sizes: dict, batch: int, steps: int, env_name: str,
                    round_: int) -> dict:
    out = os.path.join(root, "runs", f"paddlenlp-{slug(env_name)}-{round_}")
    os.makedirs(out, exist_ok=True)
    spec_path = os.path.join(out, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump({"output_dir": out, "steps": steps, "batch": batch, "seq": SEQ, "model": sizes,
                   "input_dir": corpus["input_dir"], "data_cache": os.path.join(root, "cache")}, f)
    run([sys.executable, os.path.abspath(__file__), "--worker", "paddlenlp", spec_path], env_name, out + ".log")
    with open(os.path.join(out, "steps.json"), encoding="utf-8") as f:
        result = json.load(f)
    tokens = batch * SEQ
    step_records = [{"step": s["step"], "tokens_per_card_per_sec": tokens / (s["end"] - s["begin"]),
                     "step_time_s": s["end"] - s["begin"]} for s in result["steps"]]
    loop = [{"step": b["step"], "tokens_per_card_per_sec": tokens / (b["end"] - a["end"])}
            for a, b in zip(result["steps"], result["steps"][1:])]
    return {"step_records": step_records, "loop_records": loop, "losses": result["losses"], "params": result["params"],
            "effective_environment": result["effective_environment"]}


def speed(raws: list[dict], warmup: int) -> dict:
    """One definition for both sides: medians over the steps after each run's warm-up, all runs pooled."""
    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for raw in raws for r in perf.measured_steps(raw[kind], warmup))

    return {"tokens_per_sec": median("step_records", "tokens_per_card_per_sec"),
            "step_time_s": median("step_records", "step_time_s"),
            "loop_tokens_per_sec": median("loop_records", "tokens_per_card_per_sec")}


def measure_peak(root: str, env_name: str) -> dict:
    path = os.path.join(root, f"peak-{slug(env_name)}.json")
    run([sys.executable, os.path.abspath(__file__), "--worker", "peak", path], env_name, path + ".log")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def environment() -> dict:
    import paddle  # only now: every measurement has run in its own process with its own environment
    from importlib.metadata import version

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "paddle_version": paddle.__version__,
            "paddle_commit": paddle.version.commit, "paddlenlp_version": version("paddlenlp"),
            "python": platform.python_version(), "cpu_model": perf.cpu_model_name(), "cpu_vendor": flops.cpu_vendor(),
            "cpu_count": flops.cpu_count(), "environments": ENVIRONMENTS,
            "load_average_1_5_15_min": list(os.getloadavg())}  # other jobs on the machine while it ran


# ----------------------------------------------------------------------------- report
def _env_text(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items()) or "nothing set"


def _loss_noise_floor(runs: dict) -> list[str]:
    """How far each side's losses move between the two environments (only the thread count and MKL
    switches differ): the float-rounding noise floor for the "largest loss difference" column."""
    if len(runs) < 2:
        return []
    first, second = list(runs.values())[:2]
    def largest(side):
        return max(abs(a - b) for a, b in zip(first[side]["losses"], second[side]["losses"]))
    names = " and ".join(f"'{name}'" for name in list(runs)[:2])
    return ["", f"Each side against itself in {names} (same code, data and weights; only the environment "
            f"differs, so float rounding differs when the thread count does): largest loss difference ours "
            f"{largest('ours'):.1e}, PaddleNLP {largest('paddlenlp'):.1e}. A difference between the sides of that "
            "size is rounding, amplified by the training steps, not a different computation."]


def render(results: dict) -> str:
    env, c, s = results["environment"], results["compare"], results["sweep"]
    m = c["model"]
    lines = ["# CPU speed: this toolkit vs PaddleNLP, and MFU by width", "",
             f"`python scripts/cpu_speed_benchmark.py`, {env['date']}: {env['cpu_count']} cores of {env['cpu_model']}"
             f" ({env['cpu_vendor']}), Paddle {env['paddle_version']}, PaddleNLP {env['paddlenlp_version']}, Python "
             f"{env['python']}; load average at the end {env['load_average_1_5_15_min'][0]:.1f} / "
             f"{env['load_average_1_5_15_min'][1]:.1f} / {env['load_average_1_5_15_min'][2]:.1f} (1 / 5 / 15 min). "
             "Raw figures: `cpu_speed.json`. Environments of the training processes: "
             + "; ".join(f"**{k}**: {' '.join(f'{a}={b}' for a, b in v.items()) or 'no thread/MKL variable set'}"
                         for k, v in ENVIRONMENTS.items()) + ". What the training processes ran with (after our "
             "CPU defaults, llm_pretrain/cpu/threads.py, and Paddle's own `OMP_NUM_THREADS=1`): "
             + "; ".join(f"**{name}**: ours {_env_text(r['ours']['effective_environment'])}, PaddleNLP "
                         f"{_env_text(r['paddlenlp']['effective_environment'])}" for name, r in c["runs"].items())
             + ".", "",
             "## Matrix-product peak (fp32, 2048 x 2048, best of repeated products)", "",
             "| environment | Paddle (MKL) TFLOPs | NumPy (OpenBLAS) TFLOPs | threads Paddle / NumPy |", "|---|---|---|---|"]
    for name, p in results["peak"].items():
        lines.append(f"| {name} | {p['paddle_tflops']:.4f} | {p['numpy_tflops']:.4f} | "
                     f"{p['paddle_threads']} / {p['numpy_threads']} |")
    lines += ["", f"Peak used for MFU: **{results['peak_tflops']:.4f} TFLOPs** ({results['peak_source']}).", "",
              "## Same model, same data, same initial weights: ours vs PaddleNLP's Trainer", "",
              f"LLaMA hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, {m['num_attention_heads']} heads "
              f"({m['num_key_value_heads']} kv), MLP {m['intermediate_size']}, vocab {m['vocab_size']} "
              f"({next(iter(c['runs'].values()))['ours']['params']:,} parameters, PaddleNLP's model: "
              f"{next(iter(c['runs'].values()))['paddlenlp']['params']:,}); batch {c['batch']} x {c['seq']} tokens; AdamW lr "
              f"{OPTIM['learning_rate']} constant, betas {OPTIM['adam_beta1']}/{OPTIM['adam_beta2']}, eps "
              f"{OPTIM['adam_epsilon']}, weight decay {OPTIM['weight_decay']}, clip {OPTIM['max_grad_norm']}; fp32; "
              f"{c['rounds']} alternating runs per side of {c['steps']} steps, medians over the steps after each "
              f"run's {c['warmup']} warm-up steps.", "",
              "| environment | ours tokens/s | PaddleNLP tokens/s | ratio ours/PaddleNLP | step ms ours / PaddleNLP | "
              "loop tokens/s ours / PaddleNLP | largest loss difference |", "|---|---|---|---|---|---|---|"]
    for name, r in c["runs"].items():
        o, p = r["ours"], r["paddlenlp"]
        lines.append(f"| {name} | {o['tokens_per_sec']:.0f} | {p['tokens_per_sec']:.0f} | **{r['ratio']:.2f}** | "
                     f"{o['step_time_s'] * 1e3:.0f} / {p['step_time_s'] * 1e3:.0f} | {o['loop_tokens_per_sec']:.0f} / "
                     f"{p['loop_tokens_per_sec']:.0f} | {r['max_loss_difference']:.1e} |")
    lines += _loss_noise_floor(c["runs"])
    if not s["rows"]:
        return "\n".join(lines) + "\n"
    lines += ["", "## MFU of our training step by width", "",
              f"{SWEEP_LAYERS} layers, head size 64, MLP 2.6875 x hidden (LLaMA's 11008/4096), vocab {VOCAB}, batch "
              f"{SWEEP_BATCH} x {SEQ} tokens, {s['steps']} steps, medians after {s['warmup']}; achieved = the "
              f"TFLOPs/card of train_log.jsonl (model FLOPs, llm_pretrain/observe/flops.py).", "",
              "| width | params | environment | tokens/s | achieved TFLOPs | peak TFLOPs | MFU |",
              "|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['width']} | {r['params'] / 1e6:.2f}M | {r['environment']} | {r['tokens_per_sec']:.0f} | "
                     f"{r['achieved_tflops']:.4f} | {r['peak_tflops']:.4f} | "
                     f"{'n/a (peak measured below it)' if r['mfu'] is None else format(r['mfu'], '.1%')} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    parser = UsageArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="steps of each comparison run (default 16)")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the medians (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="comparison runs per side, alternating (default 2)")
    parser.add_argument("--sweep-steps", type=int, default=8, help="steps per width of the MFU sweep (default 8)")
    parser.add_argument("--sweep-warmup", type=int, default=3, help="warm-up steps of the sweep (default 3)")
    parser.add_argument("--environments", default=",".join(ENVIRONMENTS),
                        help=f"comma-separated, of: {', '.join(ENVIRONMENTS)} (default: all)")
    parser.add_argument("--sweep-widths", default=",".join(map(str, SWEEP_WIDTHS)),
                        help="widths of the MFU sweep, comma-separated; empty: no sweep (default: %(default)s)")
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks"), help="for the .md and .json")
    parser.add_argument("--work-dir", help="runs, logs, corpus; kept (default: a temporary directory, removed)")
    parser.add_argument("--worker", choices=("peak", "paddlenlp"), help=argparse.SUPPRESS)
    options, rest = parser.parse_known_args(argv)
    if options.worker:
        {"peak": peak_worker, "paddlenlp": paddlenlp_worker}[options.worker](rest[0])
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if min(options.steps - options.warmup, options.sweep_steps - options.sweep_warmup) < 2:
        parser.error("--steps/--sweep-steps must leave at least 2 steps after the warm-up")
    chosen = [name.strip() for name in options.environments.split(",") if name.strip()]
    if not chosen or any(name not in ENVIRONMENTS for name in chosen):
        parser.error(f"--environments: {options.environments!r}; choose from {', '.join(ENVIRONMENTS)}")
    try:
        widths = [int(w) for w in options.sweep_widths.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--sweep-widths: {options.sweep_widths!r} is not a list of integers")
    for name in list(ENVIRONMENTS):
        if name not in chosen:
            del ENVIRONMENTS[name]

    from llm_pretrain.data import ensure_embedded_corpus
    from llm_pretrain.data.embedded import DEFAULT_OUT_DIR

    root = options.work_dir or tempfile.mkdtemp(prefix="cpu_speed_")
    built = os.path.isfile(os.path.join(DEFAULT_OUT_DIR, "DONE.json"))
    corpus = ensure_embedded_corpus(DEFAULT_OUT_DIR if built else os.path.join(root, "embedded"))
    print(f"work dir {root}, corpus {corpus['input_dir']}", flush=True)

    results: dict = {"peak": {name: measure_peak(root, name) for name in ENVIRONMENTS}}
    best_env = max(results["peak"], key=lambda name: results["peak"][name]["peak_tflops"])
    best = results["peak"][best_env]
    peak = best["peak_tflops"]
    library = {"paddle": "Paddle's MKL", "numpy": "NumPy's OpenBLAS"}[best["library"]]
    threads = best[f"{best['library']}_threads"]
    results.update(peak_tflops=peak, peak_source=f"{library} on {threads} threads, in the '{best_env}' process")
    print(f"peak {peak:.4f} TFLOPs ({results['peak_source']})", flush=True)

    compare = {"model": COMPARE_MODEL, "batch": COMPARE_BATCH, "seq": SEQ, "steps": options.steps,
               "warmup": options.warmup, "rounds": options.rounds, "optimizer": OPTIM, "runs": {}}
    for env_name in ENVIRONMENTS:
        raws: dict = {"ours": [], "paddlenlp": []}
        for round_ in range(options.rounds):  # ours, PaddleNLP, ours, ...: both sides see the machine's drift
            for side in raws:
                start = time.perf_counter()
                raw = (train_ours(root, corpus, f"ours-{slug(env_name)}-{round_}", COMPARE_MODEL, COMPARE_BATCH,
                                  options.steps, env_name) if side == "ours" else
                       train_paddlenlp(root, corpus, COMPARE_MODEL, COMPARE_BATCH, options.steps, env_name, round_))
                raws[side].append({**raw, "wall_s": round(time.perf_counter() - start, 1)})
                print(f"[{env_name}, round {round_ + 1}] {side}: {speed([raw], options.warmup)['tokens_per_sec']:.0f}"
                      f" tokens/s, {raws[side][-1]['wall_s']} s", flush=True)
        pair = {side: {**speed(runs, options.warmup), "losses": runs[0]["losses"], "params": runs[0]["params"],
                       "effective_environment": runs[0]["effective_environment"], "runs": runs}
                for side, runs in raws.items()}
        pair["ratio"] = pair["ours"]["tokens_per_sec"] / pair["paddlenlp"]["tokens_per_sec"]
        pair["max_loss_difference"] = max(abs(a - b) for a, b in zip(pair["ours"]["losses"],
                                                                      pair["paddlenlp"]["losses"]))
        print(f"[{env_name}] ours {pair['ours']['tokens_per_sec']:.0f}, PaddleNLP "
              f"{pair['paddlenlp']['tokens_per_sec']:.0f} tokens/s: ratio {pair['ratio']:.2f}", flush=True)
        compare["runs"][env_name] = pair
    results["compare"] = compare

    sweep = {"steps": options.sweep_steps, "warmup": options.sweep_warmup, "rows": []}
    for width in widths:
        heads = max(1, width // 64)
        sizes = dict(hidden_size=width, num_hidden_layers=SWEEP_LAYERS, num_attention_heads=heads,
                     num_key_value_heads=heads, intermediate_size=width * 43 // 16, vocab_size=VOCAB)
        config = make_config("llama", **sizes)
        for env_name in reversed(ENVIRONMENTS):  # tuned first
            raw = train_ours(root, corpus, f"width{width}-{slug(env_name)}", sizes, SWEEP_BATCH,
                             options.sweep_steps, env_name)
            assert raw["flops_per_token"] == flops.model_flops_per_token(config, SEQ)  # the log's TFLOPs
            achieved = perf.median_after_warmup(raw["step_records"], "tflops_per_card", options.sweep_warmup)
            row = {"width": width, "environment": env_name, "sizes": sizes, "params": parameter_count(config),
                   "tokens_per_sec": speed([raw], options.sweep_warmup)["tokens_per_sec"], "achieved_tflops": achieved,
                   "peak_tflops": peak, "mfu": achieved / peak if achieved <= peak else None,  # None: a busy machine
                   "flops_per_token": raw["flops_per_token"],                                  # measured the peak low
                   "step_records": raw["step_records"]}
            sweep["rows"].append(row)
            print(f"[width {width}, {env_name}] {row['tokens_per_sec']:.0f} tokens/s, {achieved:.4f} TFLOPs, "
                  f"MFU {row['mfu']}", flush=True)
    results["sweep"] = sweep
    results["environment"] = environment()

    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, "cpu_speed.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    markdown = render(results)
    perf.write_keeping_findings(os.path.join(options.out, "cpu_speed.md"), markdown)
    print("\n" + markdown, flush=True)
    if not options.work_dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
