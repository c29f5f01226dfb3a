/* metrale's stand-in for the CUDA runtime header cublas_api.h includes: bindgen
 * needs only the stream type from it (the same handle as the driver's CUstream),
 * so the cuBLAS bindings are made without a CUDA toolkit. */
#ifndef METRALE_CUBLAS_STUB_DRIVER_TYPES_H
#define METRALE_CUBLAS_STUB_DRIVER_TYPES_H
#include <stddef.h>
#define CUDART_VERSION 13000
typedef struct CUstream_st *cudaStream_t;
#endif
