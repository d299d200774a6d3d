"""A finished run made ready for analysis: its config, test split and best weights, and its model
rebuilt with attention options changed at inference (only options that keep every parameter)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from ..config import RunConfig
from ..errors import UserError
from ..run.finished import FinishedRun, read_finished
from ..model import LRAModel
from ..tasks import Split, TaskSpec, get_task
from ..tasks.base import quiet_bars
from ..run.setup import pick_device, to_device


@dataclass
class Loaded:
    run: FinishedRun
    # the run's config, with --data-dir applied
    cfg: RunConfig
    spec: TaskSpec
    # the first ``examples`` rows of the test split
    test: Split
    max_len: int
    weights: Dict[str, torch.Tensor]
    device: torch.device
    bf16: bool

    def model(self, options: Optional[Dict[str, Any]] = None) -> LRAModel:
        """The run's model with attention ``options`` over the trained ones, in eval mode, weights not loaded."""
        cfg = self.cfg
        attn_options = {**cfg.attn_options, **(options or {})}
        model = LRAModel(cfg.model, cfg.attn, attn_options, self.spec.vocab_size, self.spec.num_classes,
                         self.max_len, self.spec.dual, self.spec.padded, self.spec.token_level)
        return model.to(self.device).eval()

    def trained(self) -> LRAModel:
        """The run's model with its best weights."""
        model = self.model()
        model.load_state_dict(self.weights)
        return model


def load(path: str, data_dir: Optional[str], examples: Optional[int], quiet: bool = True) -> Loaded:
    """The run in ``path`` and its test split (``examples`` rows, default: as many as its record tested)."""
    run = read_finished(path, f"RUN_DIR {path}")
    cfg = copy.deepcopy(run.cfg)
    if data_dir is not None:
        if not Path(data_dir).is_dir():
            raise UserError(f"--data-dir {data_dir} is not a folder; give the folder that holds the task's files")
        cfg.data.data_dir = data_dir
    weights = run.weights()
    task = get_task(cfg.task)
    with quiet_bars(quiet):
        test = task.load(cfg.data)["test"]
    n = min(len(test), examples or run.record["test_examples"] or len(test))
    device = pick_device(cfg.train.device)
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    loaded = Loaded(run, cfg, task.spec_for(cfg.data), Split(test.tokens[:n], test.lengths[:n], test.labels[:n]),
                    task.max_len(cfg.data), weights, device, bf16)
    problem = parameter_change(loaded.model(), weights)
    if problem:
        raise UserError(f"RUN_DIR {path}: its best_model.pt does not fit the model its config.json builds ({problem})")
    return loaded


def parameter_change(model: torch.nn.Module, weights: Dict[str, torch.Tensor]) -> str:
    """How ``model``'s tensors differ from ``weights`` by name and shape ("" when they match), at most
    two of each kind named."""
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    saved = {name: tuple(t.shape) for name, t in weights.items()}
    parts = []
    extra = [n for n in own if n not in saved]
    missing = [n for n in saved if n not in own]
    reshaped = [f"{n} {list(saved[n])} trained, {list(own[n])} now" for n in own if n in saved and own[n] != saved[n]]
    for what, names in (("new tensors", extra), ("trained tensors gone", missing), ("other shapes", reshaped)):
        if names:
            parts.append(f"{what}: {', '.join(names[:2])}" + (f" and {len(names) - 2} more" if len(names) > 2 else ""))
    return "; ".join(parts)


def batches(split: Split, batch: int, device: torch.device) -> Iterator[Tuple[torch.Tensor, ...]]:
    """(tokens, lengths, labels) of consecutive batches of ``split``, on ``device``."""
    for start in range(0, len(split), batch):
        yield to_device(split, np.arange(start, min(start + batch, len(split))), device)
