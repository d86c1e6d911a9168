"""Model shapes the benchmarks build in code (random init, no hub download).

One place for both the learner and the engine benchmarks, so that their figures are of the
same model: ``FULL`` is the Qwen2-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP
4864, vocab 151936, tied embeddings: ~494M parameters), ``SMALL`` a ~5M-parameter one that a
CPU runs in seconds.
"""

FULL = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
            tie_word_embeddings=True)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024, vocab_size=8192, tie_word_embeddings=True)
