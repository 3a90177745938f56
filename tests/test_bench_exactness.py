"""bench.exactness on the tiny random-weight Llama: cold outputs against prefix hits, and what it reports."""

from __future__ import annotations

from bench import exactness
from tests.engine_helpers import make_engine


def test_prompts_are_corpus_slices_of_the_lengths_asked_for():
    corpus = list(range(1000, 3000))
    prompts = exactness.corpus_prompts(corpus, 20, seed=3)
    assert prompts == exactness.corpus_prompts(corpus, 20, seed=3)  # seeded
    for prompt in prompts:
        assert exactness.LENGTHS[0] <= len(prompt) <= exactness.LENGTHS[1]
        start = corpus.index(prompt[0])
        assert prompt == corpus[start:start + len(prompt)]


def test_hits_reuse_the_cold_runs_pages_and_answer_the_same(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_pages=256)
    corpus = list(range(300, 2300))
    result = exactness.measure(engine, exactness.corpus_prompts(corpus, 6, seed=1), batch=3, new_tokens=6)
    assert result.prompts == 6 and result.differ == 0
    assert result.cold_cached_tokens == 0
    # every hit reuses its full pages but the one holding its last token (page size 4)
    assert result.hit_cached_tokens >= result.prompt_tokens - 6 * 4 * 2
    engine.check_integrity()
