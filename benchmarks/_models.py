"""A randomly initialised Llama config sized from the command line, shared by the benchmarks."""


def random_llama_config(hidden: int, layers: int, vocab: int, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       max_position_embeddings=max_positions)
