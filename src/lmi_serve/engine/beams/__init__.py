"""Beam search: the beam rows inside a batch and the jobs that own them."""
