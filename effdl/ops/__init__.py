"""Custom autograd Functions and attention kernels with PyTorch fallbacks."""
