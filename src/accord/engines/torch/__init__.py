"""torch.distributed: TorchCollective and the DDP, DP and FSDP strategies built on it."""
