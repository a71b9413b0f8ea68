"""Triton kernels, one per file, each with a pure-PyTorch reference."""
