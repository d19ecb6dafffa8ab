#!/usr/bin/env bash
# A staged Triton (../shared/gpu-stack's .gpu-stack/triton-X.Y.Z) repacked to what an NVIDIA run uses, so that
# it travels to the GPU box in one device call instead of two or three (a call carries 64 MiB):
#   bash e2e/slim_triton.sh .gpu-stack/triton-3.9.0      # writes .gpu-stack/triton-3.9.0s (same unpack.sh)
# Left out: AMD's codegen library, proton and CUPTI (profiling), MLIR plugins and headers, FileCheck; libtriton's
# debug sections stripped (its code kept). Added: ptxas-blackwell as a link to the sm_90 ptxas, which Triton
# 3.9 looks up on every compile. 3.8.0 / 3.9.0: 113 / 138 MB -> 56 / 56 MB (checked: sm_90 compiles there).
set -euo pipefail
src=${1:?usage: slim_triton.sh .gpu-stack/triton-X.Y.Z}
version=$(awk '/^triton /{print $2}' "$src/MANIFEST")
out=${src%/}s
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat "$src"/part.* | xz -dc -T0 | tar -x -C "$work"
t=$work/triton
rm -rf "$t/_C/libproton.so" "$t/backends/nvidia/lib/cupti" "$t/plugins" "$t/include" "$t/FileCheck" \
  "$t/backends/amd/lib/libtriton_amd_codegen.so" "$t/backends/amd/include"
strip --strip-debug "$t/_C/libtriton.so"
[ -e "$t/backends/nvidia/bin/ptxas-blackwell" ] || ln -s ptxas "$t/backends/nvidia/bin/ptxas-blackwell"
mkdir -p "$out" && rm -f "$out"/part.*
tar -C "$work" -cf - . | xz -9 -T0 | split -b 56m -d -a 2 - "$out/part."
{ echo "triton $version"; echo "sha256 $(cat "$out"/part.* | sha256sum | cut -d' ' -f1)"
  for p in "$out"/part.*; do echo "part $(basename "$p")"; done; } > "$out/MANIFEST"
cat "$out/MANIFEST"; du -sh "$out"
