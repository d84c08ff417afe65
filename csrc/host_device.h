// DDTREE_HOST_DEVICE: a function compiled for the host and, under nvcc, for the GPU too (the headers whose arithmetic
// the CPU ops and the CUDA kernels share).
#pragma once

#if defined(__CUDACC__)
#define DDTREE_HOST_DEVICE __host__ __device__
#else
#define DDTREE_HOST_DEVICE
#endif
