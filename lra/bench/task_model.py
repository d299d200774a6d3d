"""``lra-bench model --task TASK --task-preset PRESET``: the model a task's configuration trains, for
the benchmark to time in place of the layer flags' encoder.

From lra.config.resolve (the same layers lra-run reads): the ModelConfig (layers, width, heads,
FFN, attention width, pooling, positions, head), the optimizer (train.optimizer, weight decay,
gradient clipping; its rate is the schedule's peak, lr_at(warmup_steps): the rate does not change
a step's cost, and a steady one keeps the weights in the range training sees), the task's vocabulary
and classes, and each backend's options for that task (configs/attn/<backend>.yaml and its
``tasks.<task>`` section), under which --attn-opt still wins. The sequence length stays the
benchmark's. ``none`` takes full attention's model with no attention.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

from attentions import is_timing_reference

from ..config import resolve
from ..errors import UserError
from ..run.loop import lr_at
from ..tasks import get_task

# the TrainConfig values a benchmark step uses; the rest (steps, evaluation, ...) mean nothing here
OPTIMIZER_KEYS = ("optimizer", "weight_decay", "grad_clip")


def task_settings(task: str, preset: str, backends: List[str], options: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Settings fields for ``task`` under ``preset``: task, task_preset, model, train, vocab_size,
    num_classes, the layer fields the tables read (layers, width, heads, head_dim, ffn_dim, dropout) and
    attn_options (each backend's options for the task, ``options`` over them)."""
    spec = get_task(task).spec
    if spec.dual or spec.token_level:
        raise UserError(f"--task {task}: its examples are {'pairs of sequences' if spec.dual else 'labelled per token'}; "
                        "lra-bench times tasks of one sequence and one label (listops, text, image, pathfinder, pathx)")
    base = resolve(task, "full", preset)
    merged: Dict[str, Dict[str, Any]] = {}
    for backend in backends:
        values = {} if is_timing_reference(backend) else resolve(task, backend, preset).attn_options
        merged[backend] = {**values, **options.get(backend, {})}
    model, train = base.model, base.train
    return {
        "task": task, "task_preset": preset, "model": dataclasses.asdict(model),
        "train": {**{key: getattr(train, key) for key in OPTIMIZER_KEYS}, "lr": lr_at(max(train.warmup_steps, 1), train)},
        "vocab_size": spec.vocab_size, "num_classes": spec.num_classes, "layers": model.num_layers,
        "width": model.dim, "heads": model.num_heads, "head_dim": (model.qkv_dim or model.dim) // model.num_heads,
        "ffn_dim": model.ffn_dim, "dropout": model.dropout,
        "attn_options": merged,
    }
