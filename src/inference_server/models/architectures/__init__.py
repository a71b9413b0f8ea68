"""Model architectures as torch modules: the layers, attention contract and the per-family models built from a
``ModelSpec`` (they never read files; weights come from ``models.loading``)."""
