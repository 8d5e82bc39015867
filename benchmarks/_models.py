"""A randomly initialised Llama config sized from the command line, shared by the benchmarks."""


def random_llama_config(hidden: int, layers: int, vocab: int, max_positions: int):
    from transformers import LlamaConfig

    # Llama's MLP width: 8/3 of the hidden size rounded up to a multiple of 256. An odd width (2048 * 8 // 3 = 5461)
    # kept cuBLAS on Turing-era kernels on an H100 (a 1B model's unlearning step: 0.48 s, against 0.27 s aligned).
    intermediate = 256 * -(-hidden * 8 // 3 // 256)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       max_position_embeddings=max_positions)
