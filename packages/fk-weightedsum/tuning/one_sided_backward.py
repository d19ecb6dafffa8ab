"""weighted_sum backward: both gradients, x only (frozen weight), weight only; torch's x @ w beside
(TUNING.md: one-sided backward). Backward alone, CUDA-graph replays (the forward run on the
capturing stream), do_bench medians.

    bash shared/from-source.sh python packages/fk-weightedsum/tuning/one_sided_backward.py
"""
import torch
from fk_runtime.harness import bench
from fk_weightedsum import weighted_sum
from triton.testing import do_bench



def backward_ms(f, rows: int, d: int, dtype: torch.dtype, needs: tuple[bool, bool]) -> float:
    """One backward of f(x, w) for the inputs `needs` marks, replayed from a CUDA graph."""
    x = torch.randn(rows, d, device="cuda", dtype=dtype, requires_grad=needs[0])
    w = torch.randn(d, device="cuda", dtype=dtype, requires_grad=needs[1])
    gy = torch.randn(rows, device="cuda", dtype=dtype)
    inputs = [t for t, n in zip((x, w), needs, strict=True) if n]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = f(x, w)
        (replay,) = bench.graphed([lambda: torch.autograd.grad(y, inputs, gy, retain_graph=True)], stream)
        return do_bench(replay, warmup=50, rep=200)


def main() -> None:
    print(torch.cuda.get_device_name())
    print("| shape | dtype | gradients | fk bwd ms | fk GB/s | torch bwd ms | fk / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows, d, dtype in [(16384, 4096, torch.bfloat16), (1048576, 128, torch.bfloat16),
                           (65536, 1024, torch.float32)]:
        for needs in [(True, True), (True, False), (False, True)]:
            fk = backward_ms(weighted_sum, rows, d, dtype, needs)
            torch_ms = backward_ms(lambda x, w: x @ w, rows, d, dtype, needs)
            moved = rows * d * dtype.itemsize * (int(needs[0]) + int(needs[1]))
            name = {(True, True): "both", (True, False): "x only", (False, True): "weight only"}[needs]
            print(f"| {rows}x{d} | {str(dtype)[6:]} | {name} | {fk:.3f} | {moved / fk / 1e6:.0f} | "
                  f"{torch_ms:.3f} | {torch_ms / fk:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
