"""Scale-out: torchrun + FSDP2, loading into shards, the vLLM backend, the memory planner."""
