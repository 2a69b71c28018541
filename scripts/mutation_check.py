"""Mutation check: switch each parallel feature off on purpose and see whether the tests notice.

    python scripts/mutation_check.py                      # every mutation, then the table
    python scripts/mutation_check.py --only sp_off dp_sync_every_micro_batch
    python scripts/mutation_check.py --out benchmarks/mutation_check.md
    python scripts/mutation_check.py --check              # only: does every edit still apply? (seconds)

For each mutation in MUTATIONS (a one-line source edit that silently disables a mechanism
while the code still runs), the repository's files are copied to a temporary directory,
the edit is applied there (never to this checkout), and the tests that should catch it run
with pytest. "caught" means they failed; "missed" means they passed with the feature off, i.e.
a README mark is not proven. First the same tests run on the unmutated copy ("baseline"):
a mutation counts only if they pass without it.

Not part of the default test command: it runs each test file several times (~45 minutes on
2 cores; test_real_size for stage3_grad_norm_local alone about 6). The last result is in
benchmarks/mutation_check.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

MECHANISMS = "tests/test_mechanisms.py"
TP2 = f"{MECHANISMS}::test_sequence_parallel_and_recompute_under_tp2"
DP2 = f"{MECHANISMS}::test_data_parallel_syncs_once_per_step_and_recompute_under_dp2"
SD2 = f"{MECHANISMS}::test_sharding_stages_and_recompute_under_sd2"
PP4 = f"{MECHANISMS}::test_pipeline_schedules_and_recompute_under_pp4"
LR = "tests/test_lr_schedule.py"
TP4 = "tests/test_gqa_replication.py::test_tp4_sp_with_two_kv_heads_trains_like_one_process_and_keeps_each_ranks_kv_head"
TP4_ALIBI = "tests/test_gqa_replication.py::test_tp4_sp_alibi_takes_each_ranks_slopes"
ACCUMULATION = ("tests/test_accumulation_scaling.py::test_fp32_accumulation_matches_paddlenlp_trainer_and_one_batch",
                "tests/test_accumulation_scaling.py::test_fp16_scaler_accumulation_matches_one_batch")
MOE_PIPELINE = "tests/test_expert_parallel.py::test_moe_under_the_pipeline_trains_like_one_process"
TOKENS_PER_CARD = "tests/test_accumulation_scaling.py::test_tokens_per_card_are_global_tokens_over_cards"
LONG_PP2 = "tests/test_long_context.py::test_pipeline_with_cp2_and_sep2"
SEP_SHARDING = "tests/test_long_context.py::test_sep2_with_tp2_dp2_and_sharding"


@dataclass
class Mutation:
    name: str
    what: str  # the change, in words
    path: str  # file in the repository
    old: str  # exact text, must occur once
    new: str
    tests: tuple[str, ...]  # pytest node ids expected to fail


MUTATIONS = [
    Mutation("sp_off", "`sequence_parallel` forced off in the model config (preflight)", "llm_pretrain/run/preflight.py",
             "sequence_parallel=args.sequence_parallel,", "sequence_parallel=False,", (TP2,)),
    Mutation("sp_hooks_off", "fleet's SP all-reduce hooks not registered", "llm_pretrain/parallel/distributed.py",
             "register_sequence_parallel_allreduce_hooks(model, accumulation_steps,",
             "(lambda *a, **k: None)(model, accumulation_steps,", (TP2,)),
    Mutation("no_virtual_stages", "the pipeline built without virtual stages (1F1B instead of interleaved)",
             "llm_pretrain/run/trainer.py", "CausalLMPipeline(config, layout.virtual_pp_degree,",
             "CausalLMPipeline(config, 1,", (PP4,)),
    Mutation("pp_recompute_interval_0", "pipeline recompute interval 0", "models/pipeline.py",
             "recompute_interval=pp_recompute_interval if full_recompute else 0,", "recompute_interval=0,", (PP4,)),
    Mutation("stage3_as_stage2", "stage 3 run as stage 2 (`level` always \"os_g\")", "llm_pretrain/parallel/distributed.py",
             'level = "os_g" if layout.sharding_stage == 2 else "p_g_os"', 'level = "os_g"', (SD2,)),
    Mutation("no_group_sharding", "group sharding removed: stages 2/3 run as fleet's stage 1",
             "llm_pretrain/parallel/distributed.py", "if layout.sharding_stage in (2, 3):", "if False:", (SD2,)),
    Mutation("stage3_no_slicing", "stage 3 with a threshold no parameter reaches (nothing sliced)",
             "llm_pretrain/parallel/distributed.py", "group_sharded_parallel(model, optimizer, level=level,",
             "group_sharded_parallel(model, optimizer, level=level, segment_size=2**40,",
             (SD2,)),
    Mutation("dp_sync_every_micro_batch", "data parallelism all-reduces after every micro-batch (no no_sync)",
             "llm_pretrain/run/trainer.py",
             'sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()',
             "sync = contextlib.nullcontext()", (DP2,)),
    Mutation("recompute_off", "recompute never applied inside the decoder", "models/decoder.py",
             "return (config.recompute and config.recompute_granularity == granularity",
             "return (False and config.recompute_granularity == granularity", ("tests/test_recompute.py", DP2)),
    Mutation("tied_copy_stale", "the last pipeline stage keeps stale unused copies of the first stage's "
             "embedding parts (GPT-3 positions, Bloom's embedding LayerNorm)", "models/pipeline.py",
             'for unused in ("position_embeddings", "word_embeddings_layernorm"):', "for unused in ():",
             ("tests/test_parallel_parity.py::test_pipeline_parallel",)),
    Mutation("cosine_to_linear", "cosine decay replaced by linear", "llm_pretrain/parallel/optim.py",
             "coefficient = 0.5 * (1.0 + math.cos(math.pi * progress))", "coefficient = 1.0 - progress", (LR,)),
    Mutation("warmup_shifted", "warmup shifted by one step", "llm_pretrain/parallel/optim.py",
             "return learning_rate_at(self.last_epoch + 1,", "return learning_rate_at(self.last_epoch,", (LR,)),
    Mutation("warmup_ratio_rounded", "warmup_ratio x max_steps rounded down (PaddleNLP does not round)",
             "llm_pretrain/arguments.py", "return self.warmup_ratio * self.max_steps",
             "return int(self.warmup_ratio * self.max_steps)", (LR,)),
    # issue 28: what the suite missed, or caught only by chance
    Mutation("kv_head_0", "with fewer kv heads than tensor-parallel ranks, every rank keeps kv head 0 instead of "
             "the one its q heads share", "models/decoder.py",
             "self.kv_head = tp_rank // (tp_degree // config.num_key_value_heads)", "self.kv_head = 0", (TP4,)),
    Mutation("accumulation_division_dropped", "each micro-batch's loss not divided by the number of micro-batches "
             "before backward", "llm_pretrain/run/trainer.py", "precision.backward(loss / len(micro_batches))",
             "precision.backward(loss)", ACCUMULATION),
    Mutation("tokens_global_per_card", "tokens/card/sec reports the global tokens per second (not divided by the "
             "cards)", "llm_pretrain/observe/metrics.py",
             "self.global_tokens_per_step * steps / self.layout.world_size / self._time",
             "self.global_tokens_per_step * steps / self._time", (TOKENS_PER_CARD,)),
    # issue 28: five more mechanisms no test named
    Mutation("sp_gather_seq_major", "sequence parallelism's gather reads the tokens sequence-major ([seq, batch]) "
             "instead of batch-major as they were split", "models/parallel_layers.py",
             "return GatherOp.apply(hidden).reshape([-1, config.tokens_per_rank, hidden.shape[-1]])",
             "return GatherOp.apply(hidden).reshape([config.tokens_per_rank, -1, hidden.shape[-1]]).transpose([1, 0, 2])",
             (TP4,)),
    Mutation("batch_offset_per_replica", "each data replica scales the global batch's first sample by the replica "
             "count (the samples change with the data-parallel degree)", "llm_pretrain/run/trainer.py",
             "start = first_sample + self.data_replica_rank * per_replica",
             "start = first_sample * self.data_replicas + self.data_replica_rank * per_replica",
             ("tests/test_training.py::test_global_batches_read_the_same_samples_at_any_data_parallel_degree",)),
    Mutation("alibi_slopes_rank0", "every tensor-parallel rank takes the ALiBi slopes of rank 0's heads",
             "models/decoder.py", "first = tp_rank * self.num_heads + sep_rank * self.attention_heads",
             "first = sep_rank * self.attention_heads", (TP4_ALIBI,)),
    Mutation("eval_offset_one_late", "the k-th evaluation reads the (k+1)-th run of eval_iters batches of the "
             "validation split", "llm_pretrain/run/trainer.py",
             "return max(step // args.effective_eval_steps - 1, 0) * args.eval_iters",
             "return max(step // args.effective_eval_steps, 0) * args.eval_iters",
             ("tests/test_paddlenlp_files.py::test_eval_and_test_sample_counts_are_paddlenlp_run_pretrains",)),
    # (stage 2's clip is fleet's HybridParallelClipGrad, and a tiny model has no sliced parameter:
    # only stage 3 at real size, parameters above 2**20 elements, takes this path)
    Mutation("stage3_grad_norm_local", "stage 3: the logged grad norm's part from sliced parameters not summed "
             "over the sharding group (each rank reports its own slices)", "llm_pretrain/parallel/distributed.py",
             "dist.all_reduce(sliced, group=clip._group)", "pass",
             ("tests/test_real_size.py::test_layout_matches_one_process_through_resume",)),
    # issue 22: sep / cp under the pipeline
    Mutation("pipeline_without_sep_cp", "the pipeline model built without sep/cp (fleet's sep group still there: "
             "every rank of it computes whole sequences)", "llm_pretrain/run/trainer.py",
             "return CausalLMPipeline(config, layout.virtual_pp_degree,",
             "return CausalLMPipeline(config.replace(sep_parallel_degree=1, context_parallel_degree=1), "
             "layout.virtual_pp_degree,", (LONG_PP2,)),
    Mutation("pipeline_loss_not_gathered", "the pipeline's last stage takes the loss of its own chunk of each "
             "sequence (not gathered over the sep group)", "models/pipeline.py",
             "loss = causal_lm_loss(self.config, logits, labels)",
             "loss = pl.cross_entropy_per_token(self.config, logits, pl.split_segment(self.config, labels)).mean()",
             (LONG_PP2,)),
    Mutation("moe_sep_stats_local", "mixture of experts under sep/cp: each rank's router statistics (and so its "
             "load-balancing and z losses and metrics) not summed over the sep group", "models/moe.py",
             "    if not pl.splits_sequence(config):\n        return stats\n    experts",
             "    if True:\n        return stats\n    experts",
             ("tests/test_long_context.py::test_sep2_mechanism",)),
    Mutation("sep_sum_stage2_off", "sharding stage 2 under sep/cp: the gradients not summed over the sep group "
             "before the step", "llm_pretrain/parallel/distributed.py",
             "            for grad in stage2_owned_gradients(model):\n                dist.all_reduce(grad, group=sep_group)",
             "            for grad in stage2_owned_gradients(model):\n                pass", (SEP_SHARDING,)),
    Mutation("sep_sum_stage3_off", "sharding stage 3 under sep/cp: the gradients not summed over the sep group "
             "before _update_params", "llm_pretrain/parallel/distributed.py",
             "        for grad in stage3_gradients(model):\n            dist.all_reduce(grad, group=sep_group)",
             "        for grad in stage3_gradients(model):\n            pass", (SEP_SHARDING,)),
    # Mixture of experts under the pipeline (models/pipeline.py RouterCarry): a stage that drops the aux loss's
    # gradient of the earlier stages' routers, and router metrics taken from the first stage instead of the last.
    Mutation("moe_pipeline_aux_grad_dropped", "each stage passes the router sums on with a zero gradient: the "
             "earlier stages' routers lose the load-balancing loss's gradient", "models/pipeline.py",
             "hidden = super().forward(hidden)\n", "hidden, sums = super().forward(hidden), sums * 0 + sums.detach()\n",
             (MOE_PIPELINE,)),
    Mutation("moe_metrics_first_stage", "router metrics broadcast from the first pipeline stage (which holds none)",
             "llm_pretrain/observe/metrics.py", "dist.broadcast(packed, src=group.ranks[-1], group=group)",
             "dist.broadcast(packed, src=group.ranks[0], group=group)", (MOE_PIPELINE,)),
    # Qwen3 (issue 34): the q/k norms skipped in the forward; their gradients not summed over the tensor-parallel
    # group (each rank's are partial over its heads).
    Mutation("qwen3_qk_norm_off", "Qwen3's q/k RMSNorm per head not applied", "models/decoder.py",
             "            q, k = self.q_norm(q), self.k_norm(k)\n", "            q, k = q, k\n",
             ("tests/test_qwen3.py::test_q_and_k_norms_are_applied_per_head",)),
    Mutation("qwen3_qk_norm_tp_partial", "the q/k norms' gradients under tensor parallelism not summed over the group",
             "models/parallel_layers.py",
             "        if _tensor_parallel(config):\n            from paddle.distributed.fleet.utils.sequence_parallel_utils "
             "import mark_as_sequence_parallel_parameter\n\n            mark_as_sequence_parallel_parameter(param)\n    "
             "return layer\n\n\nclass RMSNorm",
             "        if False:\n            pass\n    return layer\n\n\nclass RMSNorm",
             ("tests/test_parallel_parity.py::test_tensor_parallel",)),
    Mutation("qwen3_global_batch_balance_off", "moe_global_batch_balance set but each rank's own pick frequencies "
             "used", "models/moe.py", "    if not config.moe_global_batch_balance:\n        return stats\n",
             "    if True:\n        return stats\n",
             ("tests/test_qwen3.py::test_global_batch_balancing_is_one_process_over_the_whole_batch",)),
]


def copy_repository(destination: Path) -> None:
    """The files git knows (tracked and new, not ignored): no outputs, caches or .git."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(mutation: Mutation, repo: Path) -> None:
    path = repo / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"error: mutation {mutation.name}: the text to replace occurs {count} times in "
                         f"{mutation.path} (the code changed; update MUTATIONS): {mutation.old!r}")
    path.write_text(text.replace(mutation.old, mutation.new))


def where_it_applies(mutation: Mutation) -> str:
    """"path:line" of the one place the mutation edits today, or an error line (the code moved on:
    its text is not there exactly once, or a test it names is gone)."""
    text = (REPO_ROOT / mutation.path).read_text()
    count = text.count(mutation.old)
    if count != 1:
        return (f"error: mutation {mutation.name}: the text to replace occurs {count} times in {mutation.path}; "
                "update MUTATIONS")
    for test in mutation.tests:
        file, _, function = test.partition("::")
        if not (REPO_ROOT / file).is_file() or (function and f"def {function}(" not in (REPO_ROOT / file).read_text()):
            return f"error: mutation {mutation.name}: test {test} does not exist; update MUTATIONS"
    return f"{mutation.path}:{text[:text.index(mutation.old)].count(chr(10)) + 1}"


def run_tests(repo: Path, tests: tuple[str, ...], timeout: int) -> tuple[str, float, str]:
    """("passed" | "failed" | "error" | "timeout", seconds, output tail)."""
    env = {k: v for k, v in os.environ.items() if k != "PADDLE_TRAINERS_NUM"}
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                                cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    status = {0: "passed", 1: "failed"}.get(result.returncode, "error")
    return status, time.monotonic() - start, result.stdout + result.stderr


def first_assertion(output: str) -> str:
    """The first `E ...` line pytest printed: why the tests failed."""
    for line in output.splitlines():
        if line.startswith("E ") and line[1:].strip():
            return line[1:].strip()[:160]
    return ""


def check(mutations: list[Mutation], timeout: int, baseline: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as tmp:
        clean = Path(tmp) / "clean"
        copy_repository(clean)
        if baseline:
            tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
            status, seconds, tail = run_tests(clean, tests, timeout * 2)
            print(f"baseline (no mutation): {status} in {seconds:.0f} s", flush=True)
            if status != "passed":
                raise SystemExit(f"error: the tests fail without any mutation; fix them first\n{tail[-3000:]}")
        for mutation in mutations:
            work = Path(tmp) / mutation.name
            shutil.copytree(clean, work)
            apply(mutation, work)
            status, seconds, tail = run_tests(work, mutation.tests, timeout)
            result = {"failed": "caught", "passed": "MISSED"}.get(status, status)
            rows.append({"mutation": mutation, "result": result, "seconds": seconds, "why": first_assertion(tail)})
            print(f"{mutation.name}: {result} ({seconds:.0f} s) by {' '.join(mutation.tests)}: {rows[-1]['why']}",
                  flush=True)
            if result not in ("caught", "MISSED"):
                print(tail[-3000:], flush=True)
            shutil.rmtree(work, ignore_errors=True)
    return rows


def render(rows: list[dict]) -> str:
    caught = sum(r["result"] == "caught" for r in rows)
    lines = ["# Mutation check", "",
             f"`python scripts/mutation_check.py --out benchmarks/mutation_check.md`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: "
             f"**{caught} of {len(rows)} caught**.", "",
             "Each row switches one mechanism off in a temporary copy of the repository (the edit is in "
             "`scripts/mutation_check.py`) and runs the tests named; *caught* means they failed. The same "
             "tests pass without the mutation (baseline).", "",
             "| mutation | change made to the code | tests run | result | first failed assertion | seconds |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        m = row["mutation"]
        tests = ", ".join(f"`{t.split('/')[-1]}`" for t in m.tests)
        why = row["why"].replace("|", "\\|").replace("`", "'")
        lines.append(f"| {m.name} | {m.what} | {tests} | {row['result']} | `{why}` | {row['seconds']:.0f} |"
                     if why else f"| {m.name} | {m.what} | {tests} | {row['result']} | | {row['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--out", help="write the markdown table here (e.g. benchmarks/mutation_check.md)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation's test run")
    parser.add_argument("--skip-baseline", action="store_true", help="do not first run the tests unmutated")
    parser.add_argument("--check", action="store_true",
                        help="only check that every edit applies exactly once and its tests exist, then exit")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [name for name in args.only or [] if name not in known]
    if unknown:
        parser.exit(2, f"error: unknown mutation {', '.join(unknown)}; known: {', '.join(known)}\n")
    mutations = [known[name] for name in args.only] if args.only else MUTATIONS
    places = {mutation.name: where_it_applies(mutation) for mutation in mutations}  # before any long run
    problems = [place for place in places.values() if place.startswith("error: ")]
    if problems:
        parser.exit(2, "\n".join(problems) + "\n")
    if args.check:
        for name, place in places.items():
            print(f"{name}: applies once at {place}")
        return 0
    rows = check(mutations, args.timeout, baseline=not args.skip_baseline)
    table = render(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 0 if all(r["result"] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
