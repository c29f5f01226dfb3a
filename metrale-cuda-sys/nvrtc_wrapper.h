/* The header bindgen reads for the nvrtc feature: the run-time compiler. */
#include <nvrtc.h>
