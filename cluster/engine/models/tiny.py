"""A tiny random-weight Llama checkpoint (unit tests and ``--smoke`` benchmarks).

Built from a transformers ``LlamaConfig``, saved with ``save_pretrained`` and loaded through the
real loading code, with a small byte-level BPE tokenizer trained on the spot (ChatML special
tokens and chat template), so nothing is downloaded and no real model is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_CORPUS = """
The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that
learned to count: one, two, three, four, five, six, seven, eight, nine, ten. What is the capital
of France? Paris is the capital of France. def add(a, b): return a + b. The rain in Spain stays
mainly in the plain. Serving systems batch requests, cache prefixes and move KV blocks between
prefill and decode pools. 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """Train and save a byte-level BPE tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 2048,
            },
            indent=2,
        )
    )
    return int(tok.get_vocab_size())


def build_tiny_llama(
    out: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.3,
    **config_overrides: Any,
) -> Path:
    """Write a random Llama checkpoint directory; returns its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(path)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # Large random weights make the logits peaky, so greedy decoding has few near-ties.
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return path
