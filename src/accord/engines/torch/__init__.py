"""torch.distributed: TorchCollective and the DDP and FSDP strategies built on it."""
