"""The GPU precision and attention wiring, checked on CPU wherever Paddle lets it run there.

One 2-process launch (tests/workers/precision_worker.py, sharding degree 2) trains a tiny LLaMA
3 steps per case with a float32 GradScaler enabled on CPU and an inf gradient injected on rank 1
only at step 2:
  - stage 1 (fleet.distributed_scaler), stages 2 and 3 (GroupShardedScaler): both ranks skip
    step 2, the LR schedule does not advance, the scale halves on both, the weights stay equal
    on both ranks and equal across the three stages; the logged grad norm is the unscaled one;
  - an unwrapped scaler (the negative control): the ranks disagree;
  - fleet's master gradients (main_grad) in stages 1 and 2 give the same losses, norms and
    weights as without them, and the gradients really live in main_grad.
The rest runs in this process: scaler kind per layout, amp_master_grad refusals (one-line
errors before fleet.init), the objects Precision.prepare builds per dtype, level and layout, the autocast context and its op lists in train/pipeline/eval, the
attention path (flash kernel with GQA unrepeated and ALiBi as a mask, fused rope arguments,
fused swiglu, rotary tables built once), bf16 bit patterns in export and weight loading.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from launch_utils import launch
from llm_pretrain.parallel.distributed import Layout
from llm_pretrain.errors import UsageError
from llm_pretrain.parallel.precision import AMP_BLACK_LIST, O2_WHITE_LIST, Precision, check_master_grad, loss_scaler_kind
from models.registry import make_config

WORKER = Path(__file__).resolve().parent / "workers" / "precision_worker.py"
TOL = 1e-6


# ----------------------------------------------------------------------------- the 2-process launch
@pytest.fixture(scope="module")
def overflow_runs(tmp_path_factory):
    result = launch(WORKER, 2, log_dir=tmp_path_factory.mktemp("precision"), timeout=240).check()
    ranks = result.results()
    for rank, data in ranks.items():
        assert not data["failures"], f"rank {rank}: {data['failures']}"
    return {rank: data["results"] for rank, data in ranks.items()}


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(np.array(a[k]) - np.array(b[k])))) for k in a)


@pytest.mark.parametrize("case, kind, unscale", [
    ("stage1", "distributed", "distributed_scaler"),
    ("stage2", "group_sharded", "GroupShardedScaler"),
    ("stage3", "group_sharded", "GroupShardedScaler"),
])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(overflow_runs, case, kind, unscale):
    r0, r1 = overflow_runs[0][case], overflow_runs[1][case]
    for r in (r0, r1):
        assert r["kind"] == kind and r["unscale"].startswith(unscale)  # the wrapper the layout selected
        assert r["stepped"] == [True, False, True]  # step 2 skipped on BOTH ranks (inf only on rank 1)
        assert r["last_epoch"] == [1, 1, 2]  # the LR schedule did not advance at the skipped step
        assert r["scale"] == [1024.0, 512.0, 512.0]  # the same loss scale on both ranks
        assert r["norms"][1] == "nan" and np.isfinite(r["norms"][2])
    assert _max_weight_diff(r0["weights"], r1["weights"]) == 0.0  # replicas identical
    # The same training whatever the stage (stage 1 is the reference).
    ref = overflow_runs[0]["stage1"]
    assert _max_weight_diff(r0["weights"], ref["weights"]) < TOL
    # The logged norm is the unscaled one: the same as a float32 run without any scaler (not x1024).
    assert abs(r0["norms"][0] - overflow_runs[0]["fp32_stage1"]["norms"][0]) < TOL


def test_unwrapped_scaler_lets_ranks_disagree(overflow_runs):
    """The negative control: without the cross-rank check, only rank 1 skips step 2."""
    r0, r1 = overflow_runs[0]["plain_stage1"], overflow_runs[1]["plain_stage1"]
    assert r0["unscale"].startswith("AmpScaler")
    assert r0["stepped"][1] is True and r1["stepped"][1] is False
    assert r0["last_epoch"] != r1["last_epoch"]


@pytest.mark.parametrize("stage", [1, 2])
def test_master_grads_train_like_plain_gradients(overflow_runs, stage):
    for rank in (0, 1):
        plain, master = overflow_runs[rank][f"fp32_stage{stage}"], overflow_runs[rank][f"master_grad_stage{stage}"]
        # Every parameter has fleet's main_grad hook and gradients live there (stage 2 frees the
        # main_grad of the parameters another rank owns after the step).
        assert master["params_with_main_grad_hook"] == master["params"] > 0 and master["params_with_main_grad"] > 0
        assert plain["params_with_main_grad_hook"] == plain["params_with_main_grad"] == 0
        assert np.max(np.abs(np.array(master["losses"]) - plain["losses"])) < TOL
        assert np.max(np.abs(np.array(master["norms"]) - plain["norms"])) < TOL
        assert _max_weight_diff(master["weights"], plain["weights"]) < TOL


def test_differing_replicas_fail_on_cpu_and_are_resynchronized_on_gpu(overflow_runs):
    """llm_pretrain/checkpoint/replica_check.py: a relative difference of 2**-20 on rank 1's copy of a norm weight."""
    r0, r1 = overflow_runs[0]["replica_resync"], overflow_runs[1]["replica_resync"]
    for r in (r0, r1):
        assert r["before"]["identical"] and r["before"]["replica_groups"] > 0
        # Strict (deterministic by construction): the run fails, naming the tensor and the ranks.
        assert "layers.0.input_layernorm.weight" in r["strict"] and "rank(s) [1] differ from rank 0" in r["strict"]
        (entry,) = r["resynchronized"]["resynchronized"]  # only that box differed
        assert entry["tensor"].startswith("layers.0.input_layernorm.weight@") and entry["source_rank"] == 0
        assert 0 < entry["relative_difference"] <= 2**-19 and not r["resynchronized"]["identical"]
        assert r["after"]["identical"]  # bitwise equal again, checked by the strict check
    assert r0["norm"] == r1["norm"]  # rank 1 took rank 0's copy


# ----------------------------------------------------------------------------- scaler kind, refusals
def _layout(**degrees) -> Layout:
    layout = Layout(**degrees)
    layout.world_size = (layout.data_parallel_degree * layout.tensor_parallel_degree
                         * layout.pipeline_parallel_degree * layout.sharding_degree * layout.sequence_group_degree)
    return layout


@pytest.mark.parametrize("degrees, kind", [
    ({}, "local"),
    ({"data_parallel_degree": 2}, "distributed"),
    ({"tensor_parallel_degree": 2}, "distributed"),
    ({"pipeline_parallel_degree": 2}, "distributed"),
    ({"sharding_degree": 2, "sharding_stage": 1}, "distributed"),
    ({"sharding_degree": 2, "sharding_stage": 2}, "group_sharded"),
    ({"sharding_degree": 2, "sharding_stage": 3, "data_parallel_degree": 2}, "group_sharded"),
])
def test_scaler_kind_per_layout(degrees, kind):
    assert loss_scaler_kind(_layout(**degrees)) == kind


def _amp_args(**overrides):
    return SimpleNamespace(**{"amp_master_grad": True, "fp16": True, "bf16": False, "fp16_opt_level": "O2",
                              "scale_loss": 1024.0, **overrides})


@pytest.mark.parametrize("degrees, words", [
    ({"data_parallel_degree": 2}, ["pure data parallelism"]),
    ({"sharding_degree": 2, "sharding_stage": 3}, ["stage3"]),
    ({"sharding_degree": 2, "sharding_stage": 2, "data_parallel_degree": 2}, ["stage2", "data_parallel_degree 2"]),
])
def test_unsafe_master_grad_combinations_are_refused(degrees, words):
    with pytest.raises(UsageError) as error:
        check_master_grad(_amp_args(), _layout(**degrees))
    message = str(error.value)
    assert message.startswith("amp_master_grad: ") and "\n" not in message
    assert all(word in message for word in words), message


@pytest.mark.parametrize("degrees", [
    {}, {"tensor_parallel_degree": 2}, {"pipeline_parallel_degree": 2, "data_parallel_degree": 2},
    {"sharding_degree": 2, "sharding_stage": 1, "data_parallel_degree": 2}, {"sharding_degree": 2, "sharding_stage": 2},
    # fleet's hybrid optimizer sums main_grad over the sep group (test_long_context::test_sep2_mechanism)
    {"sep_parallel_degree": 2}, {"context_parallel_degree": 2}, {"sep_parallel_degree": 2, "data_parallel_degree": 2},
])
def test_safe_master_grad_combinations_are_accepted(degrees):
    check_master_grad(_amp_args(), _layout(**degrees))
    check_master_grad(_amp_args(fp16_opt_level="O1"), _layout(data_parallel_degree=2))  # O1: nothing to keep


def test_master_grad_refusal_comes_before_fleet_init(tmp_path, monkeypatch):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.run_pretrain import run as train  # the preflight, then the loop (as the command)
    from parity_utils import base_arguments, write_json

    no_data = {"tokenizer": "facebook/llama-7b", "input_dir": str(tmp_path)}  # a hub name; refused before data checks
    args_file = write_json(tmp_path / "args.json", base_arguments(
        no_data, tmp_path, bf16=True, fp16_opt_level="O2", amp_master_grad=True))
    args, warnings = parse_arguments([str(args_file), "--output_dir", str(tmp_path / "out")])
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")  # pure data parallelism over 2 processes
    with pytest.raises(UsageError, match="amp_master_grad: not supported with pure data parallelism"):
        train(args, warnings)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- autocast
def _gpu_precision(level: str, dtype: str = "bf16") -> Precision:
    """Precision as on a GPU (the device only decides the dtype; nothing here runs a GPU kernel)."""
    return Precision(SimpleNamespace(bf16=dtype == "bf16", fp16=dtype == "fp16", fp16_opt_level=level,
                                     amp_master_grad=False, scale_loss=1024.0), "gpu")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_autocast_uses_paddlenlps_op_lists(level, monkeypatch):
    calls = []
    real = paddle.amp.auto_cast
    monkeypatch.setattr(paddle.amp, "auto_cast", lambda *a, **k: calls.append(k) or real(*a, **k))
    precision = _gpu_precision(level)
    tracer = paddle.base.framework._dygraph_tracer()
    with pytest.warns(UserWarning), precision.autocast():  # on CPU Paddle warns and casts nothing
        white, black = tracer._get_amp_op_list()
    assert calls[0]["level"] == level and calls[0]["dtype"] == "bfloat16"
    assert set(AMP_BLACK_LIST) <= set(black)
    assert set(O2_WHITE_LIST) <= set(white) if level == "O2" else not set(O2_WHITE_LIST) & set(calls[0]["custom_white_list"])
    assert "lookup_table_v2" not in black or level == "O1"


@pytest.mark.parametrize("dtype, level, master_grad, degrees", [
    ("fp16", "O2", True, {}),                              # one process: fleet's main_grad hooks too
    ("fp16", "O2", True, {"tensor_parallel_degree": 2}),   # distributed: fleet's main_grad hooks instead
    ("bf16", "O2", False, {"sharding_degree": 2, "sharding_stage": 2}),
    ("bf16", "O1", True, {}),                              # O1: nothing decorated, no master grads
])
def test_prepare_builds_paddlenlps_amp_objects(dtype, level, master_grad, degrees, monkeypatch):
    """Precision.prepare on a GPU, with the GPU-only constructors recorded: which objects are built
    with which options (paddlenlp/trainer/trainer.py _wrap_amp_model / _wrap_model)."""
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils import mix_precision_utils

    import llm_pretrain.parallel.precision as precision_module

    calls = {}
    monkeypatch.setattr(paddle.amp, "decorate", lambda **k: calls.setdefault("decorate", k) and (k["models"], "O2-opt"))
    monkeypatch.setattr(precision_module, "keep_master_grads",
                        lambda model, optimizer, dtype: calls.setdefault("master_grads", (optimizer, dtype)) and "mg-opt")
    monkeypatch.setattr(paddle.amp, "GradScaler", lambda **k: calls.setdefault("scaler", k) and SimpleNamespace())
    monkeypatch.setattr(mix_precision_utils, "MixPrecisionScaler", lambda s: calls.setdefault("mp_scaler", s))
    monkeypatch.setattr(fleet, "distributed_scaler", lambda s: calls.setdefault("distributed_scaler", s) and s)
    layout = _layout(**degrees)
    args = SimpleNamespace(bf16=dtype == "bf16", fp16=dtype == "fp16", fp16_opt_level=level,
                           amp_master_grad=master_grad, scale_loss=32768.0)
    precision = Precision(args, "gpu")
    model, optimizer = precision.prepare("model", "opt", layout)
    half = {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    assert model == "model"
    if level == "O1":
        assert "decorate" not in calls and "master_grads" not in calls and optimizer == "opt"
    else:
        # decorate's own master_grad is never used (it breaks gradient accumulation, see below).
        assert {k: calls["decorate"][k] for k in ("level", "dtype", "master_weight", "master_grad")} == {
            "level": "O2", "dtype": half, "master_weight": True, "master_grad": False}
        fleet_master_grads = master_grad
        assert calls.get("master_grads") == (("O2-opt", half) if fleet_master_grads else None)
        assert optimizer == ("mg-opt" if fleet_master_grads else "O2-opt")
    if dtype == "fp16":
        assert calls["scaler"] == {"init_loss_scaling": 32768.0}
        assert ("mp_scaler" in calls) == master_grad
        assert ("distributed_scaler" in calls) == layout.distributed
        assert precision.scaler is not None and precision.scaler_kind == loss_scaler_kind(layout)
    else:
        assert "scaler" not in calls and precision.scaler is None
    assert Precision(args, "cpu").prepare("model", "opt", layout) == ("model", "opt")  # CPU: plain float32


class _RecordingPrecision(Precision):
    """float32 Precision whose autocast records whether the model ran inside it."""

    def __init__(self):
        super().__init__(SimpleNamespace(bf16=False, fp16=False, fp16_opt_level="O1", amp_master_grad=False,
                                         scale_loss=1.0), "cpu")
        self.inside = False

    @contextlib.contextmanager
    def autocast(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


class _FakePipeline(paddle.nn.Layer):
    """Looks like fleet's PipelineParallel to the trainer (has train_batch / eval_batch)."""

    def __init__(self, precision):
        super().__init__()
        self.precision, self.seen = precision, []
        self.w = self.create_parameter([1])
        self.accumulate_steps = 2  # fleet's PipelineParallel attribute, set per evaluation call
        self.config = SimpleNamespace(num_nextn_predict_layers=0)  # the model's (no MTP block to feed)

    def train_batch(self, data, optimizer, scaler=None):
        self.seen.append(("train_batch", self.precision.inside))
        return paddle.to_tensor([1.0])

    def eval_batch(self, data, compute_loss=False):
        self.seen.append(("eval_batch", self.precision.inside))
        return paddle.to_tensor([1.0])


class _FakeModel(paddle.nn.Layer):
    def __init__(self, precision):
        super().__init__()
        self.precision, self.seen = precision, []
        self.w = self.create_parameter([1], default_initializer=paddle.nn.initializer.Constant(1.0))

    def forward(self, input_ids, labels):
        self.seen.append(("forward", self.precision.inside))
        return (self.w * input_ids.astype("float32")).mean()


class _Dataset:
    def __getitem__(self, i):
        return np.arange(5) % 3


@pytest.mark.parametrize("model_class", [_FakeModel, _FakePipeline])
def test_every_forward_runs_under_the_runs_autocast(model_class):
    from llm_pretrain.run.trainer import BatchPlan, evaluate, train_step

    precision = _RecordingPrecision()
    model = model_class(precision)
    optimizer = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    schedule = paddle.optimizer.lr.StepDecay(0.1, step_size=100)
    plan = BatchPlan(micro_batch_size=1, accumulation_steps=2, data_replicas=1, data_replica_rank=0)
    train_step(model, optimizer, schedule, precision, plan.micro_batches(_Dataset(), 0, 8), model.parameters())
    evaluate(model, _Dataset(), plan, iterations=1, vocab_size=8, layout=Layout(), precision=precision,
             pipeline_calls=(1, 2))
    assert model.seen and all(inside for _, inside in model.seen), model.seen
    assert {name for name, _ in model.seen} == ({"forward"} if model_class is _FakeModel
                                                else {"train_batch", "eval_batch"})
    assert schedule.last_epoch == 1


# ----------------------------------------------------------------------------- single-process scaler
def _cpu_grad_scaler(**options):
    from unittest import mock

    grad_scaler = importlib.import_module("paddle.amp.grad_scaler")
    gpu = SimpleNamespace(is_gpu_place=lambda: True)
    with mock.patch.object(grad_scaler, "_dygraph_tracer", lambda: SimpleNamespace(_expected_place=gpu)):
        scaler = paddle.amp.GradScaler(init_loss_scaling=1024.0, **options)
    importlib.import_module("paddle.amp.auto_cast").amp_global_state().amp_dtype = "float16"
    return scaler


def _linear_training():
    """(layer, model, AdamW, LR schedule, float32 precision) of a one-layer regression."""
    paddle.seed(0)
    layer = paddle.nn.Linear(4, 4)
    optimizer = paddle.optimizer.AdamW(0.1, parameters=layer.parameters())
    return layer, _LossModel(layer), optimizer, paddle.optimizer.lr.StepDecay(0.1, step_size=100), _RecordingPrecision()


def test_single_process_scaler_logs_unscaled_norm_and_skips_schedule_on_overflow():
    from llm_pretrain.run.trainer import global_grad_norm, train_step

    def run(scaled: bool, inject: bool):
        layer, model, optimizer, schedule, precision = _linear_training()
        if scaled:
            precision.use_scaler(_cpu_grad_scaler(), Layout())
        hook = layer.weight.register_hook(lambda g: g * float("inf")) if inject else None
        batch = [(paddle.ones([2, 4]), paddle.ones([2, 4]))]
        weight = layer.weight.numpy().copy()
        result = train_step(model, optimizer, schedule, precision, batch, layer.parameters())
        if hook:
            hook.remove()
        return result, schedule, layer.weight.numpy(), weight

    plain, _, _, _ = run(scaled=False, inject=False)
    scaled, schedule, _, _ = run(scaled=True, inject=False)
    assert abs(float(scaled.grad_norm) - float(plain.grad_norm)) < 1e-5 * float(plain.grad_norm)  # unscaled
    assert scaled.optimizer_stepped and schedule.last_epoch == 1
    overflow, schedule, after, before = run(scaled=True, inject=True)
    assert not overflow.optimizer_stepped and schedule.last_epoch == 0
    assert np.array_equal(after, before)
    assert global_grad_norm([]).shape == []


def test_one_process_fp16_skipped_step_leaves_the_scaler_usable():
    """skip_nan_inf_steps with fp16 in one process: a non-finite loss drops the step after the
    scaler's unscale_ ran; the next step must unscale again (Paddle raises "unscale_() has already
    been called" unless the skipped step ended with update(), paddle/amp/grad_scaler.py:368-371)."""
    from llm_pretrain.run.trainer import train_step

    layer, model, optimizer, schedule, precision = _linear_training()
    precision.use_scaler(_cpu_grad_scaler(decr_every_n_nan_or_inf=1), Layout())
    bad = [(paddle.full([2, 4], float("inf")), paddle.ones([2, 4]))]
    good = [(paddle.ones([2, 4]), paddle.ones([2, 4]))]
    before = layer.weight.numpy().copy()
    skipped = train_step(model, optimizer, schedule, precision, bad, layer.parameters())
    assert skipped.nonfinite == "loss" and not skipped.optimizer_stepped
    assert np.array_equal(layer.weight.numpy(), before) and schedule.last_epoch == 0
    assert precision.scaler._scale.numpy().reshape(-1)[0] == 512.0  # the overflow step halved the scale, as GradScaler.update does
    for _ in range(2):  # and the following steps train normally
        result = train_step(model, optimizer, schedule, precision, good, layer.parameters())
        assert result.nonfinite is None and result.optimizer_stepped
    assert schedule.last_epoch == 2 and not np.array_equal(layer.weight.numpy(), before)


class _ReportGpuPlace:
    def is_gpu_place(self):
        return True

    def is_xpu_place(self):
        return False

    def is_custom_place(self):
        return False


class _TracerOnGpu:
    """The real dygraph tracer, except that its expected place says GPU: paddle.amp.decorate and
    auto_cast then cast and hook as on a GPU (paddle/amp/auto_cast.py:955-963), while every kernel
    still runs on the CPU (whose bfloat16 matmul and add kernels exist)."""

    def __init__(self, tracer):
        object.__setattr__(self, "_tracer", tracer)

    def __getattr__(self, name):
        return _ReportGpuPlace() if name == "_expected_place" else getattr(self._tracer, name)

    def __setattr__(self, name, value):
        setattr(self._tracer, name, value)


def test_one_process_o2_master_grad_accumulates_micro_batches(monkeypatch):
    """One process, bf16 O2, amp_master_grad and 2 micro-batches. With paddle.amp.decorate's own
    master_grad, the second backward fails: its final hook made .grad float32 after the first one
    (paddle/amp/auto_cast.py:677-703), and the bfloat16 gradient cannot be added to it. As PaddleNLP
    for one process (trainer.py:1763-1766), fleet's MixPrecisionLayer keeps float32 main_grad instead."""
    auto_cast = importlib.import_module("paddle.amp.auto_cast")
    real_tracer = auto_cast._dygraph_tracer
    monkeypatch.setattr(auto_cast, "_dygraph_tracer", lambda: _TracerOnGpu(real_tracer()))
    monkeypatch.setattr(auto_cast, "_is_gpu_bfloat16_supported", lambda: True)

    def gradients(micro_batches: int, master_grad: bool):
        paddle.seed(0)
        layer = paddle.nn.Linear(8, 8)
        optimizer = paddle.optimizer.AdamW(0.1, parameters=layer.parameters())
        precision = Precision(SimpleNamespace(bf16=True, fp16=False, fp16_opt_level="O2",
                                              amp_master_grad=master_grad, scale_loss=1.0), "gpu")
        layer, optimizer = precision.prepare(layer, optimizer, Layout())
        assert layer.weight.dtype == paddle.bfloat16  # O2: half-precision weights
        x = paddle.to_tensor(np.random.RandomState(0).randn(4, 8).astype("float32")).astype("bfloat16")
        for chunk in paddle.split(x, micro_batches):
            with precision.autocast():
                loss = layer(chunk).astype("float32").square().mean()
            precision.backward(loss / micro_batches)
        return {name: (p.main_grad if master_grad else p.grad) for name, p in layer.named_parameters()}

    accumulated, whole = gradients(2, master_grad=True), gradients(1, master_grad=True)
    for name, grad in accumulated.items():
        assert grad.dtype == paddle.float32, name  # float32 gradients beside bfloat16 weights
        # The same gradient as one micro-batch of everything, to bfloat16's precision of the products.
        np.testing.assert_allclose(grad.numpy(), whole[name].numpy(), rtol=2e-2, atol=2e-2)
    # Paddle's own master_grad hook: the failure this replaces.
    paddle.seed(0)
    layer = paddle.nn.Linear(8, 8)
    layer = paddle.amp.decorate(models=layer, level="O2", dtype="bfloat16", master_grad=True)
    for _ in range(2):
        with paddle.amp.auto_cast(True, level="O2", dtype="bfloat16"):
            loss = layer(paddle.ones([2, 8]).astype("bfloat16")).astype("float32").mean()
        if _ == 1:
            with pytest.raises(ValueError, match="does not match"):
                loss.backward()
        else:
            loss.backward()


def test_fp16_loss_scale_and_counters_come_back_on_resume(tmp_path):
    """The GradScaler's state goes into the checkpoint (scaler.pdparams, written by rank 0, listed in
    the manifest) and comes back on resume, as paddlenlp/trainer/trainer.py:2232-2233 / 2532-2535: the
    resumed run goes on with the interrupted run's scale and good/bad step counters. The negative
    control resumes without the scaler (the code before it was saved): scale and counters restart."""
    from llm_pretrain.checkpoint import checkpointer as ckpt
    from llm_pretrain.run.trainer import train_step

    config = _attention_config()
    tokens = np.arange(17) % 64
    batch = [(paddle.to_tensor(tokens[:16].reshape(2, 8)), paddle.to_tensor(tokens[1:].reshape(2, 8)))]

    def build():
        model = _model(config)
        optimizer = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
        precision = _RecordingPrecision()
        precision.use_scaler(_cpu_grad_scaler(decr_every_n_nan_or_inf=2), Layout())  # halves every 2nd overflow
        return model, optimizer, precision

    def train(model, optimizer, precision, overflows):
        schedule = paddle.optimizer.lr.StepDecay(0.1, step_size=100)
        for overflow in overflows:
            weight = model.canonical_named_parameters()[0][1]
            hook = weight.register_hook(lambda g: g * float("inf")) if overflow else None
            result = train_step(model, optimizer, schedule, precision, batch, model.parameters())
            if hook:
                hook.remove()
            assert result.optimizer_stepped is not overflow

    def scaler_state(precision):
        state = precision.scaler.state_dict()
        return {**state, "scale": float(state["scale"][0])}

    model, optimizer, precision = build()
    train(model, optimizer, precision, [False, True, True, False, True])  # the 2nd overflow halved the scale
    saved = scaler_state(precision)
    assert (saved["scale"], saved["incr_count"], saved["decr_count"]) == (512.0, 0, 1)
    trainer_state = {"global_step": 5, "consumed_samples": 10, "layout": {}}
    checkpointer = ckpt.Checkpointer(str(tmp_path), Layout(), save_steps=0, save_total_limit=None)
    path = checkpointer.save(5, model, optimizer, trainer_state, precision.scaler)
    assert ckpt.SCALER_FILE in json.loads((Path(path) / ckpt.MANIFEST).read_text())["files"]
    assert ckpt.verify_checkpoint(path) is None
    train(model, optimizer, precision, [True, False])  # uninterrupted: the pending overflow halves again
    expected = scaler_state(precision)
    assert (expected["scale"], expected["incr_count"], expected["decr_count"]) == (256.0, 1, 0)

    resumed_model, resumed_optimizer, resumed = build()
    assert scaler_state(resumed) != saved  # a fresh scaler starts at 1024 with zero counters
    checkpointer.load(path, resumed_model, resumed_optimizer, resumed.scaler)
    assert scaler_state(resumed) == saved
    train(resumed_model, resumed_optimizer, resumed, [True, False])
    assert scaler_state(resumed) == expected

    control_model, control_optimizer, control = build()
    checkpointer.load(path, control_model, control_optimizer)  # the scaler not restored
    train(control_model, control_optimizer, control, [True, False])
    assert scaler_state(control)["scale"] == 1024.0 and scaler_state(control) != expected

    # Without a scaler (bf16, fp32) nothing is written, and resuming with one keeps its initial state.
    plain = ckpt.Checkpointer(str(tmp_path / "plain"), Layout(), save_steps=0, save_total_limit=None).save(
        5, model, optimizer, trainer_state)
    assert not (Path(plain) / ckpt.SCALER_FILE).exists()
    assert not ckpt.load_scaler_state(plain, control.scaler)


class _LossModel(paddle.nn.Layer):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, y):
        return ((self.layer(x) - y) ** 2).mean()


# ----------------------------------------------------------------------------- attention paths
def _attention_config(family="llama", **extra):
    sizes = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=32, seq_length=8)
    if family == "llama":
        sizes["num_key_value_heads"] = 2
    return make_config(family, **{**sizes, **extra})


def _model(config):
    from models.decoder import CausalLM
    from models.weights import init_weights

    model = CausalLM(config)
    init_weights(model, config, seed=3)
    return model


def _spy(monkeypatch, module, name):
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("family", ["llama", "baichuan_alibi", "bloom"])
def test_flash_path_keeps_kv_heads_and_takes_alibi_as_mask(family, monkeypatch):
    """Paddle's sdpa runs on CPU (its math fallback): the flash wiring computes what the plain path does."""
    import models.decoder as decoder

    name = "baichuan" if family == "baichuan_alibi" else family
    extra = {"position_embedding": "alibi"} if family == "baichuan_alibi" else {}
    config = _attention_config(name, **extra)
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 64, (2, 8)))
    expected = _model(config)(ids).numpy()
    calls = _spy(monkeypatch, decoder.F, "scaled_dot_product_attention")
    repeats = _spy(monkeypatch, decoder.paddle, "repeat_interleave")
    flash = _model(config.replace(use_flash_attention=True))
    np.testing.assert_allclose(flash(ids).numpy(), expected, atol=1e-5)
    assert len(calls) == config.num_hidden_layers and not repeats
    (q, k, v), kwargs = calls[0]
    assert k.shape[2] == config.num_key_value_heads and q.shape[2] == config.num_attention_heads
    if config.position_embedding == "alibi":
        assert kwargs["is_causal"] is False and kwargs["attn_mask"].shape == [2, 4, 8, 8]
    else:
        assert kwargs["is_causal"] is True and kwargs["attn_mask"] is None


def test_fused_rope_gets_the_rotate_half_layout(monkeypatch):
    """The fused rope kernel is GPU-only; check what it is given and that a kernel with those
    semantics (use_neox_rotary_style=False: halves of head_dim) computes the plain path's output."""
    import paddle.incubate.nn.functional as incubate_functional
    from models.decoder import apply_rotary

    calls = []

    def fake_fused_rope(q, k, v, sin, cos, position_ids=None, use_neox_rotary_style=True):
        calls.append(use_neox_rotary_style)
        assert not use_neox_rotary_style and v is None and sin.shape == cos.shape == [1, 8, 1, 8]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), None

    monkeypatch.setattr(incubate_functional, "fused_rotary_position_embedding", fake_fused_rope)
    config = _attention_config()
    ids = paddle.to_tensor(np.random.RandomState(1).randint(0, 64, (2, 8)))
    expected = _model(config)(ids).numpy()
    np.testing.assert_allclose(_model(config.replace(use_fused_rope=True))(ids).numpy(), expected, atol=1e-6)
    assert calls == [False] * config.num_hidden_layers


def test_fused_swiglu_matches_silu_times_up(monkeypatch):
    import models.decoder as decoder

    config = _attention_config()
    ids = paddle.to_tensor(np.random.RandomState(2).randint(0, 64, (2, 8)))
    expected = _model(config)(ids).numpy()
    calls = _spy(monkeypatch, decoder.F, "swiglu")  # Paddle's swiglu kernel also exists on CPU
    np.testing.assert_allclose(_model(config.replace(use_fused_swiglu=True))(ids).numpy(), expected, atol=1e-6)
    assert len(calls) == config.num_hidden_layers


def test_rotary_tables_are_built_once(monkeypatch):
    import models.decoder as decoder

    decoder._ROTARY_TABLES.clear()
    calls = _spy(monkeypatch, decoder, "rotary_cos_sin")
    model = _model(_attention_config())
    ids = paddle.to_tensor(np.zeros((1, 8), dtype="int64"))
    model(ids)
    model(ids)
    assert len(calls) == 1  # not once per layer per forward


# ----------------------------------------------------------------------------- bfloat16 on the host
def test_bf16_weights_are_widened_before_arithmetic():
    """numpy holds bfloat16 as uint16 bit patterns: NormHead export and weight loading reinterpret them."""
    from models.dtypes import bfloat16_bits_to_float32
    from models.paddlenlp_interop import _to_numpy
    from models.weights import host_tensor

    values = paddle.to_tensor([[0.75, -2.5], [3.0, 0.0078125]]).astype("bfloat16")
    bits = values.numpy()
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bfloat16_bits_to_float32(bits), values.astype("float32").numpy())
    np.testing.assert_array_equal(_to_numpy(bits), values.astype("float32").numpy())
    np.testing.assert_array_equal(host_tensor(bits, "float32").numpy(), values.astype("float32").numpy())


def test_bf16_norm_head_export_normalizes_values_not_bits():
    from models.paddlenlp_interop import to_paddlenlp_state
    from models.registry import resolve_model

    config, _ = resolve_model("baichuan-tiny")
    config = config.replace(norm_head=True, tie_word_embeddings=False)
    from models.decoder import CausalLM
    from models.weights import init_weights

    model = CausalLM(config)
    init_weights(model, config, seed=1)
    state32 = {name: p.numpy() for name, p in model.named_parameters()}
    state_bf16 = {name: paddle.to_tensor(v).astype("bfloat16").numpy() for name, v in state32.items()}
    head = to_paddlenlp_state(config, state_bf16)["lm_head.weight"]
    expected_head = paddle.to_tensor(state_bf16["lm_head.weight"]).astype("float32").numpy()
    expected_head = expected_head / np.linalg.norm(expected_head, axis=0, keepdims=True)
    exported = head if head.shape == expected_head.shape else head.T
    np.testing.assert_allclose(exported, expected_head, atol=1e-6)


def test_continue_training_loads_on_the_host_and_reads_bf16(tmp_path, monkeypatch):
    from models import weights
    from models.weights import load_weights_file

    config = _attention_config()
    source = _model(config)
    bf16 = {name: p.astype("bfloat16") for name, p in source.named_parameters()}
    paddle.save(bf16, str(tmp_path / "model_state.pdparams"))
    calls = _spy(monkeypatch, weights, "read_paddle_pickle")
    target = _model(config.replace())
    for p in target.parameters():
        p.set_value(paddle.zeros_like(p))
    load_weights_file(target, config, str(tmp_path / "model_state.pdparams"))
    # read once on the host, as numpy arrays (models/weights.py read_paddle_pickle, which runs no code);
    # only each rank's slice goes to the device
    assert len(calls) == 1
    assert all(isinstance(a, np.ndarray) for a in weights.read_paddle_pickle(str(tmp_path / "model_state.pdparams")).values())
    for name, p in target.named_parameters():
        np.testing.assert_array_equal(p.numpy(), bf16[name].astype("float32").numpy())


def test_gpu_model_config_wires_the_fused_kernels(tmp_path):
    """What build_model_config gives the model on a GPU (nothing here runs on one)."""
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.parallel.distributed import plan_layout
    from llm_pretrain.parallel.layout import build_model_config

    def config_for(model, **keys):
        argv = ["--model_name_or_path", model, "--input_dir", str(tmp_path), "--max_steps", "1"]
        for key, value in keys.items():
            argv += [f"--{key}", str(value).lower()]
        args, _ = parse_arguments(argv)
        return build_model_config(args, plan_layout(args, 1), "gpu")

    config, _, notes = config_for("llama-tiny", use_flash_attention=True, use_fused_rope=True,
                                  use_fast_layer_norm=True)
    assert config.use_flash_attention and config.use_fused_rope and config.use_fused_swiglu
    assert not config.use_fast_layer_norm and any("use_fast_layer_norm" in note for note in notes)
    with pytest.raises(UsageError, match="use_fast_layer_norm: needs the fast_ln package"):
        config_for("gpt3-tiny", use_fast_layer_norm=True)  # PaddleNLP's fast_ln op is not installed here
    args, _ = parse_arguments(["--model_name_or_path", "llama-tiny", "--input_dir", str(tmp_path), "--max_steps", "1",
                               "--use_fused_rope", "true"])
    cpu_config, _, _ = build_model_config(args, plan_layout(args, 1), "cpu")
    assert not (cpu_config.use_fused_rope or cpu_config.use_fused_swiglu)


@pytest.mark.parametrize("model", ["mixtral-tiny", "qwen2-moe-tiny"])
def test_moe_output_keeps_the_compute_dtype_under_o2(model, monkeypatch):
    """bf16 O2 (issue 33, finding 3): the mixture of experts returns the dtype of the residual stream it was
    given. Its combine runs ops on the O2 black lists (scatter on Paddle's, reduce_sum on PaddleNLP's: both
    checked here against the tracer's lists inside the run's autocast), which return float32; before the
    cast in models/moe.py the output was float32 and the residual stream stayed float32 from the first MoE
    layer on. Run on CPU under the run's O2 autocast with the tracer's place faked to GPU (as above), on the
    decorated bfloat16 weights; gradients reach every weight in bfloat16."""
    from models.decoder import MLP
    from models.moe import MoE
    from models.registry import ARCHITECTURES

    auto_cast = importlib.import_module("paddle.amp.auto_cast")
    real_tracer = auto_cast._dygraph_tracer
    monkeypatch.setattr(auto_cast, "_dygraph_tracer", lambda: _TracerOnGpu(real_tracer()))
    monkeypatch.setattr(auto_cast, "_is_gpu_bfloat16_supported", lambda: True)
    config = ARCHITECTURES[model].replace(seq_length=16)
    paddle.seed(0)
    moe = MoE(config, MLP)
    optimizer = paddle.optimizer.AdamW(0.1, parameters=moe.parameters())
    precision = Precision(SimpleNamespace(bf16=True, fp16=False, fp16_opt_level="O2", amp_master_grad=False,
                                          scale_loss=1.0), "gpu")
    moe, optimizer = precision.prepare(moe, optimizer, Layout())
    assert {p.dtype for p in moe.parameters()} == {paddle.bfloat16}
    hidden = paddle.randn([2, 16, config.hidden_size]).astype("bfloat16")
    hidden.stop_gradient = False
    paddle.amp.debugging.enable_operator_stats_collection()
    try:
        with precision.autocast():
            out = moe(hidden)
            black = paddle.base.framework._dygraph_tracer()._get_amp_op_list()[1]
    finally:
        ops = set(paddle.base.core.get_low_precision_op_list())  # the op types run since enable_...
        paddle.amp.debugging.disable_operator_stats_collection()
    assert {"scatter", "reduce_sum"} <= ops & set(black)  # why a float32 result comes out of the combine
    assert out.dtype == paddle.bfloat16 and out.shape == hidden.shape
    out.astype("float32").square().mean().backward()
    assert hidden.grad.dtype == paddle.bfloat16
    assert all(p.grad is not None and p.grad.dtype == paddle.bfloat16 for p in moe.parameters())
