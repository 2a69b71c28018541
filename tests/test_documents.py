"""Packed documents that do not attend across their boundaries (reset_attention_mask), positions that
restart in each document (reset_position_ids) and no loss on the end-of-document token's prediction
(eod_mask_loss): Megatron's keys.

The parity here is in one process, for every family: a packed batch with document ids gives, for every
token, the logits (so the per-token losses) of its document run on its own, and the gradient of the
summed per-token losses is the sum of the documents' gradients (within 1e-5, fp32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from models.decoder import CausalLM, document_positions
from parity_utils import (KERNEL_OPTIONS, argv, assert_same_training, assert_stand_ins_ran, base_arguments, run_record,
                          run_single, run_spec, train_records, write_json)
from shared_launches import contribute
from models.registry import ARCHITECTURES
from models.weights import init_weights

FAMILIES = ["llama-tiny", "llama3-tiny", "baichuan-tiny", "qwen-tiny", "qwen2-tiny", "gpt3-tiny", "bloom-tiny",
            "mixtral-tiny", "qwen2-moe-tiny"]
SEQ = 24
# Two samples: three documents of 7, 10 and 7 tokens, and two of 5 and 19.
DOCUMENT_LENGTHS = [[7, 10, 7], [5, 19]]
TOLERANCE = 1e-5


def document_ids_of(lengths_per_sample) -> np.ndarray:
    return np.stack([np.repeat(np.arange(len(lengths)), lengths) for lengths in lengths_per_sample]).astype("int64")


def spans(lengths):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [(int(a), int(a + n)) for a, n in zip(starts, lengths)]


def tiny_model(name: str, **changes):
    config = ARCHITECTURES[name].replace(seq_length=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                         **changes)
    paddle.seed(1)
    model = CausalLM(config)
    init_weights(model, config, seed=3)
    return model, config


def summed_token_losses(logits, labels):
    return F.cross_entropy(logits.astype("float32"), labels.unsqueeze(-1), reduction="none").sum()


def gradients(model) -> dict[str, np.ndarray]:
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters() if p.grad is not None}
    model.clear_gradients()
    return grads


def packed_and_alone(name: str, **changes):
    """(packed logits, packed gradients, per-document logits, summed per-document gradients)."""
    model, config = tiny_model(name, **changes)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, config.vocab_size, size=(len(DOCUMENT_LENGTHS), SEQ + 1)).astype("int64")
    inputs, labels = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(tokens[:, 1:])
    logits = model(inputs, document_ids=paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS)))
    summed_token_losses(logits, labels).backward()
    packed_grads = gradients(model)
    alone_logits, alone_grads = np.zeros(logits.shape, "float32"), {}
    for sample, lengths in enumerate(DOCUMENT_LENGTHS):
        for start, end in spans(lengths):
            one = model(inputs[sample:sample + 1, start:end])
            alone_logits[sample, start:end] = one[0].numpy()
            summed_token_losses(one, labels[sample:sample + 1, start:end]).backward()
            for key, value in gradients(model).items():
                alone_grads[key] = alone_grads.get(key, 0) + value
    return logits.numpy(), packed_grads, alone_logits, alone_grads


def assert_close_gradients(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    worst = max(float(np.abs(got[k] - expected[k]).max()) for k in got)
    assert worst <= TOLERANCE, worst


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_compute_each_document_on_its_own(name):
    """Every family (rotary, ALiBi, learned positions; MoE): same logits per token, same gradients."""
    logits, grads, alone_logits, alone_grads = packed_and_alone(name, reset_position_ids=True)
    assert float(np.abs(logits - alone_logits).max()) <= TOLERANCE
    assert_close_gradients(grads, alone_grads)


def test_without_the_document_mask_later_documents_see_earlier_ones():
    """The mechanism: the same batch without document ids attends across the boundaries (the first
    document of each sample is still its own, the later ones are not)."""
    model, config = tiny_model("llama-tiny")
    tokens = paddle.to_tensor(np.random.default_rng(5).integers(0, config.vocab_size, (2, SEQ)).astype("int64"))
    masked = model(tokens, document_ids=paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS))).numpy()
    unmasked = model(tokens).numpy()
    assert np.abs(masked[0, :7] - unmasked[0, :7]).max() <= TOLERANCE  # the first document: nothing before it
    assert np.abs(masked[0, 7:] - unmasked[0, 7:]).max() > 1e-3
    assert np.abs(masked[1, 5:] - unmasked[1, 5:]).max() > 1e-3


def test_learned_positions_need_the_reset():
    """GPT-3's learned positions: without reset_position_ids a later document is seen at its offset in
    the sample, so its logits are not those of the document on its own; rotary (relative) are."""
    logits, _, alone_logits, _ = packed_and_alone("gpt3-tiny", reset_position_ids=False)
    assert np.abs(logits[0, :7] - alone_logits[0, :7]).max() <= TOLERANCE
    assert np.abs(logits[0, 7:] - alone_logits[0, 7:]).max() > 1e-3


@pytest.mark.parametrize("name", ["llama3-tiny", "gpt3-tiny"])
def test_flashmask_path_computes_each_document_on_its_own(name):
    """use_flash_attention with packed documents: every layer calls Paddle's flashmask_attention (through the
    CPU stand-in of its kernel) with the documents' row indices, and the packed batch gives each document's
    own logits and gradients (LLaMA 3: grouped kv heads, rotary restarting per document; GPT-3: learned
    positions). Wrong or missing row indices let later documents see earlier ones: this fails."""
    from llm_pretrain.cpu import kernel_standins as ks

    ks.install_kernel_standins()
    ks.CALLS.clear()
    try:
        logits, grads, alone_logits, alone_grads = packed_and_alone(name, reset_position_ids=True,
                                                                    use_flash_attention=True)
        calls = dict(ks.CALLS)
    finally:
        ks.uninstall_kernel_standins()
    assert float(np.abs(logits - alone_logits).max()) <= TOLERANCE
    assert_close_gradients(grads, alone_grads)
    layers = ARCHITECTURES[name].num_hidden_layers  # the packed forward only: a document alone has no ids
    assert calls.get("flashmask_attention") == layers and calls.get("flashmask_attention_grad") == layers


def test_document_positions_restart_at_every_document():
    positions = document_positions(paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS))).numpy()
    assert positions[0].tolist() == list(range(7)) + list(range(10)) + list(range(7))
    assert positions[1].tolist() == list(range(5)) + list(range(19))


def stage_chain(name: str):
    """The CausalLM of `name` and its pipeline layers (models/pipeline.py) with its weights, chained in one
    process as fleet's stages run them: each layer gets what the one before returned (the tuple sent between
    stages included)."""
    from models.pipeline import FinalNorm, PipelineDecoderLayer, PipelineEmbeddings, PipelineLMHead

    model, config = tiny_model(name, reset_position_ids=True)
    layers = [PipelineEmbeddings(config)] + [PipelineDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
    layers += [FinalNorm(config), PipelineLMHead(config)]
    prefixes = ["embeddings."] + [f"layers.{i}." for i in range(config.num_hidden_layers)] + ["", "lm_head."]
    state = model.state_dict()
    for layer, prefix in zip(layers, prefixes):
        layer.set_state_dict({key: state[prefix + key] for key in layer.state_dict()})
    return model, config, layers


def test_document_ids_travel_through_the_pipeline_stages():
    """The mechanism under the pipeline: (input_ids, document_ids) enter the first stage, every decoder
    layer passes the ids on to the next (across a stage boundary fleet sends them as it sends the hidden
    states), the final norm drops them; the chained layers give the one-process logits with the masks,
    not those without."""
    model, config, layers = stage_chain("llama-tiny")
    tokens = paddle.to_tensor(np.random.default_rng(5).integers(0, config.vocab_size, (2, SEQ)).astype("int64"))
    ids = paddle.to_tensor(document_ids_of(DOCUMENT_LENGTHS))
    carried = (tokens, ids)
    for layer in layers[:-2]:  # the embedding and the decoder layers
        carried = layer(carried)
        assert isinstance(carried, tuple) and carried[1] is ids  # the ids ride along
    final_norm, head = layers[-2:]
    carried = head(final_norm(carried))
    masked, unmasked = model(tokens, document_ids=ids).numpy(), model(tokens).numpy()
    assert np.abs(carried.numpy() - masked).max() <= TOLERANCE
    assert np.abs(carried.numpy()[:, 5:] - unmasked[:, 5:]).max() > 1e-3


# ---- from the data: boundaries, eod loss, the training run ---------------------------------------------

def test_window_document_ids_from_pieces_and_eod():
    from llm_pretrain.data.documents import window_document_ids

    tokens = np.array([5, 6, 2, 7, 8, 9, 2, 4, 4, 4])
    # Pieces of .idx documents 3 + 7 tokens; eod (2) also ends a document inside the second piece.
    assert window_document_ids([3, 7], tokens, None).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert window_document_ids([3, 7], tokens, 2).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert window_document_ids([10], tokens, 2).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]


def training_datasets(corpus, tmp_path, seq_length=32, samples=16):
    from llm_pretrain.data import build_pretraining_datasets

    return build_pretraining_datasets(corpus["input_dir"], "949,50,1", seq_length, 7, (samples, 0, 0),
                                      data_cache=str(tmp_path / "cache"))[0]


def test_idx_documents_and_eod_tokens_give_the_same_boundaries(embedded_corpus, tmp_path):
    """The embedded corpus appends the tokenizer's end-of-text token to every document (PaddleNLP's
    preparation): the .idx documents' starts are exactly the tokens after an eod, in every window."""
    from llm_pretrain.data.documents import eod_token_of, window_document_ids

    dataset = training_datasets(embedded_corpus, tmp_path)
    eod = eod_token_of(None, embedded_corpus["tokenizer"])
    assert eod is not None
    several = 0
    for i in range(min(len(dataset), 256)):  # the first 256 windows: every case, in well under a second
        tokens, pieces = dataset[i], dataset.document_pieces(i)
        assert int(pieces.sum()) == len(tokens) == 33
        from_idx = window_document_ids(pieces, tokens, None)
        from_eod = window_document_ids([len(tokens)], tokens, eod)
        assert from_idx.tolist() == from_eod.tolist(), i
        several += from_idx[-1] > 0
    assert several > 0  # windows that pack more than one document


def test_host_batch_carries_document_ids_and_eod_mask_loss(embedded_corpus, tmp_path):
    from llm_pretrain.data.documents import DocumentRule, eod_token_of
    from llm_pretrain.run.trainer import BatchPlan

    dataset = training_datasets(embedded_corpus, tmp_path)
    eod = eod_token_of(None, embedded_corpus["tokenizer"])
    plan = BatchPlan(2, 2, 1, 0, DocumentRule(True, eod, True))
    tokens, ids = plan.host_batch(dataset, 0, vocab_size=10**6)
    batches = plan.to_micro_batches((tokens, ids))
    assert [len(b) for b in batches] == [3, 3]
    inputs = np.concatenate([b[0].numpy() for b in batches])
    labels = np.concatenate([b[1].numpy() for b in batches])
    documents = np.concatenate([b[2].numpy() for b in batches])
    assert (inputs == tokens[:, :-1]).all() and (documents == ids[:, :-1]).all()
    # eod_mask_loss (Megatron's rule): no loss where the input is eod, the real label everywhere else; the
    # prediction *of* eod (the last token of a document -> eod) keeps its loss.
    assert (inputs == eod).any()
    assert (labels[inputs == eod] == -100).all()
    assert (labels[inputs != eod] == tokens[:, 1:][inputs != eod]).all()
    assert (labels == eod).any()
    # A new document starts right after each eod.
    assert ((np.diff(documents, axis=1) == 1) == (inputs[:, :-1] == eod)).all()
    without = BatchPlan(2, 2, 1, 0, DocumentRule(True, eod, False)).to_micro_batches((tokens, ids))
    assert (np.concatenate([b[1].numpy() for b in without]) == tokens[:, 1:]).all()


def test_training_with_document_masks(embedded_corpus, tmp_path):
    """One process, every key on: the run trains, its record says what was built, and its losses are not
    the unmasked run's (the masks reach the model)."""
    args_file = write_json(tmp_path / "docs.json", base_arguments(
        embedded_corpus, tmp_path, model_name_or_path="gpt3-tiny", num_hidden_layers=2, max_steps=3, save_steps=0))
    masked, plain = tmp_path / "masked", tmp_path / "plain"
    run_single([argv(args_file, masked, reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True),
                argv(args_file, plain)], tmp_path, "docs")
    record = run_record(masked)["documents"]
    assert record["document_masks"] and record["eod_mask_loss"] and record["reset_position_ids"]
    assert record["eod_token_id"] is not None
    assert run_record(plain)["documents"] is None
    masked_losses = [r["loss"] for r in train_records(masked)]
    plain_losses = [r["loss"] for r in train_records(plain)]
    assert len(masked_losses) == 3 and all(np.isfinite(masked_losses))
    assert abs(masked_losses[0] - plain_losses[0]) > 1e-4


# ---- bad input: one line naming the key, before Paddle --------------------------------------------------

@pytest.mark.parametrize("keys, world_size, device, expected", [
    (dict(reset_attention_mask=True, eod_token_id=100000), 1, "cpu",
     "eod_token_id: 100000 is outside the model's vocabulary"),
    (dict(reset_attention_mask=True, use_flash_attention=True, model_name_or_path="bloom-tiny"), 1, "gpu",
     "reset_attention_mask with use_flash_attention is not supported for bloom"),
    (dict(reset_position_ids=True), 1, "cpu", "reset_position_ids: restarting positions without reset_attention_mask"),
    (dict(reset_attention_mask=True, use_flash_attention=True, pipeline_parallel_degree=2, context_parallel_degree=2,
          gradient_accumulation_steps=2), 4, "gpu", "reset_attention_mask with the pipeline over sep or cp and use_flash_attention is not proven yet"),
    (dict(reset_attention_mask=True, pipeline_parallel_degree=4, virtual_pp_degree=2, sep_parallel_degree=2,
          num_hidden_layers=8, gradient_accumulation_steps=4), 8, "cpu",
     "reset_attention_mask with the pipeline over sep or cp and virtual_pp_degree is not proven yet"),
    (dict(reset_attention_mask=True, reset_position_ids=True, model_name_or_path="gpt3-tiny", continue_training=True,
          max_seq_length=2048), 1, "cpu", "max_seq_length: 2048 exceeds the model's max_position_embeddings 1024"),
])
def test_bad_document_keys_name_the_key(embedded_corpus, keys, world_size, device, expected):
    from llm_pretrain.arguments import parse_arguments
    from llm_pretrain.errors import UsageError
    from llm_pretrain.parallel.layout import check_layout_and_model

    values = {"input_dir": embedded_corpus["input_dir"], "tokenizer_name_or_path": embedded_corpus["tokenizer"],
              "model_name_or_path": "llama-tiny", "max_steps": 5, "max_seq_length": 32, **keys}
    argv = [item for key, value in values.items() for item in (f"--{key}", str(value))]
    with pytest.raises(UsageError) as error:
        args, _ = parse_arguments(argv)
        check_layout_and_model(args, world_size, device)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_bad_eod_token_is_one_line_exit_2_before_paddle(embedded_corpus, tmp_path):
    import subprocess
    import sys

    from parity_utils import RUN_PRETRAIN

    result = subprocess.run([sys.executable, str(RUN_PRETRAIN), "--input_dir", embedded_corpus["input_dir"],
                             "--tokenizer_name_or_path", embedded_corpus["tokenizer"], "--max_steps", "2",
                             "--reset_attention_mask", "--eod_token_id", "100000", "--device", "cpu",
                             "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.startswith("error: eod_token_id: 100000 is outside")
    assert result.stderr.count("\n") == 1


# ---- layouts: data, tensor + sequence parallelism, sharding (runs in the session's shared launches) -----

DOCUMENT_KEYS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
LAYOUT_RUNS = {  # launch -> (run name, model, layout keys)
    # dp2-kernels: the GPU branches through the kernel stand-ins (flashmask_attention with the documents' row
    # indices, GQA; fused rope with the positions restarting per document) against the plain path
    "dp2": [("dp2", "gpt3", dict(gradient_accumulation_steps=2)),
            ("dp2-kernels", "llama", dict(gradient_accumulation_steps=2, **KERNEL_OPTIONS)),
            # a mixture of experts, its experts split over the two replicas (the all-to-all carries tokens of
            # every document; the router sees the same tokens as in one process)
            ("dp2-ep2", "mixtral", dict(gradient_accumulation_steps=2, expert_parallel_degree=2))],
    "tp2": [("tp2-sp", "llama", dict(tensor_parallel_degree=2, sequence_parallel=True)),
            # FlashMask's [b, 1, s, 1] row indices for each rank's heads
            ("tp2-sp-kernels", "llama", dict(tensor_parallel_degree=2, sequence_parallel=True, **KERNEL_OPTIONS)),
            ("tp2-sp-recompute", "gpt3", dict(tensor_parallel_degree=2, sequence_parallel=True, recompute=True,
                                              recompute_granularity="core_attn"))],
    "sd2": [("sd2-stage2", "llama", dict(sharding="stage2", gradient_accumulation_steps=2))],
    # 1F1B over 2 stages of one layer each; GPT-3: learned positions, the tied embedding's two copies and
    # fleet's full recompute of a stage's segment (the ids among its inputs)
    "pp2": [("pp2", "llama", dict(pipeline_parallel_degree=2)),
            ("pp2-kernels", "llama", dict(pipeline_parallel_degree=2, **KERNEL_OPTIONS)),  # row indices per stage
            ("gpt3-pp2-recompute", "gpt3", dict(pipeline_parallel_degree=2, recompute=True, pp_recompute_interval=1))],
    # the interleaved schedule (fleet's PipelineParallelWithInterleaveFthenB: 4 micro-batches of 2 on 4 stages of
    # 2 chunks of one layer): the ids pass between the chunks of every stage and back to stage 0's second chunk
    "pp4": [("pp4vpp2", "llama-pp", dict(pipeline_parallel_degree=4, virtual_pp_degree=2))],
}
LAUNCH_PROCESSES = {"pp4": 4}  # the others: 2
# 2 steps (parity.base_arguments' 5 cut, the suite's budget): the second step's loss and grad norm are taken on the
# weights the first update left, so masks that differ from one process's show by then
STEPS = 2


def document_files(work: Path, corpus: dict) -> dict[str, Path]:
    """LLaMA (rotary, two layers; "llama-pp": eight, a chunk of one layer each under pp4 x 2 virtual stages),
    GPT-3 (learned positions) and Mixtral (two layers), every document key on."""
    return {name: write_json(work / f"{name}.json", base_arguments(
        corpus, work, model_name_or_path=f"{model}-tiny", num_hidden_layers=layers, max_steps=STEPS,
        save_steps=STEPS, **DOCUMENT_KEYS))
        for name, model, layers in (("llama", "llama", 2), ("gpt3", "gpt3", 2), ("llama-pp", "llama", 8),
                                    ("mixtral", "mixtral", 2))}


def layout_runs(launch_name: str):
    def make_runs(work: Path, corpus: dict) -> list[dict]:
        files = document_files(work, corpus)
        return [run_spec(name, argv(files[model], work / "runs" / name, **keys))
                for name, model, keys in LAYOUT_RUNS[launch_name]]
    return make_runs


for _launch in LAYOUT_RUNS:
    contribute(_launch, LAUNCH_PROCESSES.get(_launch, 2), "documents", layout_runs(_launch))


@pytest.fixture(scope="module")
def document_references(shared_launches, embedded_corpus) -> Path:
    work = shared_launches.work_dir("documents")
    files = document_files(work, embedded_corpus)
    run_single([argv(files[model], work / "runs" / f"single-{model}") for model in files], work, "single")
    return work / "runs"


@pytest.mark.parametrize("launch_name", sorted(LAYOUT_RUNS))
def test_document_masks_train_like_one_process_under(launch_name, document_references, shared_launches):
    """dp2 (GPT-3; Mixtral with ep2 over the replicas), tp2 + SP (LLaMA; GPT-3 with core_attn recompute), sharding stage 2 (LLaMA), pp2 (1F1B;
    LLaMA, GPT-3 with full recompute), pp4 x 2 virtual stages (interleaved; LLaMA, 8 layers): the losses, grad
    norms and weights of one process with the same document masks (1e-5)."""
    observed = shared_launches.results(launch_name, "documents")
    for name, model, _ in LAYOUT_RUNS[launch_name]:
        run = document_references / name
        print(f"{name} vs single process: {assert_same_training(document_references / f'single-{model}', run, step=STEPS)}")
        assert run_record(run)["documents"]["document_masks"]
        if name.endswith("-kernels"):
            # the flash branch through FlashMask's stand-ins, named so in the run record (built.kernels)
            assert_stand_ins_ran([runs[name] for _, runs in sorted(observed.items())], run,
                                 ("flashmask_attention", "flashmask_attention_grad", "fused_rotary_position_embedding"))
        if "ep2" in name:  # the experts were split over the two ranks (the run record's built experts)
            experts = run_record(run)["built"]["experts"]
            assert experts == {"expert_parallel_degree": 2, "experts_of_rank": [[0, 1, 2, 3], [4, 5, 6, 7]]}, experts
        if "vpp" in name:  # the interleaved schedule did run, chunks of one layer
            schedule = run_record(run)["built"]["schedule"]
            assert schedule["class"] == "PipelineParallelWithInterleaveFthenB" and schedule["virtual_stages"] == 2
