"""Storage tiers: the remote store, the disk repository (source of truth), host shared memory and GPUs
(the memory tiers keep one contract, base.py)."""
