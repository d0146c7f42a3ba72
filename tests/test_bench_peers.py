"""The PyTorch peer of the GPU benchmarks makes the same greedy decisions as ``accept_greedy``.

The benchmarks compare mlx-spec's verification step with the same acceptance written the way
vLLM writes it in PyTorch (``torch_greedy_peers`` in ``benchmarks/_common.py``); a peer that
decided otherwise would be timing something else. Here it runs on PyTorch's CPU device (skipped
without PyTorch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import accept_greedy, read

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import torch_greedy_peers

pytest.importorskip("torch")


def cases(n: int, v: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows with ties (integers) or without, and drafts agreeing for 0 to ``n`` tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for agree in range(n + 1):
        rows = rng.standard_normal((n + 1, v)).astype(np.float32) * 4
        if agree % 2:
            rows = np.round(rows)  # ties: the first maximal index wins in both
        choice = np.array(mx.argmax(mx.array(rows).astype(mx.bfloat16), axis=-1))
        draft = np.where(np.arange(n) < agree, choice[:n], (choice[:n] + 1) % v)
        out.append((rows, draft.astype(np.uint32)))
    return out


@pytest.mark.parametrize("n, v", [(1, 7), (4, 1000), (8, 4099)])
def test_torch_greedy_peer_decides_as_accept_greedy(n, v):
    for rows, draft in cases(n, v, seed=n):
        peer = torch_greedy_peers(rows, draft, device="cpu")["torch greedy"]()
        accepted, token, _ = read(
            accept_greedy(mx.array(rows).astype(mx.bfloat16), mx.array(draft))
        )
        assert peer == [accepted, token]


def test_a_peer_that_misreads_the_draft_is_caught():
    # Negative control: the same comparison fails for a draft shifted by one token.
    rows, draft = cases(4, 1000, seed=4)[4]
    peer = torch_greedy_peers(rows, (draft + 1) % 1000, device="cpu")["torch greedy"]()
    accepted, token, _ = read(accept_greedy(mx.array(rows).astype(mx.bfloat16), mx.array(draft)))
    assert peer != [accepted, token]
