"""Triton serving: model repository generation, Python-backend models and the tritonserver launcher."""
