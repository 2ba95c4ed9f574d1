"""Engine checkpoint formats: one module or subpackage per engine (dcp, megatron, vllm)."""
