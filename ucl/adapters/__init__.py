"""ucl seen through other libraries' interfaces: a read-only Zarr v3 store of any step, PyTorch DCP's
storage writer and reader, and the checkpointing of Lightning, the transformers Trainer and accelerate
(each imported only when its module is)."""
