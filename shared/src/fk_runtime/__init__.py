"""fk-runtime: what every fk op shares (backend, sizing, checks, allocation, the op and launch
helpers, shared kernel protocols); its test and benchmark harness lives apart, in
`fk_runtime.harness`, which no op call imports."""

from . import alloc, backend, checks, sizing
from .backend import Backend
from .version import package_version

__version__ = package_version(__name__, __file__)

# The public surface: the names op packages may use, by module ("*": every name of the module not
# starting with "_"). Versioned: before 1.0 a change that removes or changes one of them raises
# the minor version, and ops depend on fk-runtime >= the version that first had what they use,
# < the next minor (tests/test_runtime_surface.py checks both against the op packages).
SURFACE_VERSION = "0.1"
PUBLIC = {
    "fk_runtime": ("Backend", "ahead", "alloc", "backend", "checks", "gluon", "harness", "launch", "ops", "package_version",
                   "partials", "siblings", "sizing", "timing", "views"),
    "ahead": ("AHEAD_WORKERS", "CACHE_DIR_ENV", "HASHED_FOLDERS", "LAUNCHER_ALONGSIDE_VERSIONS", "PREWARM_ENV", "active",
              "compile_ahead", "enabled", "finish", "first", "launcher_alongside", "load_triton_key", "start_driver",
              "start_key", "start_tools", "submit", "triton_signature", "upstream_gradients", "useful", "wait",
              "wait_key"),
    "alloc": ("empty", "empty_like", "new_empty", "new_empty_strided", "poisoned_outputs", "poisoning"),
    "backend": ("Backend", "backend", "check_interpreter_numpy", "default_device", "device_name", "gpu_available",
                "interpreter_numpy_problem", "is_hip", "is_interpreter", "kernel_device_type", "l2_cache_bytes",
                "multiprocessor_count", "release", "shared_memory_per_multiprocessor", "shared_memory_per_program",
                "triton_at_least", "triton_release",
                "use_interpreter_without_gpu", "warp_size"),
    "checks": ("FLOAT_DTYPES", "check_flag", "check_kernel_device", "check_nonnegative", "check_positive",
               "check_same_device", "check_same_dtype", "check_shape", "check_size", "check_tensor",
               "normalize_dim"),
    "gluon": ("TensorDescriptor", "VERSIONS", "fence_async_shared", "gl", "gluon", "mbarrier", "mma_v2", "reinterpret",
              "store_wait", "supported", "tma_load", "tma_reduce_add", "tma_store", "warpgroup_mma", "warpgroup_mma_wait"),
    "launch": ("FP_FUSION", "Descriptor", "Launch", "PLAN_CACHE_SIZE", "PREWARM_ENV", "PlanCache", "bind_context",
               "hash_triton", "layout_key"),
    "ops": ("Op", "autocast", "define", "keep_quiet", "quiet_key", "quiet_run", "resolve_negated", "traced",
            "transforms_active"),
    "partials": ("bind_sum_rows", "sum_rows"),
    "siblings": ("PROGRAM_WARPS", "RowPath", "await_row", "chunk_columns", "claim_abandoned", "lane", "max_siblings", "partials",
                 "publish", "scratch", "spin_limit", "widen_held"),
    "sizing": ("INT32_OFFSET_LIMIT", "MIN_WARPS", "Tile2D", "cdiv", "element_size", "fused_row_block",
               "launch_options", "looped_row_block", "max_warps", "next_power_of_2", "num_warps_for",
               "persistent_grid", "register_cap", "row_warps", "rows_per_program", "tile_2d", "vector_elements"),
    "views": ("around", "in_place", "rows"),
    "timing": ("MIN_SAMPLES", "REP_MS", "WARMUP_MS", "do_bench"),
    # The harness: tests, benchmarks, the main job.
    "harness": ("bench", "cli", "pytest_plugin", "testing"),
    "harness.bench": "*",
    "harness.testing": "*",
    "harness.pytest_plugin": "*",
    "harness.cli": "*",
}

__all__ = ["Backend", "PUBLIC", "SURFACE_VERSION", "alloc", "backend", "checks", "package_version", "sizing",
           "__version__"]
