"""The run journal and exact replay (batch and streaming)."""
