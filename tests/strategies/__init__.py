"""Each strategy in real fits: DDP, FSDP, DeepSpeed, Horovod, XLA and the single-process ones."""
