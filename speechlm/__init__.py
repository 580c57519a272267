"""speechlm: train speech LLMs on packed (THD) sequences with CP, TP and FSDP2."""

__version__ = "0.1.0"
