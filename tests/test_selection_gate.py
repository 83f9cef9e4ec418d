"""The 1.5-quantisation-step gate accepts the contract's selection and rejects real mistakes."""

import torch

from indexer import selection_gate, topk_select


def random_rows(seed, rows=64, cols=300):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, cols, generator=generator)
    valid = torch.randint(1, cols + 2, (rows,), generator=generator, dtype=torch.int32)
    return scores, valid


def test_accepts_the_exact_selection():
    scores, valid = random_rows(0)
    assert bool(selection_gate(topk_select(scores, valid), scores, valid).all())


def test_accepts_selection_from_slightly_perturbed_scores():
    scores, valid = random_rows(1)
    spread = scores.amax(1, keepdim=True) - scores.amin(1, keepdim=True)
    noisy = scores + (torch.rand(scores.shape, generator=torch.Generator().manual_seed(2)) - 0.5) * spread / 65534
    assert bool(selection_gate(topk_select(noisy, valid), scores, valid).all())


def test_rejects_wrong_selections():
    scores, valid = random_rows(3)
    valid[:] = 200
    good = topk_select(scores, valid)
    cases = []
    swapped_local = good.clone()
    swapped_local[:, -1] = 0
    cases.append(swapped_local)
    duplicate = good.clone()
    duplicate[:, 1] = duplicate[:, 0]
    cases.append(duplicate)
    worst = scores[:, :199].argmin(1).to(torch.int32)
    weak = good.clone()
    weak[:, 0] = worst  # drops the best page for the worst one
    cases.append(weak)
    reversed_order = good.clone()
    reversed_order[:, :15] = good[:, :15].flip(1)
    cases.append(reversed_order)
    out_of_range = good.clone()
    out_of_range[:, 3] = 199  # the local page is not a history page
    cases.append(out_of_range)
    for selection in cases:
        assert not bool(selection_gate(selection, scores, valid).any())


def test_short_rows_must_match_exactly():
    scores = torch.zeros(2, 20)
    valid = torch.tensor([5, 16], dtype=torch.int32)
    good = topk_select(scores, valid)
    assert bool(selection_gate(good, scores, valid).all())
    bad = good.clone()
    bad[0, 5] = 0
    assert selection_gate(bad, scores, valid).tolist() == [False, True]
