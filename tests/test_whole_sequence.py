"""Options past the sequence, alike for every backend: a block, window, bucket or landmark count that
reaches past max_len is clamped to what covers the sequence when the backend is built, with one
notice naming the backend, the option and what it becomes; the output is the unclamped backend's.
lra-run says the notice once; lra-analyze budget refuses such a budget (it repeats the clamped one)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from attentions import AttnDims, build_attention, get_attention, list_attentions
from attentions.registry import build_config
from conftest import TINY_LISTOPS, lengths_mask, rel_err

B, H, N, D = 2, 2, 64, 16
# every backend that declares such options, with each option far past N
PAST = [(name, option) for name in list_attentions() for option in get_attention(name).whole_sequence]


def test_the_backends_with_sequence_options_declare_them() -> None:
    declared = {name for name, _ in PAST}
    assert {"local", "moba", "sparse_transformer", "longformer", "bigbird", "sinkhorn", "reformer", "topk", "mita",
            "nystromformer", "agent"} <= declared


@pytest.mark.parametrize("name, option", PAST, ids=[f"{n}-{o}" for n, o in PAST])
def test_an_option_past_the_sequence_is_clamped_with_a_notice_and_the_same_output(name: str, option: str) -> None:
    value = 10 * N + 1
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))  # [B, H, N, D]
    mask = lengths_mask([N, N - 9], N) if get_attention(name).supports_mask else None
    torch.manual_seed(1)
    clamped = build_attention(name, num_heads=H, head_dim=D, max_len=N, **{option: value}).eval()
    # one notice for the option (a clamped block can clamp MoBA's blocks per query too: a notice of its own)
    (notice,) = [line for line in clamped.notices if line.startswith(f"{name} {option}=")]
    reach = getattr(clamped.cfg, option)
    assert notice.startswith(f"{name} {option}={value} reaches past a sequence of {N} tokens (max_len): clamped to {reach}, ")
    assert reach < value
    # the backend as the option asks, built without the clamp
    torch.manual_seed(1)
    cls = get_attention(name)
    raw = cls(AttnDims(num_heads=H, head_dim=D, max_len=N), build_config(name, {option: value})).eval()
    # the real rows (a padded row is only finite by the contract)
    real = mask[:, None, :, None] if mask is not None else torch.ones(1, dtype=torch.bool)
    with torch.no_grad():
        assert rel_err(clamped(q, k, v, mask) * real, raw(q, k, v, mask) * real) < 1e-5


def test_an_option_within_the_sequence_is_kept_without_a_notice() -> None:
    attn = build_attention("local", num_heads=H, head_dim=D, max_len=N, block_size=N)
    assert attn.cfg.block_size == N and attn.notices == []


def test_lra_run_says_the_notice_once(cli: Callable, tmp_path: Path, listops_data: Path) -> None:
    # TINY_LISTOPS rows are 128 tokens
    ran = cli("lra-run", *TINY_LISTOPS, "--attn", "local", "--data-dir", listops_data, "--out", tmp_path,
              "--set", "attn.block_size=1000")
    assert ran.code == 0, ran.err
    notices = [line for line in ran.err.splitlines() if line.startswith("lra-run: notice: ")]
    assert notices == ["lra-run: notice: local block_size=1000 reaches past a sequence of 128 tokens (max_len): "
                       "clamped to 128, one block of the whole sequence: full attention"]
