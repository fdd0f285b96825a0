"""tracestore.kernels — GPU kernels for record capture (rollout) and guided rounding (training).

design.md §5. Rollout side (CuPy CUDA kernels on torch's current stream, graph-capturable):
:func:`record_from_activations`, :func:`record_from_codes`, :func:`record_kv_pages`,
:func:`compute_global_scale`, writing into a :class:`RecordBuffer`. Training side
(``torch.library`` custom ops with fake and straight-through autograd): :func:`guided_fp4`,
:func:`rtn_fp4`. Without a GPU every call runs the torch CPU reference, bit-identical.
CuPy is imported on the first GPU launch only.
"""

from tracestore.guidance import Guidance

from .guided import guided_fp4, rtn_fp4
from .record import (
    RecordBuffer,
    compute_global_scale,
    record_from_activations,
    record_from_codes,
    record_kv_pages,
)

__all__ = [
    "Guidance",
    "RecordBuffer",
    "compute_global_scale",
    "guided_fp4",
    "record_from_activations",
    "record_from_codes",
    "record_kv_pages",
    "rtn_fp4",
]
