"""Paged-attention kernels: Triton implementations and plain-PyTorch references of the same
signatures (the references define what the kernels must compute, and run anywhere), and the
CPU backend (``cpu_attention``: the references, with decode attention read in place by a small
C loop)."""
