/* The header bindgen reads for the cublas feature's cuBLASLt table. It includes
 * cublas_api.h, whose types come from the plain cuBLAS bindings. */
#include <cublasLt.h>
