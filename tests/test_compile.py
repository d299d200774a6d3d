"""torch.compile over the suite's models: a compiled training step gives the eager step's loss and
gradients with every built-in backend, with no graph break in the whole model (dynamo, AOTAutograd
and the fake implementations of the lra:: operators; inductor's code generation for MiTA, whose
step holds the most operators), and MiTA's, MoBA's and Top-k's attention on the CPU kernels trace
as one graph with a padding mask."""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from attentions import build_attention, list_attentions
from attentions.ops.grouped import cpu as grouped_cpu
from conftest import lengths_mask, rel_err
from lra.config import ModelConfig
from lra.model import LRAModel

OPTIONS: Dict[str, dict] = {"mita": {"landmarks": 8, "topk": 8}, "moba": {"block_size": 16, "topk": 2},
                            "topk": {"topk": 8, "chunk_size": 32}}
# several blocks, chunks (recomputed in the backward) and global tokens at N = 64
OPTIONS.update({"sparse_transformer": {"block_size": 8, "summary": 2, "chunk_size": 16},
                "longformer": {"window": 9, "global_tokens": [0, 50]}, "local": {"block_size": 10}})
BUILT_INS = list_attentions()
needs_kernels = pytest.mark.skipif(not grouped_cpu.takes(torch.zeros(0)), reason="the C kernels do not build here")


def training_step(name: str, compiler: str, dropout: float) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Loss and parameter gradients of one step of a small padded LRA classifier, eager when
    ``compiler`` is "" else under torch.compile(backend=compiler, fullgraph=True)."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, dim=32, num_heads=2, ffn_dim=64, dropout=dropout)
    model = LRAModel(cfg, name, OPTIONS.get(name, {}), vocab_size=12, num_classes=3, max_len=64)
    tokens = torch.randint(1, 12, (2, 64))  # [B, N]
    lengths, labels = torch.tensor([64, 45]), torch.tensor([0, 2])
    forward = torch.compile(model, backend=compiler, fullgraph=True) if compiler else model
    torch.manual_seed(1)  # the dropout draws
    loss = F.cross_entropy(forward(tokens, lengths), labels)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


def check_equal_steps(name: str, compiler: str, dropout: float) -> None:
    torch._dynamo.reset()
    eager_loss, eager_grads = training_step(name, "", dropout)
    loss, grads = training_step(name, compiler, dropout)
    assert rel_err(loss, eager_loss) < 1e-6
    for g, r in zip(grads, eager_grads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("name", BUILT_INS)
def test_a_compiled_step_equals_the_eager_step(name: str) -> None:
    """AOTAutograd traces forward and backward in one graph each (fullgraph: a break is an error),
    the dropout kernel included: the same draws, the same loss and gradients."""
    check_equal_steps(name, "aot_eager", dropout=0.1)


def test_an_inductor_compiled_mita_step_equals_the_eager_step() -> None:
    """Inductor's generated code around MiTA's operators (dropout off: inductor draws its own randoms)."""
    check_equal_steps("mita", "inductor", dropout=0.0)


@needs_kernels
@pytest.mark.parametrize("name", ["mita", "moba", "topk"])
def test_routing_attention_on_the_cpu_kernels_is_one_graph(name: str) -> None:
    attn = build_attention(name, num_heads=2, head_dim=16, max_len=128, **OPTIONS[name])
    q, k, v = (torch.randn(2, 2, 128, 16, requires_grad=True) for _ in range(3))
    mask = lengths_mask([128, 100], 128)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(attn)(q, k, v, mask)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    # the kernels are in the graph as operators (inside the bodies of the autograd Functions over them)
    names = {str(node.target) for graph in explained.graphs for module in graph.modules()
             if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes if node.op == "call_function"}
    assert any(n.startswith("lra.") for n in names), sorted(names)
