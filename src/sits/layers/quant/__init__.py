"""Quantized weights (L3): the scheme a checkpoint asks for (`config`), FP8 linear layers
(`fp8_linear`), FP8 MoE experts (`fp8_moe`) and the module swaps that build them (`apply`)."""
