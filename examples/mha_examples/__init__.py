"""Worked examples for checking your own attention against the shipped vectors
(docs/verify-in-ci.md). Installed with the package, so that

    mha verify --impl mha_examples.numpy_attention:attention
    pytest --mha-impl mha_examples.numpy_attention:attention

work straight after `pip install mha-conformance`. Copy a file, replace the
body by your own port, keep the signature.
"""
