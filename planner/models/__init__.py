"""What a GPU would do with the measured work: memory (need, CUDA's caching allocator, workspaces), kernels and time."""
