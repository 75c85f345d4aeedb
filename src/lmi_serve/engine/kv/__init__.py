"""The KV cache seam (protocol.py) and its layouts: dynamic, slots, encoder-decoder; prefix reuse; TP replication."""
