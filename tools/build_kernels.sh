#!/usr/bin/env bash
# Regenerate the checked-in kernel artifacts in kernels/ with nvcc.  Tests and examples load these files
# and need no compiler.
#
#   kernels.fatbin, graph_kernels.fatbin   SASS for every architecture this nvcc supports (nvcc 13.0: sm_75
#                                          to sm_121) plus PTX for the newest, which a newer GPU JIT-compiles;
#                                          compressed for size (--compress-mode=size: a CUDA 12.8+ driver
#                                          decompresses it; the code itself needs a CUDA 13.0 driver, 580+)
#   kernels.ptx, ptxjit_*.ptx              PTX for the oldest architecture: JIT-compiled on any of them
#   kernels.cubin                          one architecture's cubin (ARCH, default 90: H100/H200), a sample
#                                          of the format for the tests that load a bare cubin
#
# ARCHS="80 90" narrows the fatbin (e.g. for a quicker build).
set -euo pipefail
cd "$(dirname "$0")/../kernels"
NVCC=${NVCC:-nvcc}
ARCH=${ARCH:-90}
ARCHS=${ARCHS:-$($NVCC --list-gpu-code | sed -n 's/^sm_\([0-9]*\)$/\1/p' | sort -n | tr '\n' ' ')}
ARCHS=$(echo $ARCHS)   # one space between, none after
OLDEST=$(echo $ARCHS | tr ' ' '\n' | sort -n | head -1)
NEWEST=$(echo $ARCHS | tr ' ' '\n' | sort -n | tail -1)
GENCODE=""
for a in $ARCHS; do GENCODE="$GENCODE -gencode arch=compute_$a,code=sm_$a"; done
GENCODE="$GENCODE -gencode arch=compute_$NEWEST,code=compute_$NEWEST"
$NVCC -fatbin $GENCODE --compress-mode=size -o kernels.fatbin kernels.cu
$NVCC -fatbin $GENCODE --compress-mode=size -o graph_kernels.fatbin graph_kernels.cu   # the graph tests
$NVCC -ptx -arch=compute_$OLDEST -o kernels.ptx kernels.cu
$NVCC -cubin -arch=sm_$ARCH -o kernels.cubin kernels.cu
$NVCC -ptx -rdc=true -arch=compute_$OLDEST -o ptxjit_a.ptx ptxjit_a.cu
$NVCC -ptx -rdc=true -arch=compute_$OLDEST -o ptxjit_b.ptx ptxjit_b.cu
$NVCC --version | tail -2 > NVCC_VERSION
echo "fatbin architectures: $ARCHS + compute_$NEWEST PTX" >> NVCC_VERSION
ls -l kernels.fatbin graph_kernels.fatbin kernels.ptx kernels.cubin ptxjit_a.ptx ptxjit_b.ptx
