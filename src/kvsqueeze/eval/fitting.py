"""The largest prompt that fits a token budget: one search for every generator of long prompts."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(size: Callable[[int], int], limit: int, guess: int = 0, cap: int | None = None) -> int:
    """The largest n >= 0 with `size(n) <= limit`, for a `size` that does not shrink as n grows.

    The caller has checked `size(0) <= limit`. The search brackets outward from `guess` (a good estimate saves
    tokenizations) by doubling steps, then bisects. A bracket passing `cap` (default: 64 * limit + 64, far more
    pieces than `limit` tokens can hold) means `size` stopped growing, e.g. a tokenizer that truncates: that
    raises ValueError rather than searching forever.
    """
    cap = 64 * limit + 64 if cap is None else cap
    guess = max(0, guess)
    if size(guess) <= limit:
        lo, step = guess, 1
        while size(hi := guess + step) <= limit:
            lo, step = hi, step * 2
            if hi > cap:
                raise ValueError("the token count does not grow with the text; does the tokenizer truncate?")
    else:
        hi, step = guess, 1
        while (lo := max(0, guess - step)) > 0 and size(lo) > limit:
            hi, step = lo, step * 2
    while hi - lo > 1:  # size(lo) <= limit < size(hi)
        mid = (lo + hi) // 2
        if size(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo
