"""Engine builder: a TensorRT-LLM checkpoint (from pipeline/convert/) → a portable or trtllm engine directory."""
