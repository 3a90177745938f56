import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_worker.sampler import SamplingRow, make_generator, sample


def row(temperature=1.0, top_k=0, top_p=1.0, seed=0) -> SamplingRow:
    return SamplingRow(temperature, top_k, top_p, make_generator(seed))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_greedy_and_top_k_1_are_argmax(seed):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(seed))
    argmax = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingRow(0.0, 0, 1.0, None)] * 3) == argmax
    assert sample(logits, [row(top_k=1, seed=s) for s in range(3)]) == argmax
    assert sample(logits, [row(top_p=1e-6, seed=s) for s in range(3)]) == argmax


def test_seed_reproducible_and_independent_of_batch():
    logits = torch.randn(4, 1000)
    alone = [sample(logits[2:3], [row(seed=7)])[0] for _ in range(3)]
    batched = sample(logits, [row(seed=1), row(0.0), row(seed=7), row(seed=3)])[2]
    assert alone == [batched] * 3
    draws = {sample(logits[2:3], [row(seed=s)])[0] for s in range(20)}
    assert len(draws) > 1


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]])
    generator = make_generator(0)
    top_k = {sample(logits, [SamplingRow(5.0, 2, 1.0, generator)])[0] for _ in range(200)}
    assert top_k == {0, 1}
    # probs at t=1: ~[.66, .24, .09, ...]: top_p 0.8 keeps {0, 1}
    top_p = {sample(logits, [SamplingRow(1.0, 0, 0.8, generator)])[0] for _ in range(200)}
    assert top_p == {0, 1}


def test_a_vanishing_temperature_is_greedy_and_non_finite_logits_fail_only_their_row():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[3, 0], logits[4, 49] = float("inf"), float("-inf")
    logits[2, 9] = 3e38  # large but finite
    tokens = sample(logits, [row(temperature=1e-40), row(), row(temperature=1e-40, seed=2), row(), row()])
    assert tokens == [logits[0].argmax().item(), None, 9, None, None]
