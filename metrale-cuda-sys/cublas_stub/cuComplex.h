/* metrale's stand-in: the complex types as two floats or two doubles, aligned
 * as the toolkit's float2 and double2. */
#ifndef METRALE_CUBLAS_STUB_CUCOMPLEX_H
#define METRALE_CUBLAS_STUB_CUCOMPLEX_H
typedef struct __attribute__((aligned(8))) { float x, y; } cuFloatComplex;
typedef struct __attribute__((aligned(16))) { double x, y; } cuDoubleComplex;
typedef cuFloatComplex cuComplex;
#endif
