# CPU reproducibility: the kernel pins must be in the environment before torch is first imported.
from pipeline.common.reproducible import pin_environment

pin_environment()
