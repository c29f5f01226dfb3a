/* The header bindgen reads for the nvrtc feature: the JIT linker. */
#include <nvJitLink.h>
