"""Run arguments: one JSON file in PaddleNLP's key vocabulary, plus `--key value` overrides.

    python llm_pretrain/run_pretrain.py configs/llama/pretrain-llama_7b-tp2sd4_stage2.json --max_steps 20

Every key of PaddleNLP's `llm/run_pretrain.py` argument files is accepted. Keys
fall in three kinds:

* `Arguments` fields: implemented, with PaddleNLP's meaning.
* `INERT_KEYS`: accepted so that PaddleNLP files parse unchanged, but they do
  not change what this toolkit computes (logging integrations, data-loader
  tuning, export switches). Set to anything but PaddleNLP's default, they
  produce one warning saying so -- never silently ignored.
* anything else: an error naming the key and the nearest known one.

Bad values are `UsageError`s (one line, exit code 2) raised before any
expensive work starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from llm_pretrain.errors import UsageError, closest_matches


def _key(default, help: str, choices: tuple | None = None, minimum: float | None = None):
    """A dataclass field carrying its help text and allowed values."""
    metadata = {"help": help, "choices": choices, "minimum": minimum}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Arguments:
    # ---- model -----------------------------------------------------------------
    model_name_or_path: str = _key(
        "llama-tiny",
        "A built-in architecture name (see models/registry.py) or a local directory with config.json "
        "(and optionally weights to continue from).",
    )
    tokenizer_name_or_path: Optional[str] = _key(
        None, "Local tokenizer (sentencepiece model, tokenizer.json or vocab.json+merges.txt); "
        "defaults to model_name_or_path. Only used to size the vocabulary and to show a decoded sample."
    )
    continue_training: bool = _key(
        False, "Start from the weights stored in model_name_or_path (a local directory) instead of a random init."
    )
    num_hidden_layers: Optional[int] = _key(None, "Override the architecture's number of layers.", minimum=1)
    initializer_range: Optional[float] = _key(None, "Std of the normal weight init; default: the architecture's.", minimum=0)
    hidden_dropout_prob: Optional[float] = _key(None, "Residual/embedding dropout; default: the architecture's.", minimum=0)
    attention_probs_dropout_prob: Optional[float] = _key(None, "Attention dropout; default: the architecture's.", minimum=0)
    fuse_attention_qkv: Optional[bool] = _key(None, "One fused q/k/v projection; default: the architecture's.")
    fuse_attention_ffn: Optional[bool] = _key(None, "One fused gate/up projection; default: the architecture's.")
    router_aux_loss_coef: Optional[float] = _key(
        None, "Mixture of experts: weight of the load-balancing loss; default: the architecture's.", minimum=0)
    router_z_loss_coef: float = _key(0.0, "Mixture of experts: weight of the ST-MoE router z-loss (0: off).", minimum=0)
    moe_capacity_factor: float = _key(
        0.0, "Mixture of experts: each expert takes at most ceil(factor x tokens x top-k / experts) of a "
        "micro-batch's tokens, the rest are dropped; 0: dropless.", minimum=0)
    moe_global_batch_balance: bool = _key(
        False, "Mixture of experts: the load-balancing loss takes the experts' pick frequencies of the global "
        "batch (summed over the data-parallel and sharding ranks), Qwen3's global-batch balancing.")
    seq_aux_loss_coef: Optional[float] = _key(
        None, "DeepSeek-V3: weight of the sequence-wise balance loss (the report's alpha, 0.0001); default: the "
        "architecture's.", minimum=0)
    moe_bias_update_rate: float = _key(
        0.0, "DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every MoE layer's router bias "
        "moves by this x sign(mean load - load) (the report's 0.001); 0: off.", minimum=0)

    # ---- data ------------------------------------------------------------------
    input_dir: Optional[str] = _key(
        None, "Directory of prefix.bin/prefix.idx files, a prefix, or weighted prefixes '0.7 a 0.3 b'."
    )
    split: str = _key("949,50,1", "Train/valid/test split of the documents, e.g. '949,50,1'.")
    max_seq_length: int = _key(1024, "Tokens per training sample.", minimum=1)
    data_impl: str = _key("mmap", "Format of the prepared data.", choices=("mmap",))
    skip_warmup: bool = _key(True, "Skip reading the mmap files once before training.")
    data_cache: Optional[str] = _key(None, "Directory for the cached sample indices (default: next to the data).")
    reset_attention_mask: bool = _key(
        False, "Packed documents: attention stops at document boundaries (the .idx documents, and after every "
        "end-of-document token); Megatron's --reset-attention-mask (llm_pretrain/data/documents.py).")
    reset_position_ids: bool = _key(
        False, "Packed documents: positions restart at 0 in every document (needs reset_attention_mask); "
        "Megatron's --reset-position-ids.")
    eod_mask_loss: bool = _key(
        False, "No loss on the prediction made from an end-of-document token (the next document's first "
        "token); Megatron's --eod-mask-loss.")
    eod_token_id: Optional[int] = _key(
        None, "The end-of-document token id (default: the tokenizer's end-of-text token).", minimum=0)

    # ---- output, logging, checkpoints -----------------------------------------
    output_dir: str = _key("output", "Checkpoints, metrics (train_log.jsonl) and VisualDL logs go here.")
    overwrite_output_dir: bool = _key(False, "Start from scratch even if output_dir holds checkpoints.")
    resume_from_checkpoint: Optional[str] = _key(None, "Resume from this checkpoint directory.")
    logging_steps: int = _key(500, "Log metrics every N optimizer steps.", minimum=1)
    save_steps: int = _key(500, "Save a checkpoint every N optimizer steps (0: never).", minimum=0)
    save_total_limit: Optional[int] = _key(None, "Keep only the newest N checkpoints.", minimum=1)
    last_save_in_hf: bool = _key(
        False, "After the final checkpoint, also export it as a Hugging Face model directory "
        "(output_dir/checkpoint-N-hf: config.json + safetensors, llm_pretrain/checkpoint/hf_export.py; as torchtitan's "
        "checkpoint.last_save_in_hf). Needs save_steps > 0 and a family with a Hugging Face class."
    )
    disable_tqdm: Optional[bool] = _key(None, "No progress bar (default: a bar when stderr is a terminal).")
    async_save: bool = _key(
        False, "Write checkpoints from a background thread while training goes on (host copy of the state "
        "first; at most one save in flight); also set by unified_checkpoint_config 'async_save' (PaddleNLP).")
    unified_checkpoint_config: str = _key(
        "", "PaddleNLP's option string; 'async_save' turns on async_save, its other options have no effect here.")
    hang_timeout_minutes: float = _key(
        0.0, "When no step completes for this long, every rank dumps its Python stacks and the collective it "
        "is in to the log directory and the job ends naming the ranks that did not arrive (0: off).", minimum=0)
    exit_interval: Optional[int] = _key(
        None, "Save a checkpoint and stop after every N-th step; rerun the same command to resume "
        "(for time-limited jobs, as Megatron's --exit-interval).", minimum=1
    )

    check_replicas_interval: int = _key(
        0, "Also check every N steps that each replicated weight and optimizer state is identical on every rank "
        "holding it (one hash per tensor, one all_gather_object; as Megatron's "
        "--check-weight-hash-across-dp-replicas-interval). 0: only at the end of training, where it always runs.",
        minimum=0
    )

    # ---- what to do ------------------------------------------------------------
    do_train: bool = _key(True, "Train (default true: this is a pretraining tool).")
    do_eval: bool = _key(False, "Evaluate on the valid split every eval_steps.")
    do_predict: bool = _key(False, "Evaluate on the test split at the end.")
    eval_steps: Optional[int] = _key(None, "Evaluate every N steps (default: logging_steps).", minimum=1)
    eval_iters: int = _key(10, "Batches per evaluation (PaddleNLP fixes this at 10).", minimum=1)

    # ---- optimization ----------------------------------------------------------
    per_device_train_batch_size: int = _key(8, "Micro-batch size per data-parallel rank.", minimum=1)
    per_device_eval_batch_size: int = _key(8, "Eval batch size per data-parallel rank.", minimum=1)
    gradient_accumulation_steps: int = _key(1, "Micro-batches per optimizer step.", minimum=1)
    max_steps: int = _key(-1, "Optimizer steps to train (required, > 0).")
    learning_rate: float = _key(5e-05, "Peak learning rate.", minimum=0)
    min_learning_rate: float = _key(1e-05, "Learning rate at the end of the decay.", minimum=0)
    lr_scheduler_type: str = _key(
        "cosine", "Decay after warmup; wsd: warmup-stable-decay (held at learning_rate, then the last "
        "wsd_decay_ratio of max_steps decays to min_learning_rate with wsd_decay_style).",
        choices=("cosine", "linear", "constant", "wsd"))
    warmup_steps: int = _key(0, "Linear warmup steps (wins over warmup_ratio when > 0).", minimum=0)
    warmup_ratio: float = _key(0.0, "Warmup as a fraction of max_steps.", minimum=0)
    decay_steps: Optional[int] = _key(None, "Step at which the decay reaches min_learning_rate (default max_steps).", minimum=1)
    wsd_decay_ratio: float = _key(0.1, "wsd: the last fraction of max_steps that decays (the decay starts at step "
                                  "max_steps x (1 - ratio), not rounded).", minimum=0)
    wsd_decay_style: str = _key("1-sqrt", "wsd: the decay's shape; 1-sqrt is 1 - sqrt(progress) (MiniCPM, ERNIE 4.5), "
                                "half_life ERNIE 4.5's default (PaddleFormers' decay_function).",
                                choices=("linear", "cosine", "1-sqrt", "half_life"))
    wsd_decay_start_step: Optional[int] = _key(
        None, "wsd: the step the decay starts from, instead of wsd_decay_ratio (PaddleFormers' lr_scheduler "
        "'wsd:N' sets it to N).", minimum=1)
    weight_decay: float = _key(0.0, "AdamW weight decay (not applied to norms and biases).", minimum=0)
    adam_beta1: float = _key(0.9, "AdamW beta1.", minimum=0)
    adam_beta2: float = _key(0.999, "AdamW beta2.", minimum=0)
    adam_epsilon: float = _key(1e-08, "AdamW epsilon.", minimum=0)
    max_grad_norm: float = _key(1.0, "Global-norm gradient clipping (0: off).", minimum=0)
    optim: str = _key("adamw", "Optimizer.", choices=("adamw",))
    seed: int = _key(42, "Seed of weights, data order and dropout (0 to 4294967295).")
    skip_nan_inf_steps: int = _key(
        0, "Skip the update of up to N consecutive steps whose loss or gradient norm is NaN/Inf (as torchtitan's "
        "skip_nan_inf, counted like Megatron's skipped iterations); 0: stop at the first one with exit code 3.",
        minimum=0)
    loss_spike_factor: float = _key(
        0.0, "A step whose loss is above this factor x the mean of the last loss_spike_window losses is a spike "
        "(the loss is each step's largest over the ranks, agreed in the step's flag reduction); 0: off.", minimum=0)
    loss_spike_window: int = _key(0, "Finite, non-spike losses the spike check averages (at least 2; 0: off).",
                                  minimum=0)
    loss_spike_action: str = _key(
        "warn", "What a spike does: warn (log it), skip (no update, as a skipped non-finite step), rollback "
        "(reload the newest checkpoint and skip the data from it to the spike plus loss_spike_skip_steps), "
        "stop (exit code 3).", choices=("warn", "skip", "rollback", "stop"))
    loss_spike_skip_steps: int = _key(0, "rollback: also skip the data of this many steps after the spike.",
                                      minimum=0)
    skip_data_intervals: Optional[list] = _key(
        None, "PaddleNLP/PaddleFormers' key: [[first, last], ...] global steps (1-based, inclusive) whose "
        "batches are skipped: their samples are consumed, nothing is trained, the step counts.")

    # ---- precision and kernels (GPU only; on CPU: one warning, plain fp32) ----
    bf16: bool = _key(False, "bfloat16 mixed precision (GPU).")
    fp16: bool = _key(False, "float16 mixed precision (GPU).")
    fp16_opt_level: str = _key("O1", "AMP level: O1 (autocast) or O2 (half weights, fp32 master weights).", choices=("O1", "O2"))
    amp_master_grad: bool = _key(False, "Keep fp32 gradients under O2 (GPU).")
    scale_loss: float = _key(32768, "Initial fp16 loss scale (GPU).", minimum=0)
    use_flash_attention: bool = _key(False, "Flash attention kernels (GPU).")
    use_fused_rms_norm: bool = _key(False, "Fused RMSNorm kernel (GPU).")
    use_fused_rope: bool = _key(False, "Fused rotary-embedding kernel (GPU).")
    use_fast_layer_norm: bool = _key(False, "Fast LayerNorm kernel (GPU).")
    device: Optional[str] = _key(None, "cpu or gpu (default: gpu when Paddle has CUDA, else cpu).", choices=(None, "cpu", "gpu"))

    # ---- parallelism -----------------------------------------------------------
    tensor_parallel_degree: int = _key(-1, "Tensor (model) parallel degree; -1 means 1.")
    pipeline_parallel_degree: int = _key(-1, "Pipeline parallel degree; -1 means 1.")
    virtual_pp_degree: int = _key(1, "Virtual pipeline stages per rank (interleaved schedule).", minimum=1)
    sequence_parallel: bool = _key(False, "Sequence parallelism (needs tensor_parallel_degree > 1).")
    sharding: str = _key("", "ZeRO sharding stage: stage1, stage2 or stage3.", choices=("", "stage1", "stage2", "stage3"))
    sharding_parallel_degree: int = _key(-1, "Sharding degree; -1: derived from the world size.")
    sharding_degree: int = _key(-1, "Deprecated PaddleNLP alias of sharding_parallel_degree.")
    tensor_parallel_config: str = _key("", "PaddleNLP tensor-parallel option string.")
    pipeline_parallel_config: str = _key("", "PaddleNLP pipeline-parallel option string.")
    pipeline_layers_per_stage: Optional[list] = _key(
        None, "Decoder layers of each pipeline stage, e.g. [3, 5] (pipeline_parallel_degree entries; under "
        "interleaving pipeline_parallel_degree x virtual_pp_degree entries, virtual stage v of stage s at "
        "position v x pipeline_parallel_degree + s). The first stage also holds the embedding, the last the "
        "final norm and head (Megatron-LM's --decoder-first/last-pipeline-num-layers: give them fewer). "
        "Default: even, or fleet's 'uniform' split when the layers do not divide (as PaddleNLP).")
    sharding_parallel_config: str = _key("", "PaddleNLP sharding option string.")
    distributed_timeout_minutes: Optional[float] = _key(
        None, "GPU: timeout of NCCL collectives, so that a hung rank ends the job (Megatron's "
        "--distributed-timeout-minutes; sets PADDLE_PG_TIMEOUT; default Paddle's 30 minutes).", minimum=0)
    expert_parallel_degree: int = _key(
        -1, "Mixture of experts: experts split over this many data-parallel/sharding ranks (fleet's expert "
        "group); -1 means 1.")
    sep_parallel_degree: int = _key(
        -1, "Segment parallelism (PaddleNLP's, Ulysses-style, on fleet's sep group): the ranks of a group share "
        "samples, each holds 1/sep of every sequence; an all-to-all switches to 1/sep of the heads for attention. "
        "-1 means 1.")
    context_parallel_degree: int = _key(
        -1, "Context parallelism (ring attention, on fleet's sep group): the ranks of a group share samples, each "
        "holds 1/cp of every sequence (chunks i and 2cp-1-i, balanced for the causal mask); key/value blocks pass "
        "around the ring. -1 means 1.")
    elastic: bool = _key(
        False, "Continue on the ranks present: when their number differs from the newest checkpoint's or the "
        "degrees above cannot use them, the preflight picks a layout for them (llm_pretrain/planner/elastic.py) "
        "that keeps the checkpoint's global batch (micro-batch and accumulation change), prints one line and "
        "records it.")
    elastic_keep: Optional[list] = _key(
        None, "elastic: keys held at their value in this file, e.g. [\"tensor_parallel_degree\"]; allowed: "
        "tensor_parallel_degree, pipeline_parallel_degree, virtual_pp_degree, sharding, sep_parallel_degree, "
        "context_parallel_degree, per_device_train_batch_size.")

    # ---- recompute -------------------------------------------------------------
    recompute: bool = _key(False, "Recompute activations in the backward pass.")
    recompute_granularity: str = _key("full", "What to recompute.", choices=("full", "full_attn", "core_attn"))
    no_recompute_layers: Optional[list] = _key(None, "Decoder layer indices excluded from recompute.")
    pp_recompute_interval: int = _key(1, "Under pipeline parallelism, recompute every N-th layer.", minimum=0)

    # ---- data loading ----------------------------------------------------------
    dataloader_num_workers: int = _key(0, "Accepted; samples are memory-mapped slices, read in-process.", minimum=0)
    distributed_dataloader: bool = _key(False, "Accepted; every rank reads its own slice of the memory-mapped data.")

    # ---- derived helpers -------------------------------------------------------
    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_name_or_path or self.model_name_or_path

    @property
    def effective_eval_steps(self) -> int:
        return self.eval_steps or self.logging_steps

    @property
    def effective_warmup_steps(self) -> float:
        # As PaddleNLP's llm/run_pretrain.py: warmup_ratio x max_steps is not rounded (2.5 steps
        # of warmup rise by max_lr / 2.5 per step).
        if self.warmup_steps > 0:
            return self.warmup_steps
        return self.warmup_ratio * self.max_steps

    @property
    def wsd_decay_start(self) -> float:
        """wsd: the step whose rate is still learning_rate, the decay's progress 0."""
        if self.wsd_decay_start_step is not None:
            return self.wsd_decay_start_step
        return self.max_steps * (1 - self.wsd_decay_ratio)


# PaddleNLP keys accepted for compatibility that change nothing here, with
# PaddleNLP's defaults. A different value gets one warning.
INERT_KEYS: dict[str, Any] = {
    "do_export": False,
    "evaluation_strategy": "no",
    "prediction_loss_only": False,
    "eval_accumulation_steps": None,
    "num_train_epochs": 1.0,
    "num_cycles": 0.5,
    "lr_end": 1e-07,
    "power": 1.0,
    "log_on_each_node": True,
    "logging_dir": None,
    "logging_strategy": "steps",
    "logging_first_step": False,
    "save_strategy": "steps",
    "save_on_each_node": False,
    "no_cuda": False,
    "bf16_full_eval": False,
    "fp16_full_eval": False,
    "amp_custom_black_list": None,
    "amp_custom_white_list": None,
    "save_sharded_model": False,
    "load_sharded_model": False,
    "data_parallel_config": "",
    "hybrid_parallel_topo_order": None,
    "minimum_eval_times": None,
    "local_rank": -1,
    "dataloader_drop_last": False,
    "max_evaluate_steps": -1,
    "past_index": -1,
    "run_name": None,
    "remove_unused_columns": True,
    "label_names": None,
    "load_best_model_at_end": False,
    "metric_for_best_model": None,
    "greater_is_better": None,
    "ignore_data_skip": False,
    "report_to": None,
    "wandb_api_key": None,
    "skip_memory_metrics": True,
    "flatten_param_grads": False,
    "lazy_data_processing": True,
    "skip_profile_timer": True,
    "unified_checkpoint": False,
    "to_static": False,
    "ignore_load_lr_and_optim": False,
    "ignore_save_lr_and_optim": False,
    "force_reshard_pp": False,
    "enable_auto_parallel": False,
    "use_expert_parallel": False,
    # llm/run_pretrain.py's own arguments
    "config_name": None,
    "share_folder": False,
    "cache_prefix": None,
    "fuse_sequence_parallel_allreduce": False,
    "recompute_use_reentrant": False,
    "enable_linear_fused_grad_add": False,
    "autotuner_benchmark": False,
    "rope_scaling_factor": 1.0,
    "rope_scaling_type": None,
    "use_fused_dropout_add": False,
    "use_fused_linear": False,
    "lazy": False,
}

FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Arguments)}
# PaddleFormers' ERNIE 4.5 pretraining files (examples/config/pt/eb45_pretrain/*.yaml) spell the schedule
# `lr_scheduler: "wsd:231084"`, `decay_function: "1-sqrt"`, `min_lr: 2.2e-5`. Accepted and translated to
# this toolkit's keys with the meaning PaddleFormers' source gives them (translate_paddleformers_schedule).
PADDLEFORMERS_SCHEDULE_KEYS = {
    "lr_scheduler": "PaddleFormers' spelling: 'wsd' (the decay starts at 0.9 x max_steps), 'wsd:N' (it starts at "
                    "step N) or 'cosine'; sets lr_scheduler_type (and wsd_decay_start_step).",
    "decay_function": "PaddleFormers' spelling of wsd_decay_style: 'half_life' (its default) or '1-sqrt'.",
    "min_lr": "PaddleFormers' spelling of min_learning_rate (the rate the decay ends at; PaddleFormers' "
              "default 0 applies when lr_scheduler is given without it).",
}

KNOWN_KEYS = sorted(set(FIELDS) | set(INERT_KEYS) | set(PADDLEFORMERS_SCHEDULE_KEYS))

_TRUE_STRINGS = {"true", "1", "yes", "y", "on"}
_FALSE_STRINGS = {"false", "0", "no", "n", "off"}


@functools.lru_cache(maxsize=1)
def _type_hints() -> dict[str, Any]:
    # Resolving the string annotations of 100 fields takes ~8 ms; once per process, not once per key given.
    return typing.get_type_hints(Arguments)


def _field_type(name: str) -> tuple[type, bool]:
    """(base type, may be None) of an Arguments field."""
    hint = _type_hints()[name]
    args = typing.get_args(hint)
    if type(None) in args:  # Optional[X]
        base = next(a for a in args if a is not type(None))
        return typing.get_origin(base) or base, True
    return typing.get_origin(hint) or hint, False


def _describe(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)


def _convert(name: str, value: Any, from_command_line: bool, where: str) -> Any:
    """Convert a JSON or command-line value to the field's type, or raise UsageError."""
    base, optional = _field_type(name)
    if from_command_line and isinstance(value, str):
        if optional and value.lower() in ("none", "null"):
            return None
        if name == "elastic_keep" and not value.strip().startswith("["):
            value = value.replace(",", " ").split()  # --elastic_keep tensor_parallel_degree,sharding
        elif base is list:
            try:
                value = json.loads(value) if value.strip().startswith("[") else [int(v) for v in value.replace(",", " ").split()]
            except ValueError:
                raise UsageError(f"{name}: expected a list of integers like '[0,1]' or '0,1', got {value!r} ({where})")
        elif base is not str:
            lowered = value.lower()
            if base is bool and lowered in _TRUE_STRINGS | _FALSE_STRINGS:
                value = lowered in _TRUE_STRINGS
            else:
                try:
                    value = json.loads(value)
                except ValueError:
                    pass  # leave as string: the type check below reports it
    if value is None:
        if optional:
            return None
        raise UsageError(f"{name}: may not be null ({where})")
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise UsageError(f"{name}: expected true/false (or 0/1), got {_describe(value)} ({where})")
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
            raise UsageError(f"{name}: expected an integer, got {_describe(value)} ({where})")
        return int(value)
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UsageError(f"{name}: expected a number, got {_describe(value)} ({where})")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise UsageError(f"{name}: expected a string, got {_describe(value)} ({where})")
        return value
    if name == "skip_data_intervals":
        if not (isinstance(value, list) and all(
                isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in pair) for pair in value)):
            raise UsageError(f"{name}: expected a list of [first step, last step] pairs like [[100, 120]], "
                             f"got {_describe(value)} ({where})")
        return value
    if name == "elastic_keep":
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UsageError(f"{name}: expected a list of key names like [\"tensor_parallel_degree\"], "
                             f"got {_describe(value)} ({where})")
        return value
    if base is list:
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise UsageError(f"{name}: expected a list of integers, got {_describe(value)} ({where})")
        return value
    raise AssertionError(f"unhandled type for {name}")


def _unknown_key_error(key: str, where: str) -> UsageError:
    nearest = closest_matches(key, KNOWN_KEYS, n=1, cutoff=0.5)
    hint = f"; did you mean '{nearest[0]}'?" if nearest else "; see docs/arguments-and-launch.md or --help for the accepted keys"
    return UsageError(f"unknown key '{key}' ({where}){hint}")


def _read_json_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise UsageError(f"argument file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"argument file {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except UnicodeDecodeError:
        raise UsageError(f"argument file {path} is not UTF-8 text")
    if not isinstance(values, dict):
        raise UsageError(f"argument file {path} must hold a JSON object of keys and values")
    return values


def _split_command_line(argv: list[str]) -> list[tuple[str, Any]]:
    """'--key value', '--key=value' and a bare '--flag' (true) into (key, value) pairs."""
    pairs = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise UsageError(f"unexpected command-line argument {token!r}; use '--key value'")
        key = token[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = "true"
            i += 1
        pairs.append((key.replace("-", "_") if key.replace("-", "_") in KNOWN_KEYS else key, value))
    return pairs


def parse_arguments(argv: list[str]) -> tuple[Arguments, list[str]]:
    """Parse `[file.json] [--key value ...]`. Returns the arguments and warnings to show.

    Command-line values override the file's.
    """
    items: list[tuple[str, Any, bool, str]] = []  # key, value, from_command_line, where
    if argv and not argv[0].startswith("--"):
        path = argv[0]
        if not path.endswith(".json"):
            raise UsageError(f"the first argument must be a .json argument file, got {path!r}")
        items += [(k, v, False, f"in {path}") for k, v in _read_json_file(path).items()]
        argv = argv[1:]
    items += [(k, v, True, "on the command line") for k, v in _split_command_line(argv)]

    values: dict[str, Any] = {}
    warnings: list[str] = []
    paddleformers_keys: dict[str, tuple[Any, str]] = {}
    for key, value, from_command_line, where in items:
        if key in PADDLEFORMERS_SCHEDULE_KEYS:
            paddleformers_keys[key] = (value, where)
        elif key in FIELDS:
            values[key] = _convert(key, value, from_command_line, where)
        elif key in INERT_KEYS:
            if from_command_line and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            default = INERT_KEYS[key]
            both_empty = default in (None, "") and value in (None, "")
            if value != default and not both_empty:
                warnings.append(
                    f"{key}={_describe(value)} ({where}) has no effect in llm-pretrain; "
                    "it is accepted so that PaddleNLP argument files parse unchanged"
                )
        else:
            raise _unknown_key_error(key, where)
    translate_paddleformers_schedule(paddleformers_keys, values)
    args = Arguments(**values)
    validate_arguments(args)
    ignored = [option for option in args.unified_checkpoint_config.split() if option != "async_save"]
    if ignored:
        warnings.append(f"unified_checkpoint_config: {' '.join(ignored)} has no effect in llm-pretrain (only "
                        "async_save has); it is accepted so that PaddleNLP argument files parse unchanged")
    return args, warnings


def translate_paddleformers_schedule(given: dict[str, tuple[Any, str]], values: dict[str, Any]) -> None:
    """PaddleFormers' lr_scheduler / decay_function / min_lr into lr_scheduler_type, wsd_decay_start_step,
    wsd_decay_ratio, wsd_decay_style and min_learning_rate (in `values`, the keys given so far).

    The meaning is PaddleFormers' (examples/experiments/ernie_pretrain/ernie/src/trainers/pretraining_trainer.py
    PreTrainingArguments and create_scheduler; the curve in PaddlePaddle/ERNIE
    examples/pre-training/ernie/src/lr_schedulers/wsd_lr.py): "wsd:N" holds the rate below step N
    (num_steady_steps, an absolute step, warmup included) and decays from N to max_steps; plain "wsd" decays
    from 0.9 x max_steps; min_lr is an absolute rate (its default 0.0) and decay_function's default is
    "half_life". Any other lr_scheduler value gives PaddleFormers' cosine. A key given in both spellings
    is an error: no silent winner."""
    if not given:
        return

    def clash(ours: str, theirs: str) -> None:
        if ours in values:
            raise UsageError(f"{theirs} ({given[theirs][1]}) is PaddleFormers' spelling of {ours}, which is given "
                             f"too; give one of them")

    if "lr_scheduler" in given:
        value, where = given["lr_scheduler"]
        clash("lr_scheduler_type", "lr_scheduler")
        kind, _, steady = str(value).partition(":")
        if kind == "cosine" and not steady:
            values["lr_scheduler_type"] = "cosine"
        elif kind == "wsd" and (not steady or steady.isdigit() and int(steady) > 0):
            values["lr_scheduler_type"] = "wsd"
            if steady:
                clash("wsd_decay_start_step", "lr_scheduler")
                values["wsd_decay_start_step"] = int(steady)
            else:
                clash("wsd_decay_ratio", "lr_scheduler")
                values["wsd_decay_ratio"] = 0.1  # num_steady_steps = 0.9 * num_training_steps
            if "decay_function" not in given and "wsd_decay_style" not in values:
                values["wsd_decay_style"] = "half_life"  # PaddleFormers' default decay_function
        else:
            raise UsageError(f"lr_scheduler: {_describe(value)} is not allowed ({where}); allowed (PaddleFormers' "
                             "spelling): \"wsd\", \"wsd:N\" (N the step the decay starts from, N > 0), \"cosine\"")
        if "min_lr" not in given and "min_learning_rate" not in values:
            values["min_learning_rate"] = 0.0  # PaddleFormers' min_lr default
    if "decay_function" in given:
        value, where = given["decay_function"]
        clash("wsd_decay_style", "decay_function")
        if value not in ("half_life", "1-sqrt"):
            raise UsageError(f"decay_function: {_describe(value)} is not allowed ({where}); allowed (PaddleFormers'): "
                             "\"half_life\", \"1-sqrt\"")
        values["wsd_decay_style"] = value
    if "min_lr" in given:
        value, where = given["min_lr"]
        clash("min_learning_rate", "min_lr")
        values["min_learning_rate"] = _convert("min_learning_rate", value, isinstance(value, str), where)


def validate_arguments(args: Arguments) -> None:
    """Checks of single values and of values against each other (no world size needed)."""
    for name, f in FIELDS.items():
        value = getattr(args, name)
        choices, minimum = f.metadata["choices"], f.metadata["minimum"]
        if choices is not None and value not in choices:
            allowed = ", ".join(_describe(c) for c in choices)
            raise UsageError(f"{name}: {_describe(value)} is not allowed; allowed: {allowed}")
        if minimum is not None and value is not None and value < minimum:
            raise UsageError(f"{name}: {_describe(value)} is too small; the minimum is {minimum}")
    if args.do_train and args.max_steps <= 0:
        raise UsageError(f"max_steps: set a positive number of optimizer steps (got {args.max_steps})")
    if args.do_train or args.do_eval or args.do_predict:
        if not args.input_dir:
            raise UsageError("input_dir: required; a directory of prefix.bin/prefix.idx files (see scripts/prepare_data.py)")
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree", "sharding_degree",
                 "sep_parallel_degree", "context_parallel_degree"):
        value = getattr(args, name)
        if value == 0 or value < -1:
            raise UsageError(f"{name}: {value} is not allowed; use a positive degree (or -1 for the default)")
    if not 0 <= args.seed < 2**32:  # np.random.RandomState's range (data order)
        raise UsageError(f"seed: {args.seed} is not allowed; use an integer from 0 to 4294967295")
    if args.warmup_ratio > 1:
        raise UsageError(f"warmup_ratio: {args.warmup_ratio} is not allowed; use a fraction between 0 and 1")
    for name in ("adam_beta1", "adam_beta2"):
        if not getattr(args, name) < 1:
            raise UsageError(f"{name}: {getattr(args, name)} is not allowed; use a value in [0, 1)")
    if args.min_learning_rate > args.learning_rate:
        raise UsageError(
            f"min_learning_rate: {args.min_learning_rate} is larger than learning_rate {args.learning_rate}"
        )
    if args.last_save_in_hf and args.do_train and not args.save_steps:
        raise UsageError("last_save_in_hf: exports the final checkpoint, but save_steps 0 writes none; "
                         "set save_steps > 0")
    if args.bf16 and args.fp16:
        raise UsageError("bf16 and fp16: choose one of them")
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        value = getattr(args, name)
        if value is not None and value >= 1:
            raise UsageError(f"{name}: {value} is not allowed; use a probability in [0, 1)")
    check_resilience_arguments(args)
    check_schedule_arguments(args)
    if args.reset_position_ids and not args.reset_attention_mask:
        raise UsageError("reset_position_ids: restarting positions without reset_attention_mask is not supported; "
                         "set reset_attention_mask true too")
    check_elastic_arguments(args)
    if args.no_recompute_layers is not None and any(i < 0 for i in args.no_recompute_layers):
        raise UsageError(f"no_recompute_layers: layer indices must be >= 0, got {args.no_recompute_layers}")


def check_schedule_arguments(args: Arguments) -> None:
    """The warmup-stable-decay schedule's keys against each other and max_steps."""
    if args.lr_scheduler_type != "wsd":
        return
    if args.decay_steps is not None:
        raise UsageError("decay_steps: not used by lr_scheduler_type wsd, whose decay ends at max_steps; set "
                         "wsd_decay_ratio or wsd_decay_start_step instead")
    if not 0 < args.wsd_decay_ratio <= 1:
        raise UsageError(f"wsd_decay_ratio: {args.wsd_decay_ratio} is not allowed; use a fraction of max_steps "
                         "in (0, 1]")
    if args.do_train and args.max_steps > 0:
        if args.wsd_decay_start_step is not None and args.wsd_decay_start_step >= args.max_steps:
            raise UsageError(f"wsd_decay_start_step: {args.wsd_decay_start_step} is not allowed; the decay must "
                             f"start before max_steps {args.max_steps} (PaddleFormers' lr_scheduler 'wsd:N' sets it)")
        if args.effective_warmup_steps > args.wsd_decay_start:
            raise UsageError(f"warmup_steps: the warmup ({args.effective_warmup_steps:g} steps) ends after the wsd "
                             f"decay starts (step {args.wsd_decay_start:g}); shorten the warmup or the decay")


UNIFIED_CHECKPOINT_OPTIONS = ("skip_save_model_weight", "master_weight_compatible", "async_save",
                              "enable_all_options")  # paddlenlp/trainer/training_args.py:1433-1438


def check_resilience_arguments(args: Arguments) -> None:
    """Loss spikes, skipped data intervals and the checkpoint options (no world size needed)."""
    if args.loss_spike_factor and args.loss_spike_factor <= 1:
        raise UsageError(f"loss_spike_factor: {args.loss_spike_factor} is not allowed; use a factor above 1 "
                         "(e.g. 3), or 0 to turn the spike check off")
    if args.loss_spike_window == 1:
        raise UsageError("loss_spike_window: 1 is not allowed; use a window of at least 2 losses, or 0 to turn "
                         "the spike check off")
    if bool(args.loss_spike_factor) != bool(args.loss_spike_window):
        given, missing = (("loss_spike_factor", "loss_spike_window") if args.loss_spike_factor
                          else ("loss_spike_window", "loss_spike_factor"))
        raise UsageError(f"{missing}: set it too ({given} is set); the spike check needs both, or both 0")
    if args.loss_spike_action == "rollback" and args.loss_spike_factor and not args.save_steps:
        raise UsageError("loss_spike_action: rollback needs checkpoints to roll back to; set save_steps > 0")
    previous = None
    for first, last in sorted(args.skip_data_intervals or []):
        if first < 1 or last < first:
            raise UsageError(f"skip_data_intervals: [{first}, {last}] is not allowed; each interval is [first step, "
                             "last step] with 1 <= first <= last (global steps count from 1)")
        if previous is not None and first <= previous[1]:
            raise UsageError(f"skip_data_intervals: [{previous[0]}, {previous[1]}] and [{first}, {last}] overlap; "
                             "give each step in at most one interval")
        previous = (first, last)
    for option in args.unified_checkpoint_config.split():
        if option not in UNIFIED_CHECKPOINT_OPTIONS:
            raise UsageError(f"unified_checkpoint_config: unknown option {option!r}; allowed (PaddleNLP's): "
                             + ", ".join(UNIFIED_CHECKPOINT_OPTIONS))


# The keys elastic may change, each of which elastic_keep may hold (llm_pretrain/planner/elastic.py).
ELASTIC_KEYS = ("tensor_parallel_degree", "pipeline_parallel_degree", "virtual_pp_degree", "sharding",
                "sep_parallel_degree", "context_parallel_degree", "per_device_train_batch_size")


def check_elastic_arguments(args: Arguments) -> None:
    keep = args.elastic_keep or []
    if not isinstance(keep, list) or not all(isinstance(key, str) for key in keep):
        raise UsageError(f"elastic_keep: expected a list of key names, got {keep!r}")
    for key in keep:
        if key not in ELASTIC_KEYS:
            nearest = closest_matches(key, list(ELASTIC_KEYS), n=1)
            hint = f"did you mean {nearest[0]!r}? " if nearest else ""
            raise UsageError(f"elastic_keep: {key!r} is not a key elastic changes; {hint}allowed: "
                             + ", ".join(ELASTIC_KEYS))
    if keep and not args.elastic:
        raise UsageError("elastic_keep: set elastic true too (elastic_keep only says what elastic must not change)")


def wants_async_save(args: Arguments) -> bool:
    """async_save, or PaddleNLP's unified_checkpoint_config option of the same name."""
    return args.async_save or "async_save" in args.unified_checkpoint_config.split()


def arguments_to_dict(args: Arguments) -> dict:
    return dataclasses.asdict(args)


def format_key_help() -> str:
    lines = []
    for name, f in FIELDS.items():
        default = getattr(Arguments(), name)
        lines.append(f"  --{name} (default {_describe(default)}): {f.metadata['help']}")
    lines += [f"  --{name}: {help}" for name, help in PADDLEFORMERS_SCHEDULE_KEYS.items()]
    lines.append("  Also accepted for PaddleNLP compatibility (no effect): " + ", ".join(sorted(INERT_KEYS)))
    return "\n".join(lines)
