"""Side tools that need no torch: batch arithmetic, leak-free splits, verifiable archives."""
