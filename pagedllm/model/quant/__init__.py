"""Quantized linear layers: int8 W8A8 and GGUF block formats computed natively."""
