"""hicache Mooncake backend."""
