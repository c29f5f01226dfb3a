/* The one header bindgen reads: the CUDA driver API. */
#include <cuda.h>
