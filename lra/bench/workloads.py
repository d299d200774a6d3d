"""The work one benchmark point times: callables for each mode, built on the point's device.

Attention level: one call of a backend on q, k, v [B, H, N, D]; modes ``forward`` (inference
mode) and ``train`` (forward + backward of a fixed random output gradient). Model level: the MiTA
paper's speed setup, an LRA encoder (lra.model.LRAModel) on random tokens without padding; modes
``forward`` (one inference step) and ``train`` (forward, cross-entropy, backward, AdamW step). A
point with a ``model`` section (``lra-bench model --task``) builds the model of a task's
configuration instead (its ModelConfig, vocabulary and classes) and steps the run's optimizer
(``train``: the trainer's make_optimizer, with its gradient clipping).
GEMM: one large matmul, the rate the hardware allows. On CUDA ``full`` runs with flash=True
(flash-attn when installed, else SDPA restricted to its flash kernel); every backend gets the same dtype.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from attentions import build_attention, build_config, get_attention

from ..config import ModelConfig
from ..model import LRAModel

Modes = Dict[str, Callable[[], None]]
VOCAB = 256
CLASSES = 10


def options_on(backend: str, options: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """The backend's options on ``device``: the baseline, full attention, runs on a flash kernel on
    CUDA (its ``flash`` option: flash-attn when installed, else SDPA's flash backend) unless the
    sweep set it."""
    if backend == "full" and device.type == "cuda":
        return {"flash": True, **options}
    return options


def kernel_of(backend: str, device: torch.device, options: Optional[Dict[str, Any]] = None) -> str:
    """Which implementation a backend runs on in this benchmark (the backend's own answer)."""
    options = options_on(backend, options or {}, device)
    return get_attention(backend).implementation(build_config(backend, options), device)


def attention_module(spec: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The backend of the point, built with max_len = N (Linformer sizes its projections with it)."""
    attn = build_attention(
        spec["backend"], num_heads=spec["heads"], head_dim=spec["head_dim"], max_len=spec["length"],
        **options_on(spec["backend"], spec["attn_options"], device),
    )
    return attn.to(device=device, dtype=dtype)


def attention_modes(
    attn: nn.Module, call: Callable[..., torch.Tensor], spec: Dict[str, Any], queries: int,
    device: torch.device, dtype: torch.dtype,
) -> Modes:
    """Forward and forward+backward of ``call(q, k, v)`` with ``queries`` queries against N keys."""
    b, h, n, d = spec["batch"], spec["heads"], spec["length"], spec["head_dim"]
    gen = torch.Generator(device=device).manual_seed(spec["seed"])

    def rand(length: int) -> torch.Tensor:
        return torch.randn(b, h, length, d, generator=gen, device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(queries), rand(n), rand(n)  # [B, H, S, D], [B, H, N, D] x 2
    grad_out = torch.randn(b, h, queries, d, generator=gen, device=device, dtype=dtype)

    def forward() -> None:
        with torch.inference_mode():
            call(q, k, v)

    def train() -> None:
        call(q, k, v).backward(grad_out)
        for t in (q, k, v):
            t.grad = None
        attn.zero_grad(set_to_none=True)

    return {"forward": forward, "train": train}


def build_model(spec: Dict[str, Any], device: torch.device) -> LRAModel:
    """The paper's encoder: ``layers`` pre-LN blocks of width ``width``, mean pooling, no padding; or,
    with a ``model`` section, that ModelConfig with the task's vocabulary and classes."""
    if spec.get("model"):
        cfg = ModelConfig(**spec["model"])
        vocab, classes = spec["vocab_size"], spec["num_classes"]
    else:
        cfg = ModelConfig(
            num_layers=spec["layers"], dim=spec["width"], num_heads=spec["heads"], ffn_dim=spec["ffn_dim"],
            dropout=spec["dropout"],
        )
        vocab, classes = VOCAB, CLASSES
    model = LRAModel(
        cfg, spec["backend"], options_on(spec["backend"], spec["attn_options"], device), vocab_size=vocab,
        num_classes=classes, max_len=spec["length"], padded=spec.get("padded", False),
    )
    return model.to(device)


def make_optimizer(model: LRAModel, spec: Dict[str, Any]) -> Tuple[torch.optim.Optimizer, float]:
    """The point's optimizer and gradient-clipping norm (0 = none): the trainer's, from the task
    configuration's ``train`` values, or AdamW at lr 1e-4 without clipping."""
    from ..run.setup import adamw, make_optimizer as trainer_optimizer

    if not spec.get("train"):
        return adamw(model.parameters(), lr=1e-4), 0.0
    from ..config import RunConfig, TrainConfig

    cfg = RunConfig(train=TrainConfig(**spec["train"]))
    return trainer_optimizer(model, cfg), cfg.train.grad_clip


def batch_inputs(spec: Dict[str, Any], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The point's tokens [B, N], labels [B] and, for padded batches, row lengths [B] (N/2..N, the
    first row N, so the batch is padded to N), all drawn from the point's seed."""
    gen = torch.Generator(device=device).manual_seed(spec["seed"])
    vocab, classes = (spec["vocab_size"], spec["num_classes"]) if spec.get("model") else (VOCAB, CLASSES)
    tokens = torch.randint(0, vocab, (spec["batch"], spec["length"]), generator=gen, device=device)  # [B, N]
    labels = torch.randint(0, classes, (spec["batch"],), generator=gen, device=device)  # [B]
    lengths = None
    if spec.get("padded", False):
        n = spec["length"]
        lengths = torch.randint(n // 2, n + 1, (spec["batch"],), generator=gen, device=device)  # [B]
        lengths[0] = n
    return tokens, labels, lengths


def model_modes(model: LRAModel, spec: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> Modes:
    """One inference step and one training step (forward, loss, backward, optimizer) on random tokens,
    padded rows when spec["padded"]."""
    tokens, labels, lengths = batch_inputs(spec, device)
    return {"forward": forward_step(model, tokens, lengths, device, dtype),
            "train": train_step(model, spec, tokens, labels, lengths, device, dtype)}


def autocast_to(device: torch.device, dtype: torch.dtype) -> Any:
    """bf16 autocast on CUDA (weights and optimizer stay float32); float32 throughout on the CPU."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def forward_step(model: LRAModel, tokens: torch.Tensor, lengths: Optional[torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> Callable[[], None]:
    """One inference step of ``model`` on the batch."""
    def forward() -> None:
        model.eval()
        with torch.inference_mode(), autocast_to(device, dtype):
            model(tokens, lengths)

    return forward


def train_step(model: LRAModel, spec: Dict[str, Any], tokens: torch.Tensor, labels: torch.Tensor,
               lengths: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """One training step of ``model`` on the batch: forward, cross-entropy, backward, the gradient
    clipping the configuration asks for, the optimizer's step."""
    optimizer, clip = make_optimizer(model, spec)

    def train() -> None:
        model.train()
        with autocast_to(device, dtype):
            loss = F.cross_entropy(model(tokens, lengths).float(), labels)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train


def gemm_modes(size: int, device: torch.device, dtype: torch.dtype) -> Tuple[Modes, float]:
    """One [size, size] @ [size, size] matmul and its FLOP count (2 size^3)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def matmul() -> None:
        torch.mm(a, b, out=out)

    return {"matmul": matmul}, 2.0 * size**3
