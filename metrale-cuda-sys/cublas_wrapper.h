/* The header bindgen reads for the cublas feature's plain cuBLAS table: the v2
 * API. `cublas_stub/` (on the include path after the header's folder) stands in
 * for the CUDA runtime headers it includes. */
#include <cublas_api.h>
