"""Pure quantization math: no I/O, no module state. Tensors in, tensors out."""
