import pytest

from kvsqueeze.eval.fitting import largest_fitting


@pytest.mark.parametrize("guess", [0, 1, 7, 50, 51, 52, 400, 10_000])
@pytest.mark.parametrize("limit", [3, 103, 104, 105, 1000])
def test_largest_fitting_finds_the_boundary_from_any_guess(guess, limit):
    calls = []

    def size(n):
        calls.append(n)
        return 3 + 2 * n  # fixed parts of 3 tokens, 2 tokens per piece

    n = largest_fitting(size, limit, guess=guess)
    assert size(n) <= limit < size(n + 1)
    assert len(set(calls)) < 40  # brackets and bisects, never walks


def test_a_size_that_stops_growing_is_refused():
    with pytest.raises(ValueError, match="truncate"):
        largest_fitting(lambda n: min(n, 50), 100)
