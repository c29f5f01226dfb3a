/* metrale's empty stand-in: nccl.h's declarations use no bfloat16 type. */
