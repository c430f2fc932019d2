"""DeepSpeed: its collective (deepspeed.comm), the ZeRO strategy and its checkpoint format."""
