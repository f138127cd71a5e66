"""``jaxckpt.backends.torch.dcp``: DCP's storage on jaxckpt under its earlier module name (now
``jaxckpt.torch.dcp``), kept so that code written against it still imports."""
from jaxckpt.torch.dcp import JaxckptReader, JaxckptWriter, checkpoint_step

__all__ = ["JaxckptReader", "JaxckptWriter", "checkpoint_step"]
