import pytest
import torch

from fk_runtime import backend, sizing


def test_next_power_of_2():
    assert [sizing.next_power_of_2(n) for n in (0, 1, 2, 3, 17, 1024, 1025)] == [1, 1, 2, 4, 32, 1024, 2048]


@pytest.mark.parametrize("dtype,limit", [(torch.float32, 16384), (torch.bfloat16, 32768)])
def test_fused_row_block_respects_the_byte_budget(dtype, limit):
    assert sizing.max_fused_row_elements(dtype) == limit
    assert sizing.fused_row_block(1000, dtype) == 1024
    assert sizing.fused_row_block(limit, dtype) == limit
    assert sizing.fused_row_block(limit + 1, dtype) is None


def test_num_warps_grows_with_block_and_stays_in_bounds():
    warps = [sizing.num_warps_for(n) for n in (1, 256, 2048, 8192, 32768, 1 << 20)]
    assert warps == sorted(warps)
    assert warps[0] == sizing.MIN_WARPS and warps[-1] == sizing.max_warps()
    assert all(w & (w - 1) == 0 for w in warps)


def test_hip_options_and_wavefronts(monkeypatch):
    monkeypatch.setattr(backend, "backend", lambda: backend.Backend.HIP)
    assert sizing.launch_options(8) == {"num_warps": 8, "waves_per_eu": sizing.HIP_WAVES_PER_EU}
    # 64-wide wavefronts: half the warps for the same block, capped at 16.
    assert sizing.num_warps_for(1 << 20) == sizing.MAX_WARPS_HIP
    monkeypatch.setattr(backend, "backend", lambda: backend.Backend.CUDA)
    assert sizing.launch_options(8, 3) == {"num_warps": 8, "num_stages": 3}
    assert sizing.num_warps_for(16384) == 2 * _hip_warps(monkeypatch, 16384)


def _hip_warps(monkeypatch, n):
    with monkeypatch.context() as m:
        m.setattr(backend, "backend", lambda: backend.Backend.HIP)
        return sizing.num_warps_for(n)


@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 3), (4096, 16384), (1 << 20, 128)])
def test_tile_2d_fits_budget(rows, cols):
    t = sizing.tile_2d(rows, cols, torch.float32, tile_bytes=16384, max_cols=1024)
    assert t.elements * 4 <= 16384
    assert t.block_cols <= max(1024, 1) and t.block_rows <= sizing.next_power_of_2(rows)
    assert t.block_cols >= min(sizing.next_power_of_2(cols), 1024) or t.elements * 4 == 16384


def test_persistent_grid_is_bounded():
    assert sizing.persistent_grid(1) == 1
    assert sizing.persistent_grid(10**9) == backend.multiprocessor_count() * sizing.PROGRAMS_PER_SM


@pytest.mark.parametrize("programs,warps,cap", [(9, 4, 56), (5, 4, 96), (4, 4, 128), (2, 8, 128), (2, 32, 32)])
def test_register_cap_fits_the_programs_in_the_register_file(monkeypatch, programs, warps, cap):
    monkeypatch.setattr(backend, "backend", lambda: backend.Backend.CUDA)
    got = sizing.register_cap(programs, warps)
    assert got == cap and got % sizing.REGISTER_ALLOCATION_UNIT == 0
    assert programs * warps * 32 * got <= sizing.REGISTERS_PER_SM
