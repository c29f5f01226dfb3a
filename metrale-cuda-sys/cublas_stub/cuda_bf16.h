/* metrale's stand-in: a bfloat16 number is two bytes. */
#ifndef METRALE_CUBLAS_STUB_CUDA_BF16_H
#define METRALE_CUBLAS_STUB_CUDA_BF16_H
typedef struct __attribute__((aligned(2))) { unsigned short x; } __nv_bfloat16;
#endif
