"""Attention kernels: blockwise (flash) attention, ring and all-gather context parallelism over
the `sequence` mesh axis, decoding against a sequence-sharded KV cache, and the platform's fused
kernels (cuDNN, splash). Below `models`: they see arrays, positions and segment ids, not configs."""
