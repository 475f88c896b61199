"""GPU checks for a machine with CUDA (``python -m tools.gpu_check``): GPU tests, greedy parity
of the GPU worker with the CPU one, and the decode benchmark eager vs CUDA graphs; ``prepare``
builds, on a machine without a GPU, the model parts and wheels that travel there."""
