"""The sequence layer: a conversation rendered to ids (`prompt`) and packed samples as THD or BSHD
batches (`thd`). Pure functions of tensors and sizes; imports torch and `parallel.rounding` only."""
