"""Side tools that need no torch: leak-free splits, verifiable archives."""
