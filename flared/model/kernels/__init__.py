"""CUDA-only model code: the paged decoder forward over static graph inputs and GPU sampling."""

# The decode graphs' samplers (the fourth field of a graph key; True and False stand for FULL and GREEDY):
# the argmax, temperature with top-k and top-p (a sort for the masks), and temperature alone (no sort).
GREEDY, FULL, TEMPERATURE = 0, 1, 2
