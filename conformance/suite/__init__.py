"""The conformance suite: the cases and their inputs (cases), the backend
registry (backends), running and comparing a case (compare, tolerance), the
`mha check` grid (check, sharded, sweep), the conformance vectors (vectors,
the vectors/ folder) and verifying a user's function against them (verify,
adapters, pytest_plugin), and the reports (report, environment, heatmaps,
junit)."""
