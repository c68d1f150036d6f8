// KVQ_HD marks the per-element math and per-thread programs that the CUDA
// kernels run on the device and the "cuda_host" backend runs on the CPU, so
// the host build tests the very code the GPU runs against the reference.
//
// Headers that use it must not include CUDA headers: they compile with the
// host compiler everywhere (kernels/cuda/*.cu include them under nvcc).
#ifndef KVQ_KERNELS_HD_HD_H_
#define KVQ_KERNELS_HD_HD_H_

#if defined(__CUDACC__)
#define KVQ_HD __host__ __device__ __forceinline__
#define KVQ_DEVICE_CODE 1
#else
#define KVQ_HD inline
#define KVQ_DEVICE_CODE 0
#endif

#endif  // KVQ_KERNELS_HD_HD_H_
