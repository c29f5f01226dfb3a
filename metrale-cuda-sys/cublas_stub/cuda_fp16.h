/* metrale's stand-in: a half-precision number is two bytes. */
#ifndef METRALE_CUBLAS_STUB_CUDA_FP16_H
#define METRALE_CUBLAS_STUB_CUDA_FP16_H
typedef struct __attribute__((aligned(2))) { unsigned short x; } __half;
#endif
