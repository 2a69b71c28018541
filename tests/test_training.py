"""The training spine end to end in one process: learning, metrics, checkpoints and resume, bad input."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import paddle
import pytest

from parity_utils import RUN_PRETRAIN, argv, base_arguments, final_weights, run_single, train_records, write_json


def run_cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PADDLE_TRAINERS_NUM", None)
    return subprocess.run([sys.executable, str(RUN_PRETRAIN), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_tiny_llama_learns_and_reports(embedded_corpus, tmp_path):
    args_file = write_json(tmp_path / "tiny.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, max_seq_length=64, per_device_train_batch_size=8,
        gradient_accumulation_steps=1, max_steps=60, warmup_steps=5, logging_steps=10, save_steps=0,
        do_eval=True, eval_steps=30, eval_iters=2, learning_rate=0.003,
        bf16=True, use_flash_attention=True, device="cpu"))  # CPU on any test device: checks the CPU warnings
    out = tmp_path / "out"
    result = run_cli(args_file, "--output_dir", out)
    assert result.returncode == 0, result.stderr[-3000:]

    records = train_records(out)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert records[-1]["loss"] < records[0]["loss"] - 0.8, [r["loss"] for r in records]  # from ~6.2 (ln 512)
    for record in records:
        assert record["tokens_per_card_per_sec"] > 0 and record["peak_rss_mb"] > 50
        assert record["tflops_per_card"] > 0 and record["grad_norm"] > 0 and record["learning_rate"] > 0
        assert record["global_tokens_per_step"] == 8 * 64
    # After the 5 warmup steps: cosine decay from the peak towards the minimum.
    rates = [r["learning_rate"] for r in records]
    assert 0.003 > rates[0] and all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] >= 0.0003

    with open(out / "train_log.jsonl") as f:
        events = [json.loads(line) for line in f]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [30, 60]
    assert evals[0]["ppl"] == pytest.approx(np.exp(evals[0]["loss"]), rel=1e-6)
    summary = events[-1]
    assert summary["event"] == "summary" and summary["mean_tokens_per_card_per_sec"] > 0
    assert summary["peak_rss_mb"] >= max(r["peak_rss_mb"] for r in records) - 1e-6
    assert os.listdir(out / "visualdl")

    # One parseable log line per logging step, a summary line; one warning per GPU-only option.
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 6 and re.match(r"step 60/60 \| loss [\d.]+ \| lr [\d.e+-]+ \| grad_norm [\d.]+ \| "
                                        r"tokens/card/sec [\d.]+", lines[-1]), lines[-1]
    assert "summary:" in result.stdout
    for key in ("bf16", "use_flash_attention"):
        assert result.stderr.count(f"warning: {key} has no effect on CPU") == 1, result.stderr


def test_resume_is_exact_and_ignores_half_written_checkpoints(embedded_corpus, tmp_path):
    """6 steps straight == 3 steps, stop, resume, 3 steps; debris of an interrupted save is skipped."""
    args_file = write_json(tmp_path / "resume.json", base_arguments(
        embedded_corpus, tmp_path, num_hidden_layers=2, max_steps=6, save_steps=3, save_total_limit=1,
        hidden_dropout_prob=0.1))  # dropout: the RNG state must be restored too
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_single([argv(args_file, straight), argv(args_file, resumed, exit_interval=3)], tmp_path, "first")
    assert sorted(p for p in os.listdir(resumed) if p != ".lock") == ["checkpoint-3", "train_log.jsonl", "visualdl"]
    assert [r["step"] for r in train_records(resumed)] == [1, 2, 3]

    # A crash during a later save leaves a .partial directory, or one without its COMPLETE marker.
    (resumed / "checkpoint-4.partial").mkdir()
    (resumed / "checkpoint-4.partial" / "model_state.tp00_pp00.pdparams").write_bytes(b"garbage")
    (resumed / "checkpoint-5").mkdir()
    (resumed / "checkpoint-5" / "trainer_state.json").write_text("{}")
    run_single([argv(args_file, resumed)], tmp_path, "second")

    ref, got = train_records(straight), train_records(resumed)
    assert [r["step"] for r in got] == list(range(1, 7))
    for key in ("loss", "grad_norm", "learning_rate", "consumed_samples"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    with open(resumed / "train_log.jsonl") as f:
        runs = [json.loads(line) for line in f if '"event": "run"' in line]
    assert runs[-1]["start_step"] == 3
    ref_weights, weights = final_weights(straight, 6), final_weights(resumed, 6)
    assert all(np.array_equal(ref_weights[name], weights[name]) for name in ref_weights)
    # save_total_limit 1 keeps only the newest complete checkpoint; our own .partial debris is
    # cleared, a directory we did not write (no COMPLETE marker) is left alone.
    assert sorted(p for p in os.listdir(resumed) if p.startswith("checkpoint")) == ["checkpoint-5", "checkpoint-6"]


def test_empty_data_is_a_one_line_error(embedded_corpus, tmp_path):
    from llm_pretrain.data import write_documents

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    no_documents = tmp_path / "nodocs"
    no_documents.mkdir()
    write_documents(str(no_documents / "text_document"), [], np.uint16)
    for input_dir, expected in ((empty_dir, "no prefix.bin + prefix.idx"), (no_documents, "")):
        args_file = write_json(tmp_path / "empty.json", base_arguments(embedded_corpus, tmp_path,
                                                                       input_dir=str(input_dir)))
        result = run_cli(args_file, "--output_dir", tmp_path / "out")
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
        assert "input_dir" in result.stderr and str(input_dir) in result.stderr and expected in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("replicas, accumulation", [(2, 2), (4, 1), (2, 1)])
def test_global_batches_read_the_same_samples_at_any_data_parallel_degree(replicas, accumulation):
    """Step k reads samples [k x G, (k + 1) x G) of the split (G the global batch), whatever the
    data-parallel degree, replica r the r-th contiguous slice, micro-batches in order: so a run
    resumed under another data-parallel degree (tests/test_resume_any_layout.py) goes on with the
    samples the first part would have read, in the same order as one process."""
    from llm_pretrain.run.trainer import BatchPlan

    dataset = [np.full(5, i) for i in range(64)]  # sample i holds tokens i
    one = BatchPlan(micro_batch_size=2, accumulation_steps=4, data_replicas=1, data_replica_rank=0)
    micro = one.global_batch_size // (replicas * accumulation)
    plans = [BatchPlan(micro, accumulation, replicas, rank) for rank in range(replicas)]
    assert all(plan.global_batch_size == one.global_batch_size for plan in plans)
    for step in range(3):
        first = step * one.global_batch_size
        expected = list(range(first, first + one.global_batch_size))
        read = [int(s) for plan in plans for s in plan.host_batch(dataset, first, vocab_size=64)[:, 0]]
        assert read == expected, f"step {step + 1} under {replicas} replicas reads {read}, one process {expected}"
        micro_batches = plans[-1].micro_batches(dataset, first, vocab_size=64)
        assert [b[0].numpy()[:, 0].tolist() for b in micro_batches] == \
            [expected[-micro * accumulation:][i * micro:(i + 1) * micro] for i in range(accumulation)]


# ----------------------------------------------------------------------------- per-rank seeds, batches
@pytest.mark.parametrize("degrees", [
    {"tensor_parallel_degree": 2, "data_parallel_degree": 2},
    {"pipeline_parallel_degree": 2, "sharding_degree": 2, "tensor_parallel_degree": 2},
    {"sep_parallel_degree": 2, "tensor_parallel_degree": 2, "data_parallel_degree": 2},
    {"context_parallel_degree": 2, "pipeline_parallel_degree": 2, "sharding_degree": 2},
])
def test_seeds_per_rank_are_paddlenlps(degrees, monkeypatch):
    """trainer.distributed_seeds gives every rank the seeds of paddlenlp/trainer/trainer_utils.py
    _get_distributed_seeds (called here with a topology of the same ranks, the sep rank included: fleet's sep
    group, sep or cp): the global (dropout on replicated activations) seed shared inside a tensor-parallel
    group only, so the sep/cp ranks, which hold other tokens, draw other masks; the local seed per rank."""
    from itertools import product
    from types import SimpleNamespace

    import paddle.distributed
    from paddlenlp.trainer import trainer_utils

    from llm_pretrain.parallel.layout import Layout
    from llm_pretrain.run.trainer import distributed_seeds

    layout = Layout(**degrees)
    sizes = [layout.sharding_degree, layout.data_parallel_degree, layout.pipeline_parallel_degree,
             layout.sequence_group_degree, layout.tensor_parallel_degree]
    layout.world_size = world = int(np.prod(sizes))
    monkeypatch.setattr(paddle.distributed, "get_world_size", lambda *a: world)
    seen = {}
    for sd, dp, pp, sep, tp in product(*map(range, sizes)):
        layout.sharding_rank, layout.data_parallel_rank, layout.sep_parallel_rank = sd, dp, sep
        layout.pipeline_parallel_rank, layout.tensor_parallel_rank = pp, tp
        info = lambda rank, size: SimpleNamespace(rank=rank, size=size)  # noqa: E731
        topo = SimpleNamespace(dp_info=info(dp, sizes[1]), pp_info=info(pp, sizes[2]), mp_info=info(tp, sizes[4]),
                               sep_info=info(sep, sizes[3]), sharding_info=info(sd, sizes[0]))
        ours = distributed_seeds(1234, layout)
        assert ours == tuple(trainer_utils._get_distributed_seeds(1234, topo)), (sd, dp, pp, sep, tp)
        seen[sd, dp, pp, sep, tp] = ours
    assert len({s[1] for s in seen.values()}) == world  # local seeds: one per rank
    for (sd, dp, pp, sep, tp), (global_seed, _, _) in seen.items():  # global: shared by tensor-parallel peers only
        assert all((g == global_seed) == ((s, d, p, q) == (sd, dp, pp, sep))
                   for (s, d, p, q, _), (g, _, _) in seen.items())
    assert distributed_seeds(7, Layout()) == (7, 8, 7)  # one process: as before, paddle.seed(seed)


def test_set_seed_can_run_again_in_one_process():
    """Tests train several runs in one process: the tracker's states are replaced, not refused."""
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker

    from llm_pretrain.run.trainer import set_seed

    for seed in (3, 4, 3):
        set_seed(seed)
        tracker = get_rng_state_tracker()
        assert {"global_seed", "local_seed"} <= set(tracker.states_)
        first = paddle.rand([3]).numpy()
        set_seed(seed)
        assert np.array_equal(paddle.rand([3]).numpy(), first)


def test_batches_reach_the_device_as_plain_copies(embedded_corpus, tmp_path):
    """BatchPrefetcher hands out exactly the micro-batches BatchPlan reads (the next one read ahead on
    its thread), as tensors on the current place, copied synchronously (no pinned staging)."""
    from llm_pretrain.data import build_pretraining_datasets
    from llm_pretrain.run.trainer import BatchPlan, BatchPrefetcher

    train, _, _ = build_pretraining_datasets(input_dir=embedded_corpus["input_dir"], split="949,50,1", seq_length=32,
                                             seed=1, num_samples=(64, 0, 0), data_cache=str(tmp_path / "cache"))
    plan = BatchPlan(2, 2, 2, 1)
    prefetcher = BatchPrefetcher(plan, train, 100000, "cpu")
    try:
        for first, following in ((0, 8), (8, None)):
            got = prefetcher.get(first, following)
            expected = plan.micro_batches(train, first, 100000)
            assert len(got) == 2 and all(g.place.is_cpu_place() for pair in got for g in pair)
            for (x, y), (ex, ey) in zip(got, expected):
                assert np.array_equal(x.numpy(), ex.numpy()) and np.array_equal(y.numpy(), ey.numpy())
    finally:
        prefetcher.close()


def test_a_logged_step_reads_its_values_together():
    """metrics.reduce_for_log: the loss, the mean of the step norms (device tensors or floats) and the
    peak memory come back from one concatenated read (one process: nothing to reduce)."""
    from llm_pretrain.parallel.layout import Layout
    from llm_pretrain.observe.metrics import reduce_for_log

    norms = [paddle.to_tensor(3.0), 5.0]
    loss, norm, memory = reduce_for_log(2.5, norms, {"peak_mem_allocated_mb": 7.0, "peak_rss_mb": 9.0}, Layout())
    assert (loss, norm, memory) == (2.5, 4.0, {"peak_mem_allocated_mb": 7.0, "peak_rss_mb": 9.0})
    assert reduce_for_log(1.0, [None, 2.0], {"peak_mem_allocated_mb": 1.0}, Layout())[1] is None
