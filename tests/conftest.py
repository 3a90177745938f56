"""Shared fixtures: tiny random-weight models (Llama, Qwen2) with the real tokenizer, and the real model's directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_helpers import save_tiny_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.2,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from model_worker.loader import resolve_model

    try:
        return resolve_model("")
    except FileNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def tokenizer(real_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), rope_theta=100000.0, eos_token_id=2, bos_token_id=1, **TINY)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), config, tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=1, **TINY)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), config, tokenizer)
