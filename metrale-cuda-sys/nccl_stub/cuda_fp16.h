/* metrale's empty stand-in: nccl.h's declarations use no half-precision type. */
