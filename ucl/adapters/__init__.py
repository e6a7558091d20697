"""ucl seen through other libraries' interfaces: a read-only Zarr v3 store of any step, and PyTorch DCP's
storage writer and reader."""
