"""posttrain: JAX-native LLM post-training (SFT, preference alignment, RLVR) on a sharded MoE decoder."""
