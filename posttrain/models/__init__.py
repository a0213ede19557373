"""The decoder (dense or MoE), attention, LoRA, quantisation, the reward model's head, Hugging Face interop."""
