"""The Qwen3 configurations the GPU benchmarks build with random weights: speed and memory depend on
shapes, not on weight values, so no checkpoint is needed. Values from the published config.json files."""

QWEN3 = {
    "Qwen3-1.7B": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True
    ),
    "Qwen3-8B": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
}
QWEN3_COMMON = dict(
    model_type="qwen3",
    vocab_size=151936,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)

# A Qwen3 small enough for a CPU dry run of the GPU scripts (bench/gpu_check.py --tiny); it overrides QWEN3_COMMON.
QWEN3_TINY = {
    "Qwen3-tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}
