"""Where snapshot bytes live and how they move: stores and transports, installed as ``jaxckpt.backends``."""
