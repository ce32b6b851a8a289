"""effdl.models.generate on a tiny GPT-2 (float64): greedy decoding with the key/value cache
equals the argmax of a full forward step by step, checkpointed blocks change nothing, a seeded
generator repeats its draws, top-k 1 is greedy, and decoding stops at a stop id."""

import pytest
import torch

from effdl.models.generate import generate, next_token
from effdl.models.gpt2 import build_gpt2, checkpoint_blocks, gpt2_config

PROMPT = [5, 17, 300, 42, 9, 1000, 3]
NEW = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_gpt2(gpt2_config("tiny", dropout=0.0)).double().eval()


def argmax_step_by_step(model, prompt, n) -> list[int]:
    """The reference: a full forward of all ids so far, argmax of the last position, n times."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_equals_argmax_step_by_step(model):
    assert generate(model, PROMPT, NEW) == argmax_step_by_step(model, PROMPT, NEW)


def test_checkpointed_blocks_and_training_mode_change_nothing():
    torch.manual_seed(1)
    model = build_gpt2(gpt2_config("tiny", dropout=0.1)).double()
    checkpoint_blocks(model, 2)
    model.train()
    out = generate(model, PROMPT, NEW)
    assert model.training  # the mode is restored
    assert out == argmax_step_by_step(model.eval(), PROMPT, NEW)


def test_a_seeded_generator_repeats_its_draws(model):
    def sampled(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return generate(model, PROMPT, NEW, temperature=1.0, top_k=50, generator=g)

    assert sampled(3) == sampled(3)
    assert sampled(3) != sampled(4)
    g = torch.Generator().manual_seed(0)
    top_1 = generate(model, PROMPT, NEW, temperature=0.7, top_k=1, generator=g)
    assert top_1 == generate(model, PROMPT, NEW)


def test_top_k_draws_only_among_the_k_largest():
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0, 4.5])
    g = torch.Generator().manual_seed(0)
    draws = {next_token(logits, 10.0, top_k=2, generator=g) for _ in range(200)}
    assert draws == {1, 4}
    assert next_token(torch.tensor([1.0, 3.0, 3.0])) == 1  # ties: the lowest id


def test_decoding_stops_after_a_stop_id(model):
    greedy = generate(model, PROMPT, NEW)
    stop = greedy[3]
    first = greedy.index(stop)
    assert generate(model, PROMPT, NEW, stop_ids={stop}) == greedy[: first + 1]


@pytest.mark.parametrize(("prompt", "new"), [([], 4), ([1] * 1020, 5)])
def test_a_prompt_that_does_not_fit_is_refused(model, prompt, new):
    with pytest.raises(ValueError, match="1024 positions"):
        generate(model, prompt, new)
