"""tracestore.kernels — GPU kernels for record capture (rollout) and guided rounding (training).

docs/integration.md ("GPU capture", "Applying guidance"). Rollout side (CuPy CUDA kernels on torch's
current stream, graph-capturable):
:func:`record_from_activations`, :func:`record_from_codes`, :func:`record_kv_pages`,
:func:`compute_global_scale`, writing into a :class:`RecordBuffer` (or the per-site views of one
:class:`RecordSlab`, which a recorder stages with one copy, :func:`stage_rows` inside a graph;
:class:`RecordBranch` runs them beside the engine's kernels). Training side
(``torch.library`` custom ops with fake and straight-through autograd): :func:`guided_fp4`,
:func:`rtn_fp4`. Without a GPU every call runs the torch CPU reference, bit-identical.
CuPy is imported on the first GPU launch only.
"""

from tracestore.guidance import Guidance

from .branch import RecordBranch
from .guided import guided_fp4, rtn_fp4
from .record import (
    RecordBuffer,
    RecordSlab,
    compute_global_scale,
    record_from_activations,
    record_from_codes,
    record_kv_pages,
    stage_rows,
)

__all__ = [
    "Guidance",
    "RecordBranch",
    "RecordBuffer",
    "RecordSlab",
    "compute_global_scale",
    "guided_fp4",
    "record_from_activations",
    "record_from_codes",
    "record_kv_pages",
    "rtn_fp4",
    "stage_rows",
]
