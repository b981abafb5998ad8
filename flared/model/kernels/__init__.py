"""CUDA-only model code: the paged decoder forward over static graph inputs and GPU sampling."""

import math

# The decode graphs' samplers (the fourth field of a graph key; True and False stand for FULL and GREEDY):
# the argmax, temperature with min-p, top-k and top-p (kernels.sampling.sample_full's walk for the masks), and
# temperature alone (one pass).
GREEDY, FULL, TEMPERATURE = 0, 1, 2


def min_p_log_threshold(min_p: float, temperature: float, at_unit_temperature: bool = False) -> float:
    """A row's ``min_p_log`` for sample_full: min-p keeps a token whose probability is at least ``min_p`` times the
    most likely one's, x / T >= max x / T + log(min_p) in the scaled logits the walk reads; llama.cpp's chain
    (``at_unit_temperature``) judges the unscaled logits, so the threshold divides by T. -inf: off (0)."""
    if min_p <= 0 or temperature <= 0:
        return float("-inf")
    return math.log(min_p) / (temperature if at_unit_temperature else 1.0)

