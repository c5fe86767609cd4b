"""Target and draft conversion into TensorRT-LLM 1.2 checkpoints (and back, for the portable engine)."""
