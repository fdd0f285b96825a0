"""Kernel parameter records (no GPU needed): each record's fields are its kernel's parameters in
the CUDA source, by name, count and order; values convert by the declared C type; and every GPU
launch path of the launchers builds its records (launch replaced by a recorder, CPU tensors)."""

import dataclasses
import re

import numpy as np
import pytest
import torch

import tracestore.kernels._launch as L
import tracestore.kernels.guided as KG
import tracestore.kernels.record as KR
from tracestore.errors import ConfigError
from tracestore.kernels import _params as P
from tracestore.kernels._source import SOURCE
from tracestore.layouts import padded_shape
from tracestore.records import SiteSpec

# The kernel names, written out: a kernel added to the source without a record fails here.
KERNELS = (
    "amax_abs",
    "finalize_g",
    "record_act",
    "record_codes",
    "record_kv",
    "stage_rows",
    "guided_b1",
    "guided_fwd",
)


def test_every_kernel_in_the_source_has_a_record():
    declared = re.findall(r"__global__\s+void\s+(\w+)", SOURCE)
    assert sorted(declared) == sorted(KERNELS)
    assert sorted(P.SIGNATURES) == sorted(KERNELS)
    assert sorted(P.RECORDS) == sorted(KERNELS)


@pytest.mark.parametrize("kernel", KERNELS)
def test_record_fields_are_the_kernel_parameters_in_order(kernel):
    record = P.RECORDS[kernel]
    params = P.SIGNATURES[kernel]
    fields = P.flat_fields(record)  # a group's fields in place of the group's field
    assert [path.rpartition(".")[2] for path, _ in fields] == [p.name for p in params]
    assert len(fields) == len(params)
    for (path, annotation), p in zip(fields, params, strict=True):
        # a pointer is a tensor (None where the kernel takes a null pointer), a scalar an int
        assert (annotation in ("Tensor", "Tensor | None")) == p.pointer, (kernel, path, annotation, p)
        assert p.pointer or (annotation == "int" and p.ctype in ("i64", "u32", "int")), (kernel, path, p)
    assert kernel == record.KERNEL


def test_signature_parser_reads_a_known_kernel():
    assert P.SIGNATURES["stage_rows"] == (
        P.Param("uint4", "src", True),
        P.Param("i64", "n16", False),
        P.Param("u8", "ring", True),
        P.Param("i64", "slot_bytes", False),
        P.Param("int", "slot", True),
    )
    # comments are not parameters; void* is a pointer; one kernel per name
    src = "__global__ void k(const void* __restrict__ t, i64 n /* words, (16 B) */, int flag) {}"
    assert P.parse_signatures(src)["k"] == (
        P.Param("void", "t", True),
        P.Param("i64", "n", False),
        P.Param("int", "flag", False),
    )
    with pytest.raises(ValueError, match="declared twice"):
        P.parse_signatures(src + src)
    with pytest.raises(ValueError, match="cannot read parameter"):
        P.parse_signatures("__global__ void k(i64) {}")


def test_a_record_that_does_not_match_its_kernel_is_refused():
    with pytest.raises(TypeError, match="not stage_rows's parameters"):

        @P.kernel_params("stage_rows")
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Swapped(P.KernelParams):  # n16 and ring swapped
            src: torch.Tensor
            ring: torch.Tensor
            n16: int
            slot_bytes: int
            slot: torch.Tensor

    with pytest.raises(TypeError, match="no __global__ kernel"):

        @P.kernel_params("no_such_kernel")
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Missing(P.KernelParams):
            x: int


def test_astuple_converts_by_declared_c_type_and_call_sites_name_every_argument():
    src = torch.zeros(4, 16, dtype=torch.uint8)
    ring = torch.zeros(2, 64, dtype=torch.uint8)
    slot = torch.zeros(1, dtype=torch.int32)
    rec = P.StageRows(src=src, n16=4, ring=ring, slot_bytes=64, slot=slot)
    args = rec.astuple()
    assert [type(a) for a in args] == [np.uint64, np.int64, np.uint64, np.int64, np.uint64]
    assert args == (src.data_ptr(), 4, ring.data_ptr(), 64, slot.data_ptr())
    assert P.FinalizeG(g=slot).astuple() == (np.uint64(slot.data_ptr()),)  # one field: still a tuple
    with pytest.raises(TypeError):
        P.StageRows(src, 4, ring, 64, slot)  # keyword-only: positions are refused
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.n16 = 5
    with pytest.raises(OverflowError):
        P.StageRows(src=src, n16=4, ring=ring, slot_bytes=1 << 63, slot=slot).astuple()


@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 10, 12, 40, 64, 96, 127, 4095, 65537, 2**31 - 1])
def test_fastdiv_divides_every_index_below_2_31(d):
    m, sh = P.fastdiv(d)
    assert 0 <= m < 2**32 and 0 <= sh < 32
    idx = np.concatenate([np.arange(0, 5000), np.random.default_rng(d).integers(0, 2**31, 20000), [2**31 - 1]])
    idx = idx.astype(np.uint64)
    umulhi = (idx * np.uint64(m)) >> np.uint64(32)  # the kernel's __umulhi (m = 0 stands for d = 1)
    got = idx if d == 1 else umulhi >> np.uint64(sh)
    np.testing.assert_array_equal(got, idx // np.uint64(d))
    div = P.RowDiv.of(d)
    assert (div.ng, div.div_m, div.div_sh) == (d, m, sh)
    with pytest.raises(ValueError, match="divisor"):
        P.fastdiv(0)


def test_launch_refuses_the_record_of_another_kernel():
    rec = P.FinalizeG(g=torch.zeros(1))
    with pytest.raises(ConfigError, match="arguments of finalize_g, not of amax_abs<0>"):
        L.launch_grid("amax_abs<0>", torch.device("cpu"), 1, rec)
    with pytest.raises(ConfigError, match="not of record_kv<16,1>"):
        L.launch("record_kv<16,1>", torch.device("cpu"), 0, rec)


@pytest.fixture
def launches(monkeypatch):
    """Run the launchers' GPU branches on CPU tensors; collect (name expression, threads, record)."""
    seen = []

    def fake(name_expr, device, n, params):
        assert name_expr.partition("<")[0] == params.KERNEL
        seen.append((name_expr, n, params, params.astuple()))

    monkeypatch.setattr(L, "launch", fake)
    monkeypatch.setattr(L, "launch_grid", fake)
    monkeypatch.setattr(KR, "use_gpu", lambda device: True)
    return seen


def test_every_rollout_launch_path_builds_its_record(launches):
    nv, mx = SiteSpec("a", "moe_input", 0, 64, "nvfp4", 1), SiteSpec("b", "key", 0, 96, "mxfp4", 2)
    slab = KR.RecordSlab.allocate((nv, mx), 16, "cpu")
    x = torch.randn(5, 64).to(torch.bfloat16)
    KR.record_from_activations(x, nv, slab["a"], row_offset=2, global_scale=None)  # amax, finalize, record
    pk, sc = torch.zeros(5, 48, dtype=torch.uint8), torch.zeros(5, 3, dtype=torch.uint8)
    KR.record_from_codes(pk, sc, mx, slab["b"], row_offset=1)
    rp, cp = padded_shape(5, 4)
    KR.record_from_codes(
        pk[:, :32],
        torch.zeros(rp * cp, dtype=torch.uint8),
        nv,
        slab["a"],
        scale_layout="swizzled128x4",
        global_scale=0.5,
    )
    pool, spool = torch.zeros(3, 4, 2, 16, dtype=torch.uint8), torch.zeros(3, 4, 2, 2, dtype=torch.uint8)
    KR.record_kv_pages(
        pool, spool, torch.tensor([2, 0], dtype=torch.int64), 6, nv, slab["a"], token_start=1, global_scale=0.5
    )
    ring = torch.zeros(2, slab.row_bytes * 16, dtype=torch.uint8)
    KR.stage_rows(slab, 4, ring, torch.ones(1, dtype=torch.int32))
    kinds = [name.partition("<")[0] for name, *_ in launches]
    assert kinds == ["amax_abs", "finalize_g", "record_act", "record_codes", "record_codes", "record_kv", "stage_rows"]
    by_kernel = {name.partition("<")[0]: (n, rec, args) for name, n, rec, args in launches}
    n, rec, args = by_kernel["record_kv"]
    assert n == 6 * 4 and rec.pt64 == 1 and rec.token_start == 1 and rec.page_table.tolist() == [2, 0]
    assert args[0] == pool.data_ptr() and args[3] == spool.data_ptr()
    assert (rec.pool_page, rec.pool_slot, rec.spool_page, rec.spool_slot) == (128, 32, 16, 4)
    assert rec.out.codes_out.data_ptr() == slab["a"].codes.data_ptr() and rec.out.c_stride == slab.row_bytes
    assert args[12] == slab["a"].codes.data_ptr() and type(args[7]) is np.int32  # group in place; pt64 a C int
    n, rec, _ = by_kernel["record_act"]
    assert (rec.n_rows, rec.div.ng, rec.x_stride) == (5, 2, 128) and rec.fp4_out is None and rec.f_stride == 0
    assert rec.g_out.data_ptr() == slab["a"].global_scale[2:].data_ptr()
    n, rec, args = by_kernel["record_codes"]  # the swizzled one (the last)
    assert rec.s_stride == padded_shape(5, 4)[1] and rec.out.g_in_stride == 0 and n == 5 * rec.div.ng == 5 * 2
    assert [type(a) for a in args[:8]] == [np.uint64, np.int64, np.uint64, np.int64, *[np.uint32] * 4]


def test_every_training_launch_path_builds_its_record(launches):
    x = torch.randn(3, 64).to(torch.float16)
    codes, scales = torch.zeros(3, 8, dtype=torch.uint8), torch.zeros(3, 4, dtype=torch.uint8)
    g = torch.ones(3)
    valid, rows = torch.ones(3, dtype=torch.bool), torch.tensor([2, 1, 0])
    KG._guided_fp4_cuda(x, codes, scales, g, None, valid, rows, None, 1, "nvfp4", "bracket")
    KG._guided_fp4_cuda(x, torch.zeros(3, 16, dtype=torch.uint8), scales, g, g, None, None, None, 2, "nvfp4", "bracket")
    KG._rtn_fp4_cuda(x, torch.ones(()), "nvfp4")
    (b1, n1, r1, _), (fwd, n2, r2, _), (rtn, n3, r3, a3) = launches
    assert b1 == "guided_b1<2,0,0,2>" and n1 == 3 * 2 and (r1.div.ng, r1.records.g_per_row) == (2, 1)
    assert r1.records.rows is rows and r1.records.valid is valid and r1.records.mask is None and r1.records.ts is None
    assert fwd == "guided_fwd<2,0,2,0>" and n2 == 3 * 4 and r2.lut is not None and r2.records.ts is g
    assert rtn == "guided_fwd<2,0,1,1>" and n3 == 3 * 4 and r3.records.codes is None
    assert [type(a) for a in a3[:4]] == [np.uint64, np.int64, np.uint32, np.uint32]
    assert a3[4] == a3[14] == 0 and type(a3[9]) is np.int32  # None -> null pointer; g_per_row a C int
