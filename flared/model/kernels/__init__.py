"""CUDA-only model code: the paged decoder forward over static graph inputs and GPU sampling."""
