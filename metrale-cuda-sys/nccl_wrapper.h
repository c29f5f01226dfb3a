/* The header bindgen reads for the nccl feature: the collective communication
 * library. `nccl_stub/` (on the include path after nccl.h's folder) stands in for
 * the CUDA runtime headers nccl.h includes. */
#include <nccl.h>
