"""Paged-attention kernels: Triton implementations and plain-PyTorch references of the same
signatures (the references define what the kernels must compute, and run anywhere)."""
