"""A stand-in for the fused CUDA kernels on machines without CUDA.

``reference_launch`` has the signature of ``mlx_spec.kernels.launch`` and runs the composition on
exactly what a kernel would be handed (stand-ins for a missing draft or eos, the sampled path's
uniforms), so the plumbing of ``fused=True`` is tested wherever the suite runs.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_spec import acceptance


def reference_launch(name: str, inputs: list[mx.array], template: list) -> mx.array:
    """The composition's ``[3]`` uint32 result for kernel ``name`` on ``inputs``."""
    options = dict(template)
    if name == "greedy":
        logits, draft, eos = inputs
        n = logits.shape[0] - 1
        return acceptance._greedy_graph(False)(logits, draft[:n], eos)
    probs, q, draft, eos, u = inputs
    n = probs.shape[0] - 1
    q = q if options["HAS_Q"] else None
    return acceptance.sampled_from_uniforms(probs, draft[:n], q, eos, u)
