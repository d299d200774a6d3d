"""Byte-level tokens for Text (IMDB) and Retrieval (AAN), as in LRA (Tay et al. 2021, Long Range Arena).

The official pipelines encode with tfds' ``ByteTextEncoder``: each UTF-8 byte b becomes id b + 1 and
id 0 is padding, so the vocabulary has 257 ids. Rows are cut or right-padded to the sequence length;
the real length of each row is kept, since the padding mask is ``position < length``.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from ..errors import UserError

# 256 byte values shifted by one, plus the pad id 0
BYTE_VOCAB = 257
# ids reach 256, past uint8
TOKEN_DTYPE = np.int16


def check_length(task: str, length: int) -> int:
    """A usable sequence length, or a one-line error (data.max_len 0 means the task's default)."""
    if length < 1:
        raise UserError(f"{task}: data.max_len must be positive (0 = the default), got {length}")
    return length


def fill_row(row: np.ndarray, raw: bytes) -> int:
    """Write the byte ids of ``raw`` into the zeroed ``row`` [L], cut at L. Returns the real length."""
    n = min(len(raw), row.shape[0])
    row[:n] = np.frombuffer(raw, dtype=np.uint8, count=n)
    row[:n] += 1
    return n


def byte_rows(docs: Sequence[bytes], length: int) -> Tuple[np.ndarray, np.ndarray]:
    """Documents -> tokens [n, length] int16 (byte + 1, pad 0) and real lengths [n] int32."""
    tokens = np.zeros((len(docs), length), dtype=TOKEN_DTYPE)
    lengths = np.zeros(len(docs), dtype=np.int32)
    for i, raw in enumerate(docs):
        lengths[i] = fill_row(tokens[i], raw)
    return tokens, lengths
