// SAFEATTN_HOST_DEVICE: __host__ __device__ under nvcc, nothing elsewhere. For the small structs and
// functions that host code and kernels share without a torch include (c10's C10_HOST_DEVICE needs
// one), so that the standalone kernel checks in benchmarks/ can use them too.
#pragma once

#if defined(__CUDACC__)
#define SAFEATTN_HOST_DEVICE __host__ __device__
#else
#define SAFEATTN_HOST_DEVICE
#endif
