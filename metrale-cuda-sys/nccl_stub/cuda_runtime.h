/* metrale's stand-in for the CUDA runtime header that nccl.h includes: bindgen
 * needs only the stream type from it (the same handle as the driver's CUstream),
 * so the NCCL bindings are made without a CUDA toolkit. */
#ifndef METRALE_NCCL_STUB_CUDA_RUNTIME_H
#define METRALE_NCCL_STUB_CUDA_RUNTIME_H
#include <stddef.h>
#define CUDART_VERSION 13000
typedef struct CUstream_st *cudaStream_t;
#endif
