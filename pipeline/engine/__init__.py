"""The portable engine: a PyTorch Llama-family runtime that loads TensorRT-LLM checkpoints."""
