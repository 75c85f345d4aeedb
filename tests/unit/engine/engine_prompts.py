"""Prompts shared by the engine tests: different lengths (padding is exercised), multi-byte text,
a chat-templated prompt, code and plain prose."""

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "Café ☕ naïve 東京 🚀 — a longer prompt with unicode and punctuation; it keeps going for a while.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Roses are red,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: Why is the sky blue?\nA:",
]
