"""Per-op launch tables: the numbers each op's launcher uses, named, one module per op.

Generic rules (vector width, warps from block size, HIP options) are in `fk_runtime.sizing`;
these modules hold what one op's kernels were tuned to on the GPU, with the measurement that
chose each number noted beside it.
"""
