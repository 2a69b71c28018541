"""Performance tables, FLOPs and MFU, and the benchmark runner.

The FLOPs cases are computed by hand from the formula in llm_pretrain/observe/flops.py
(written out as arithmetic here, not calling the code under test); the tables
come from synthetic train_log.jsonl files; the runner runs two tiny CPU
configurations and one that fails.
"""

import csv
import importlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from llm_pretrain.observe import flops, perf
from models.registry import make_config, resolve_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name):
    """The module behind scripts/<name>.py (llm_pretrain/cli/<name>.py)."""
    return importlib.import_module(f"llm_pretrain.cli.{name}")


# ----------------------------------------------------------------------------- FLOPs by hand
def test_llama_7b_flops_per_token_by_hand():
    config, _ = resolve_model("facebook/llama-7b")
    h, L, f, V, s = 4096, 32, 11008, 32000, 4096
    layer = (2 * (2 * h * h + 2 * h * h)  # q, o and k, v projections (no GQA: kv width h)
             + 2 * 2 * s * h  # q k^T and p v over the full s x s scores
             + 2 * 3 * h * f)  # SwiGLU: gate, up, down
    expected = 3 * (L * layer + 2 * h * V)  # forward + backward (2x), head once per token
    assert expected == 46_084_915_200
    assert flops.training_flops_per_token(config, s) == expected
    assert flops.model_flops_per_token(config, s) == expected
    # The 6N + 12 L s h rule of thumb for the same model (N without the input embedding) agrees:
    n_params = L * (4 * h * h + 3 * h * f) + h * V
    assert 6 * n_params + 12 * L * s * h == expected


def test_gqa_counts_smaller_kv_projections_only():
    config, _ = resolve_model("meta-llama/Llama-2-70b")  # 64 heads of 128, 8 kv heads
    h, L, f, V, s, kv = 8192, 80, 28672, 32000, 4096, 8 * 128
    layer = 2 * (2 * h * h + 2 * h * kv) + 4 * s * h + 6 * h * f
    assert flops.training_flops_per_token(config, s) == 3 * (L * layer + 2 * h * V)
    no_gqa = config.replace(num_key_value_heads=64)
    assert flops.training_flops_per_token(no_gqa, s) - flops.training_flops_per_token(config, s) == \
        3 * L * 2 * 2 * h * (h - kv)


def test_gpt3_matches_megatron_equation_with_full_recompute():
    # Narayanan et al. 2021, eq. 3: 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) per batch of B x s tokens,
    # for a GELU 4h MLP with full activation recompute.
    h, L, s, V = 12288, 96, 2048, 51200
    config = make_config("gpt3", hidden_size=h, num_hidden_layers=L, num_attention_heads=96,
                         intermediate_size=4 * h, vocab_size=V)
    megatron = 96 * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert flops.training_flops_per_token(config, s, "full") == pytest.approx(megatron, rel=1e-12)
    # Without recompute: 72 L h^2 (1 + s/(6h) + V/(12 L h)).
    assert flops.model_flops_per_token(config, s) == pytest.approx(72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)),
                                                                   rel=1e-12)


def test_family_mlp_and_recompute_granularities():
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
    h, L, f, V, s = 64, 2, 256, 1000, 128
    attention_block = 2 * 4 * h * h + 4 * s * h
    swiglu = 3 * (L * (attention_block + 6 * h * f) + 2 * h * V)
    gelu = 3 * (L * (attention_block + 4 * h * f) + 2 * h * V)
    for family in ("llama", "baichuan", "qwen"):  # Qwen's q/k/v bias is elementwise: not counted
        assert flops.model_flops_per_token(make_config(family, **sizes), s) == swiglu
    for family in ("gpt3", "bloom"):
        assert flops.model_flops_per_token(make_config(family, **sizes), s) == gelu

    llama = make_config("llama", **sizes)
    layer = attention_block + 6 * h * f
    assert flops.training_flops_per_token(llama, s, "full") == swiglu + L * layer
    assert flops.training_flops_per_token(llama, s, "full_attn") == swiglu + L * attention_block
    assert flops.training_flops_per_token(llama, s, "core_attn") == swiglu + L * 4 * s * h
    assert flops.training_flops_per_token(llama, s, "full", recomputed_layers=1) == swiglu + layer
    assert flops.model_flops_per_token(llama, s, causal_attention=True) == swiglu - 3 * L * 2 * s * h
    with pytest.raises(ValueError):
        flops.training_flops_per_token(llama, s, "everything")


# ----------------------------------------------------------------------------- MFU and peaks
def test_mfu_llama_7b_on_a100_by_hand():
    # 3000 tokens/card/sec of llama-7b at 4096 in bf16 on an A100 (312 TFLOPs dense):
    tflops = 46_084_915_200 * 3000 / 1e12
    assert tflops == pytest.approx(138.2547456)
    peak = flops.device_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16")
    assert peak == 312.0
    assert flops.mfu(tflops, peak) == pytest.approx(138.2547456 / 312)  # 44.3%


def test_mfu_refuses_impossible_inputs():
    assert flops.mfu(0.0, 312) == 0.0
    assert flops.mfu(312, 312) == 1.0
    for achieved, peak in ((313, 312), (1, 0), (1, -5), (-1, 312)):
        with pytest.raises(ValueError):
            flops.mfu(achieved, peak)
    assert perf.safe_mfu(313, 312) is None  # tables show n/a, never a clamped 100%


@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-PCIE-40GB", "fp16", 312.0),
    ("NVIDIA A800-SXM4-80GB", "bfloat16", 312.0), ("NVIDIA A100-SXM4-80GB", "fp32", 156.0),  # TF32 by default
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H800", "bf16", 989.4),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0), ("Tesla V100-PCIE-16GB", "fp32", 14.0),
    ("Tesla V100-SXM2-32GB", "bf16", None), ("NVIDIA A10", "bf16", 125.0), ("Some Future GPU", "bf16", None),
])
def test_device_peaks(name, dtype, expected):
    assert flops.device_peak_tflops(name, dtype) == expected


def test_cpu_peak_is_measured_and_cached():
    first = flops.cpu_matmul_benchmark(256, 0.05)
    assert first is flops.cpu_matmul_benchmark(256, 0.05)
    assert 0 < first["paddle_tflops"] <= first["peak_tflops"] and 0 < first["numpy_tflops"] <= first["peak_tflops"]
    assert first["peak_tflops"] < 100  # a CPU; not a units mistake


# ----------------------------------------------------------------------------- tables from logs
def write_log(directory, speeds, *, step_every=1, strategy="dp", device="cpu", memory=None, finished=True,
              world_size=1, args_file="configs/llama/tiny.json", flops_per_token=1e6, when=1_700_000_000.0,
              prediction=None):
    os.makedirs(directory, exist_ok=True)
    memory = memory or {"peak_rss_mb": 1000.0}
    lines = [{"event": "run", "time": when, "model": "llama-tiny", "family": "llama", "args_file": args_file,
              "strategy": strategy, "layout": {"world_size": world_size}, "seq_length": 64, "global_batch_size": 4,
              "max_steps": len(speeds) * step_every, "start_step": 0, "device": device, "paddle_version": "3.3.1",
              "paddle_commit": "abc", "flops_per_token": flops_per_token, "model_config": {},
              **({"prediction": prediction} if prediction else {})}]
    for i, speed in enumerate(speeds, 1):
        lines.append({"event": "train", "time": when + i, "step": i * step_every, "loss": 5.0, "learning_rate": 1e-4,
                      "grad_norm": 1.0, "tokens_per_card_per_sec": speed, "step_time_s": 256 / speed,
                      "global_tokens_per_step": 256, "tflops_per_card": flops_per_token * speed / 1e12,
                      **{k: v + i for k, v in memory.items()}})
    if finished:
        lines.append({"event": "summary", "steps": len(speeds) * step_every})
    with open(os.path.join(directory, "train_log.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(line) for line in lines) + "\n")
    return directory


CPU_ENV = {"paddle_version": "3.3.1", "paddle_commit": "abc", "python": "3.11", "device": "cpu",
           "cpu_model": "Test CPU", "cpu_count": 2, "cpu_peak_tflops": 0.1}


def test_median_excludes_warmup_steps(tmp_path):
    # Three slow warm-up steps, then steady steps with one outlier: the median is 100.
    speeds = [10, 20, 30, 100, 101, 99, 102, 98, 500, 100]
    record = perf.summarize_log(write_log(tmp_path / "run", speeds), warmup_steps=3, environment=CPU_ENV)
    assert record["status"] == "ok"
    assert record["tokens_per_card_per_sec"] == 100
    assert record["measured_steps"] == 7 and record["steps"] == 10
    assert record["peak_rss_mb"] == 1010.0  # the maximum over the run
    assert record["tflops_per_card"] == pytest.approx(1e6 * 100 / 1e12)
    assert record["mfu"] == pytest.approx(1e-4 / 0.1)  # one process: the whole measured CPU peak
    assert perf.summarize_log(str(tmp_path / "run"), warmup_steps=0)["tokens_per_card_per_sec"] == 99.5
    # Every step warm-up: no speed rather than a warm-up figure.
    assert perf.summarize_log(str(tmp_path / "run"), warmup_steps=10)["tokens_per_card_per_sec"] is None


def test_logging_intervals_that_touch_warmup_are_excluded(tmp_path):
    # Logged every 2 steps: the intervals 1-2 and 3-4 contain warm-up steps 1..3.
    records = [{"step": s, "tokens_per_card_per_sec": v} for s, v in ((2, 1), (4, 2), (6, 10), (8, 11), (10, 12))]
    assert [r["step"] for r in perf.measured_steps(records, warmup_steps=3)] == [6, 8, 10]
    assert perf.median_after_warmup(records, "tokens_per_card_per_sec", 3) == 11
    assert perf.median_after_warmup(records, "tokens_per_card_per_sec", 4) == 11
    assert perf.median_after_warmup(records, "tokens_per_card_per_sec", 5) == 11.5


def test_markdown_table_columns_strategies_and_failures(tmp_path):
    ok = perf.summarize_log(write_log(tmp_path / "a", [5, 50, 60, 40, 50], strategy="dp"), 1, environment=CPU_ENV)
    dp2 = perf.summarize_log(write_log(tmp_path / "b", [5, 30, 30, 30], strategy="dp2", world_size=2), 1,
                             environment=CPU_ENV)
    crashed = perf.summarize_log(write_log(tmp_path / "c", [5, 6], finished=False), 1, environment=CPU_ENV)
    failed = {"name": "bad", "status": "failed", "model": "llama-tiny", "seq_length": 64, "strategy": "tp2",
              "args_file": "bad.json", "test_time": "2024-01-01 00:00",
              "error": "Traceback (most recent call last):\n  ...\nerror: per_device_train_batch_size: 0 is too small"}
    oom = {"name": "big", "status": "OOM", "model": "llama-7b", "seq_length": 4096, "strategy": "sd8_stage2",
           "peak_mem_allocated_mb": 80000.0, "peak_mem_reserved_mb": 81000.0,
           "error": "ResourceExhaustedError: Out of memory error on GPU 0"}
    text = perf.render_markdown([ok, dp2, crashed, failed, oom], CPU_ENV, warmup_steps=1)

    header = "| model | sequence length | strategy | what ran | speed (tokens/card/sec) | TFLOPs/card | MFU " \
             "| memory (MB) | argument file | test time |"
    assert header in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line != header]
    assert len(rows) == 5
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [row[3] for row in cells] == ["-"] * 5  # these logs carry no "built" description
    cells = [row[:3] + row[4:] for row in cells]
    assert cells[0][:4] == ["llama-tiny", "64", "dp", "50.0"]
    assert cells[1][2:4] == ["dp2", "30.0"]
    assert cells[1][5] == "0.06%"  # 30 x 1e6 / 1e12 TFLOPs over its half of the 0.1 TFLOPs CPU
    assert cells[0][6] == "1,005" and cells[0][7] == "`configs/llama/tiny.json`"
    assert cells[2][3] == "**failed**" and crashed["error"].startswith("the run stopped at step 2")
    assert cells[3][2:4] == ["tp2", "**failed**"]
    assert cells[4][3] == "**OOM**" and cells[4][6] == "80,000 / 81,000"
    assert "- bad: failed -- error: per_device_train_batch_size: 0 is too small" in text
    assert "ResourceExhaustedError" in text
    assert "Paddle 3.3.1" in text and "Test CPU" in text and "after the first 1" in text


def test_gpu_record_uses_the_datasheet_peak(tmp_path):
    env = {"paddle_version": "3.3.1", "paddle_commit": "abc", "device": "gpu", "device_name": "NVIDIA A100-SXM4-80GB",
           "device_count": 8, "cuda_version": "12.3", "nccl_version": "2.21.5"}
    args_file = tmp_path / "bf16.json"
    args_file.write_text(json.dumps({"bf16": True}))
    memory = {"peak_mem_allocated_mb": 30000.0, "peak_mem_reserved_mb": 35000.0}
    directory = write_log(tmp_path / "gpu", [100, 3000, 3000, 3000], device="gpu", memory=memory,
                          args_file=str(args_file), flops_per_token=46_084_915_200, world_size=8)
    record = perf.summarize_log(directory, 1, environment=env)
    assert record["dtype"] == "bf16" and record["peak_tflops_per_card"] == 312.0
    assert record["mfu"] == pytest.approx(138.2547456 / 312)
    text = perf.render_markdown([record], env, 1)
    assert "30,004 / 35,004" in text and "44.31%" in text and "CUDA 12.3, NCCL 2.21.5" in text


def test_csv_and_png(tmp_path):
    records = [perf.summarize_log(write_log(tmp_path / "a", [1, 2, 3, 4]), 1, environment=CPU_ENV),
               {"name": "bad", "status": "failed", "error": "boom"}]
    paths = perf.write_reports(records, CPU_ENV, str(tmp_path / "out"), 1)
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == perf.CSV_COLUMNS
    assert rows[0]["status"] == "ok" and float(rows[0]["tokens_per_card_per_sec"]) == 3
    assert rows[1]["status"] == "failed" and rows[1]["error"] == "boom"
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "**failed**" in open(paths["md"]).read()


def test_chart_plots_the_tables_figures_beside_the_planners_prediction(tmp_path, monkeypatch):
    """The chart's bars are the table's numbers: speed, and memory's lead figure (CPU: Paddle's host allocator
    peak, not the resident set; GPU: max allocated), each with the planner's prediction beside it."""
    import matplotlib.axes

    cpu = perf.summarize_log(write_log(
        tmp_path / "cpu", [5, 50, 50, 50], strategy="tp2", memory={"peak_mem_allocated_mb": 300.0, "peak_rss_mb": 700.0},
        prediction={"peak_mem_allocated_mb": 310.0, "peak_mem_reserved_mb": None, "tokens_per_card_per_sec": None}),
        1, environment=CPU_ENV)
    gpu = perf.summarize_log(write_log(
        tmp_path / "gpu", [100, 3000, 3000, 3000], strategy="sd8_stage2", device="gpu",
        memory={"peak_mem_allocated_mb": 30000.0, "peak_mem_reserved_mb": 35000.0},
        prediction={"peak_mem_allocated_mb": 29000.0, "peak_mem_reserved_mb": 36000.0,
                    "tokens_per_card_per_sec": 3100.0}), 1)
    failed = {"name": "bad", "status": "failed", "error": "boom"}
    drawn = []  # (label, heights) of every ax.bar call, in order: speed measured/predicted, memory ditto
    real_bar = matplotlib.axes.Axes.bar

    def recording_bar(self, x, height, *args, **kwargs):
        drawn.append((kwargs.get("label"), [float(h) for h in height]))
        return real_bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    paths = perf.write_reports([cpu, gpu, failed], CPU_ENV, str(tmp_path / "out"), 1)

    table = open(paths["md"]).read()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| llama-tiny")]
    speed_cells, memory_cells = [row[4] for row in rows], [row[7] for row in rows]
    assert speed_cells == ["50.0", "3,000.0 (predicted 3,100.0)"]
    assert memory_cells == ["304 (RSS 704) (predicted 310)", "30,004 / 35,004 (predicted 29,000 / 36,000)"]

    def numbers(cell):  # the measured figure first, then the predicted one (if any)
        values = re.findall(r"[\d,]+\.?\d*", cell)
        measured = float(values[0].replace(",", ""))
        predicted = re.search(r"predicted ([\d,.]+)", cell)
        return measured, float(predicted.group(1).replace(",", "")) if predicted else None

    assert [label for label, _ in drawn] == ["measured", "predicted (planner)"] * 2
    (_, speed), (_, predicted_speed), (_, memory), (_, predicted_memory) = drawn
    assert speed == [numbers(c)[0] for c in speed_cells] + [0.0] == [50.0, 3000.0, 0.0]  # failed: no bar height
    assert predicted_speed == [numbers(c)[1] for c in speed_cells if numbers(c)[1]] == [3100.0]
    assert memory == [numbers(c)[0] for c in memory_cells] + [0.0] == [304.0, 30004.0, 0.0]  # not RSS 704
    assert predicted_memory == [numbers(c)[1] for c in memory_cells] == [310.0, 29000.0]
    series = perf.chart_series([cpu, gpu, failed])
    assert series["memory_title"] == "peak memory -- CPU: host allocator's peak; GPU: max allocated"
    # The table's legend says the same: the allocator's peak leads, the resident set is in parentheses.
    assert "CPU: resident set" not in table and "CPU: Paddle's host allocator (the process's resident set" in table
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # An older log with only the resident set: that is what the chart plots and says.
    old = perf.summarize_log(write_log(tmp_path / "old", [5, 40, 40]), 1, environment=CPU_ENV)
    old_series = perf.chart_series([old])
    assert old_series["memory"] == [1003.0] and old_series["predicted_memory"] == [None]
    assert "resident set" in old_series["memory_title"]


def test_render_table_for_output_dir_and_perf_table_script(tmp_path, capsys):
    directory = write_log(tmp_path / "runs" / "quick", [1, 2, 3, 4, 5])
    text = perf.render_table_for_output_dir(str(directory), warmup_steps=2, environment=CPU_ENV)
    assert "| llama-tiny | 64 | dp | - | 4.0 |" in text
    perf_table = load_script("perf_table")
    assert perf_table.main([str(tmp_path / "runs"), "--warmup", "2", "--cpu-peak-tflops", "0.1",
                            "--out", str(tmp_path / "report")]) == 0
    assert "| llama-tiny | 64 | dp | - | 4.0 |" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "report")) == ["perf_table.csv", "perf_table.md", "perf_table.png"]


# ----------------------------------------------------------------------------- the runner
def test_runner_reads_degrees_and_classifies_failures():
    benchmark = load_script("benchmark")
    degrees = benchmark.read_degrees({"tensor_parallel_degree": 2, "sharding": "stage2", "sharding_parallel_degree": 4})
    assert degrees["nproc"] == 8 and benchmark.strategy_of(degrees) == "tp2sd4_stage2"
    degrees = benchmark.read_degrees({"pipeline_parallel_degree": 4, "tensor_parallel_degree": 2, "sharding": "stage1"},
                                     nproc=16)
    assert degrees["sharding_degree"] == 2 and benchmark.strategy_of(degrees) == "pp4tp2sd2_stage1"
    assert benchmark.read_degrees({})["nproc"] == 1 and benchmark.strategy_of(benchmark.read_degrees({})) == "dp1"
    assert benchmark.strategy_of(benchmark.read_degrees({}, nproc=2)) == "dp2"
    assert benchmark.classify_failure("paddle ResourceExhaustedError: ... Out of memory error on GPU 0") == "OOM"
    assert benchmark.classify_failure("MemoryError") == "OOM"
    assert benchmark.classify_failure("Container rank 0 status failed cmd [...] code -9 log") == "OOM"
    assert benchmark.classify_failure("error: max_steps: set a positive number") == "failed"
    forced = benchmark.forced_arguments(7, "out/x")
    assert forced[forced.index("--max_steps") + 1] == "7" and forced[forced.index("--save_steps") + 1] == "0"
    assert benchmark.extra_arguments({"bf16": True, "recompute_granularity": "full"}) == \
        ["--bf16", "true", "--recompute_granularity", "full"]


def test_runner_end_to_end_on_cpu(tmp_path):
    from llm_pretrain.data import ensure_embedded_corpus

    data = ensure_embedded_corpus(str(tmp_path / "data"))
    common = {"model_name_or_path": "llama-tiny", "tokenizer_name_or_path": data["tokenizer"],
              "input_dir": data["input_dir"], "max_seq_length": 64, "per_device_train_batch_size": 2,
              "learning_rate": 1e-3, "min_learning_rate": 1e-4, "device": "cpu"}
    configs = {"tiny-single": common, "tiny-dp": common,
               "tiny-bad": {**common, "per_device_train_batch_size": 0}}
    for name, values in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(values))
    suite = {"configs": ["tiny-single.json", {"args_file": "tiny-dp.json", "name": "tiny-dp2", "nproc": 2},
                         "tiny-bad.json"], "steps": 6, "warmup": 2, "timeout": 120}
    (tmp_path / "suite.json").write_text(json.dumps(suite))

    out = tmp_path / "bench"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "scripts", "benchmark.py"),
                             "--suite", str(tmp_path / "suite.json"), "--out", str(out)],
                            capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    print(result.stdout[-3000:], result.stderr[-3000:], f"{time.perf_counter() - start:.1f} s")
    assert result.returncode == 1, result.stderr  # one run failed, as intended; the others went on

    records = {r["name"]: r for r in perf.read_jsonl(str(out / "results.jsonl"))}
    assert list(records) == ["tiny-single", "tiny-dp2", "tiny-bad"]
    for name, strategy, world in (("tiny-single", "dp1", 1), ("tiny-dp2", "dp2", 2)):
        r = records[name]
        assert r["status"] == "ok", r.get("error")
        assert r["strategy"] == strategy and r["world_size"] == world and r["seq_length"] == 64
        assert r["steps"] == 6 and r["measured_steps"] == 4
        assert r["tokens_per_card_per_sec"] > 0 and r["peak_rss_mb"] > 0
        assert 0 < r["mfu"] <= 1 and r["tflops_per_card"] > 0
        assert not os.path.exists(out / name / "checkpoint-6")  # nothing saved
    bad = records["tiny-bad"]
    assert bad["status"] == "failed" and "per_device_train_batch_size" in bad["error_summary"]
    assert bad["args_file"] == "tiny-bad.json" and bad["strategy"] == "dp1"

    table = (out / "perf_table.md").read_text()
    assert "| llama-tiny | 64 | dp2 | fp32 |" in table and "**failed**" in table
    assert (out / "perf_table.png").stat().st_size > 0 and (out / "perf_table.csv").is_file()
    assert table in result.stdout
    # The same table again from the recorded results, without re-running.
    assert perf.render_table_for_output_dir(str(out)) == table


def test_what_ran_comes_from_the_built_description(tmp_path):
    built = {"layout": {"world_size": 4, "data_parallel_degree": 1, "tensor_parallel_degree": 1,
                        "pipeline_parallel_degree": 4, "sharding_degree": 1},
             "schedule": {"class": "PipelineParallelWithInterleave", "kind": "interleaved", "virtual_stages": 2,
                          "chunk_layers": [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]},
             "sharding": None, "sequence_parallel": {"enabled": False},
             "recompute": {"full": [0, 1, 2, 3, 4, 5, 6, 7], "pipeline_recompute_interval": 1},
             "precision": {"parameter_dtypes": ["float32"], "autocast": None, "amp_level": None}}
    fields = perf.built_fields(built)
    assert fields["built"] == "interleaved x2 · recompute full (8 layers) · fp32"
    assert fields["schedule"] == "interleaved (PipelineParallelWithInterleave, 2 virtual stages)"
    assert fields["recompute"] == "full: layers 0,1,2,3,4,5,6,7" and fields["sequence_parallel"] is False
    row = perf.table_row({"model": "llama-tiny", "seq_length": 32, "strategy": "pp4vpp2", **fields})
    assert row[2:4] == ["pp4vpp2", "interleaved x2 · recompute full (8 layers) · fp32"]
