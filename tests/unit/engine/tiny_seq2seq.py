"""Tiny random encoder-decoder models for the engine tests (T5: relative positions; BART: position
embeddings and a forced `<s>`)."""

from __future__ import annotations

import torch


def tiny_seq2seq(kind: str, vocab: int):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=vocab, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0)).eval()
    model = tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval()
    model.generation_config.forced_bos_token_id = 0
    return model
