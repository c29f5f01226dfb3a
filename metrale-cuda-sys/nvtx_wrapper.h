/* The header bindgen reads for the nvtx feature: NVTX v3 (header-only). Its
 * implementation part declares the callback ids and entry signatures of every
 * module, the CUDA driver module's included (with its own handle typedefs, so
 * no cuda.h is needed). Only the types listed in build/gen.rs are kept. */
#include <nvtx3/nvToolsExt.h>
