#!/usr/bin/env bash
# Regenerate the checked-in kernel artifacts in kernels/ (PTX, cubin, fatbin) with nvcc.
# Tests load these files and need no compiler.  sm_90 is the GPU machine's (H100/H200).
set -euo pipefail
cd "$(dirname "$0")/../kernels"
NVCC=${NVCC:-nvcc}
ARCH=${ARCH:-90}
$NVCC -ptx -arch=compute_$ARCH -o kernels.ptx kernels.cu
$NVCC -cubin -arch=sm_$ARCH -o kernels.cubin kernels.cu
$NVCC -fatbin -gencode arch=compute_$ARCH,code=sm_$ARCH -gencode arch=compute_$ARCH,code=compute_$ARCH -o kernels.fatbin kernels.cu
$NVCC -cubin -arch=sm_$ARCH -o graph_kernels.cubin graph_kernels.cu    # the graph tests (conditional nodes)
$NVCC -ptx -rdc=true -arch=compute_$ARCH -o ptxjit_a.ptx ptxjit_a.cu
$NVCC -ptx -rdc=true -arch=compute_$ARCH -o ptxjit_b.ptx ptxjit_b.cu
$NVCC --version | tail -2 > NVCC_VERSION
ls -l kernels.ptx kernels.cubin kernels.fatbin graph_kernels.cubin ptxjit_a.ptx ptxjit_b.ptx
