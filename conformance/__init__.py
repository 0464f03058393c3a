"""The only package that imports several frameworks: suite/ (cases, the
comparison, tolerances, vectors, verify, reports: the conformance suite),
cli/ (the `mha` command and its file handling), native/ (the frameworks'
own attention APIs as backends, and conventions/, the tables that measure
them) and bench/ (`mha bench`)."""
