// DUALKV_HD marks the definitions shared by the CPU backend and the CUDA kernels (the mask rule,
// the layout records, the log-prob math): inline on the host, __host__ __device__ under nvcc.
#pragma once

#if defined(__CUDACC__)
#define DUALKV_HD __host__ __device__ __forceinline__
#else
#define DUALKV_HD inline
#endif
