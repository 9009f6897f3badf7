"""Attention kernels: plain-torch references (CPU backend, test oracle) and Triton kernels (CUDA)."""
