"""The only package that imports several frameworks: backend registry, CLI,
and (as they land) cases, vectors, tolerance, compare and report."""
