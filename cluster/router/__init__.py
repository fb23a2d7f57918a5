"""The Ray Serve ingress: validation, tokenization, auth, the decode relay. Torch-free."""
