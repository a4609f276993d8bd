"""What the user gives: the GPU catalog, the campaign spec, probe grids, and safe YAML reading."""
