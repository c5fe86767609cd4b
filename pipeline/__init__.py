"""specpipe: speculative-decoding engine pipeline (convert, build, serve, verify, compare)."""

__version__ = "0.1.0"
