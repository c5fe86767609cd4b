"""Clients of the Triton server: requests with timings, and the output verifier."""
