"""Engine checkpoint formats: readers and writers of formats other than HF and shardctl ranks."""
