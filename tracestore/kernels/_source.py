"""CUDA C source of every tracestore kernel (compiled by NVRTC through CuPy, see ``_launch.py``).

Arithmetic follows docs/numerics.md bit for bit: explicit ``__fmul_rn``/``__fdiv_rn`` and
``-fmad=false`` (a fused multiply-add would round once where the reference rounds twice), NaN-
propagating block amax (PTX ``max.NaN``, where ``fmaxf`` would drop a NaN, §3), and no CUDA
headers (bf16/fp16 conversions are PTX ``cvt``), so NVRTC needs no include path.

Thread mapping: one thread per (row, scale block), or G consecutive blocks of a row per thread
(``record_act``, ``guided_b1``: all loads issued first; G is their launchers'
``BLOCKS_PER_THREAD``). A bf16 NVFP4 block is 32 bytes of input (two 16-byte loads) and ``2*b``
bytes of packed bits; consecutive threads touch consecutive blocks. These kernels are bound by
instruction issue more than by the access pattern, so the per-element arithmetic avoids conversion
instructions and compare/select chains (see ``e2m1_magic``), and keeps work off the integer/logic
pipe, which issues at half the FP32 rate on Hopper (``rtn_sum_fmul``, ``absmax2``;
``record_block``'s V). Reading the SASS needs no GPU: ``nvcc -cubin -arch=sm_90 -fmad=false
--ftz=false`` over ``SOURCE`` plus an explicit instantiation, then ``cuobjdump -sass`` (Triton's
wheel ships one).

``SOURCE`` is one translation unit, compiled as one NVRTC program (``_launch.py``), assembled from
three parts in this order (a part may use what an earlier one defines): ``_source_common.py``
(typedefs, conversions, loads and stores, E2M1 rounding, scale codecs, packing),
``_source_record.py`` (the rollout-side kernels) and ``_source_guided.py`` (the training-side ones).
"""

from __future__ import annotations

from . import _source_common, _source_guided, _source_record

SOURCE = _source_common.COMMON + _source_record.RECORD + _source_guided.GUIDED
