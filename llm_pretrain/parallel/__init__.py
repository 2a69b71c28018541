"""The parallel layout and what fleet is given for it.

    layout.py            whether a layout is valid, decided in one place for the run and the planner
                         (plan_layout, check_strategy, check_layout_and_model); no Paddle
    distributed.py       fleet.init, the hybrid strategy, wrapping model and optimizer for the layout
    precision.py         autocast, O2 and the loss scaler as PaddleNLP 2.8.1's Trainer does them
    optim.py             AdamW and the learning-rate schedule
    expert_optimizer.py  the experts' optimizer path beside fleet's sharding optimizer

May import: llm_pretrain.arguments, llm_pretrain.errors, models, cpu (the CPU compatibility layer) and
data (the tokenizer's vocabulary size). Never run, checkpoint, observe, planner, selfcheck or cli.
"""
