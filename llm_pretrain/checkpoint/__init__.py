"""Checkpoints and weights that cross the toolkit's edge.

    checkpointer.py     output_dir/checkpoint-N: save, verify, resume, merge (async_save included)
    dist_checkpoint.py  the layout-free store: every tensor by its single-process name, in slices
    replica_check.py    every copy of a replicated tensor equal on every rank before one copy is stored
    interchange.py      weights from and to PaddleNLP 2.8 directories
    hf_export.py        a checkpoint -> a Hugging Face directory (`llm-export-hf`)
    hf_import.py        a Hugging Face directory -> one of ours, once (`llm-import-hf`; training needs no conversion)

May import: llm_pretrain.arguments, llm_pretrain.errors, models, cpu, data (tokenizer files) and parallel
(the layout a checkpoint was written under). Never run, observe, planner, selfcheck or cli.
"""
